#!/usr/bin/env python3
"""Every path the docs name exists: the map matches the territory.

Reads ARCHITECTURE.md, README.md, docs/*.md and the crates' and services'
READMEs (not the CHANGELOG or the ADRs: they record the tree of their
day). A path is a backticked `dir/.../name` under one of the tree's
top-level folders, or a relative Markdown link; a backticked file name
without its folder (`consumer/park.rs`, named under its crate's heading)
must end the path of some file in the tree. `path:line` and
`path#anchor` are checked as the path. Paths that `./dev`, `make up` or
`make new-service` create are listed in GENERATED.
Usage: scripts/check_paths.py [--list]
"""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOP = sorted(
    p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "target"
)
DOCS = ["ARCHITECTURE.md", "README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
DOCS += sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("libs/*/README.md"))
DOCS += sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("services/*/README.md"))

# Made by the tools, not kept in the tree.
GENERATED = {"compose/.env", "services/shipping", "migrations/shipping"}
FILES = subprocess.run(
    ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
).stdout.split()
FILE_NAME = re.compile(r"^[\w./-]+\.(rs|sql|sh|py|toml|md|yml|yaml|json)$")

TICKED = re.compile(r"`([^`\s]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def candidates(text: str):
    for m in TICKED.finditer(text):
        token = m.group(1)
        first = token.split("/", 1)[0]
        if any(c in token for c in "*{}<>$…"):
            continue
        if "/" in token and first in TOP:
            yield token
        elif FILE_NAME.match(token) and not token.startswith((".", "/")):
            yield "*/" + token
    for m in LINK.finditer(text):
        target = m.group(1)
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        yield target


def exists(doc: pathlib.Path, token: str) -> bool:
    path = re.split(r"[#:]", token, maxsplit=1)[0].rstrip(".,;")
    if not path or path.rstrip("/") in GENERATED or path.startswith(tuple(g + "/" for g in GENERATED)):
        return True
    if path.startswith("*/"):
        name = path[1:]
        return any(f.endswith(name) or f == name[1:] for f in FILES)
    # Backticked paths are from the root; links are from the document.
    return (ROOT / path).exists() or (doc.parent / path).exists()


def main() -> int:
    missing = []
    for name in DOCS:
        doc = ROOT / name
        text = doc.read_text(encoding="utf-8")
        for n, line in enumerate(text.splitlines(), 1):
            for token in candidates(line):
                if "--list" in sys.argv:
                    print(f"{name}:{n}: {token}")
                if not exists(doc, token):
                    missing.append(f"{name}:{n}: {token}")
    for m in missing:
        print(f"names a path that does not exist: {m}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
