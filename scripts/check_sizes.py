#!/usr/bin/env python3
"""No Rust source file outside tests/ is over 400 lines (the house style):
a file that grows past it is split by concern, not trimmed.
Usage: scripts/check_sizes.py
"""
import pathlib
import subprocess
import sys

LIMIT = 400
ROOT = pathlib.Path(__file__).resolve().parent.parent

files = subprocess.run(
    ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.rs"],
    cwd=ROOT, capture_output=True, text=True, check=True,
).stdout.split()
over = []
for name in files:
    if "/tests/" in f"/{name}" or not (ROOT / name).exists():
        continue
    lines = sum(1 for _ in open(ROOT / name, encoding="utf-8"))
    if lines > LIMIT:
        over.append(f"{name}: {lines} lines")
for o in over:
    print(f"over {LIMIT} lines outside tests/: {o}", file=sys.stderr)
sys.exit(1 if over else 0)
