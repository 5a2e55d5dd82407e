#!/usr/bin/env python3
"""The ADR index, docs/adr/README.md, made from the ADRs themselves: each
one's title, status line, and the sections that amend it later
("## Amended ..."). `--check` fails when the file on disk differs (make
lint), so a new ADR or amendment cannot be left out of the index."""
import pathlib
import re
import sys

ADR = pathlib.Path(__file__).resolve().parent.parent / "docs" / "adr"
INDEX = ADR / "README.md"


def entry(path):
    lines = path.read_text().splitlines()
    title = re.sub(r"^#\s*\d+[.:]\s*", "", lines[0]).strip()
    status = next((l.split(":", 1)[1].strip() for l in lines if l.startswith("Status:")), "accepted")
    amended = [re.sub(r"^##\s*Amended\s*", "", l).rstrip(":").strip() for l in lines if l.startswith("## Amended")]
    number = path.name[:4]
    cell = status.replace("|", "\\|")
    if amended:
        cell += "; amended " + "; ".join(a.replace("|", "\\|") for a in amended)
    title = title.replace("|", "\\|")
    return f"| [{number}]({path.name}) | {title} | {cell} |"


def render():
    adrs = sorted(p for p in ADR.glob("[0-9][0-9][0-9][0-9]-*.md"))
    out = [
        "# Architecture decision records",
        "",
        "One decision a file, numbered in the order taken. A later decision that",
        "changes an earlier one says so in its status, and the earlier one gains",
        "an `## Amended ...` section. This index is made from the files",
        "(`python3 scripts/adr_index.py`); `make lint` fails when it is stale.",
        "",
        "| ADR | decision | status |",
        "|---|---|---|",
    ]
    out += [entry(p) for p in adrs]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        if not INDEX.exists() or INDEX.read_text() != text:
            sys.exit("docs/adr/README.md is stale: run python3 scripts/adr_index.py")
    else:
        INDEX.write_text(text)
