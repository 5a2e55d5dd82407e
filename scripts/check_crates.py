#!/usr/bin/env python3
"""The crates keep their layering (ADR 0036), read from `cargo metadata`:
- no production crate (libs/*, services/*) takes `testkit` but as a
  dev-dependency, and none has a `testing` feature;
- no service, nor a library below it, depends on the CLI crate, `operator`;
- `reliability`, the pipeline, depends on none of ours but `contracts`;
- every crate under libs/ has a README that is its crate doc, and its
  sources stay under 8,000 lines.
(Cargo itself refuses a cycle, so an import that runs up does not compile.)
Usage: scripts/check_crates.py
"""
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIB_LINES = 8000
meta = json.loads(subprocess.run(
    ["cargo", "metadata", "--format-version", "1", "--no-deps", "--offline"],
    cwd=ROOT, capture_output=True, text=True, check=True).stdout)
ours = {p["name"] for p in meta["packages"]}
problems = []
for p in meta["packages"]:
    path = pathlib.Path(p["manifest_path"]).parent.relative_to(ROOT)
    production = path.parts[0] in ("libs", "services") and p["name"] != "testkit"
    if not production:
        continue
    if "testing" in p["features"]:
        problems.append(f"{p['name']}: a `testing` feature (test support is testkit's, a dev-dependency)")
    for d in p["dependencies"]:
        if d["name"] not in ours:
            continue
        normal = d["kind"] is None
        if d["name"] == "testkit" and normal:
            problems.append(f"{p['name']}: testkit as a normal dependency")
        if d["name"] == "operator" and normal:
            problems.append(f"{p['name']}: depends on the CLI crate")
        if p["name"] == "reliability" and normal and d["name"] != "contracts":
            problems.append(f"reliability: depends on {d['name']} (the pipeline is below every crate but contracts)")
    if path.parts[0] == "libs":
        lib = ROOT / path / "src" / "lib.rs"
        if not (ROOT / path / "README.md").exists() or '#![doc = include_str!("../README.md")]' not in lib.read_text():
            problems.append(f"{path}: its README.md is not its crate doc")
        lines = sum(sum(1 for _ in open(f, encoding="utf-8")) for f in (ROOT / path / "src").rglob("*.rs"))
        if lines > LIB_LINES:
            problems.append(f"{path}: {lines} lines of source (at most {LIB_LINES}: split it by concern)")
for problem in problems:
    print(f"check_crates: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
