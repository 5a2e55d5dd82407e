#!/usr/bin/env bash
# The checkout's Python environment (.venv, git-ignored): the Python tools
# the Makefile uses, installed from PyPI by the user, never into the system
# (Debian ships no pip, and PEP 668 forbids it). Debian's python3-venv makes
# the venv (make deps installs it).
#   scripts/venv.sh PACKAGE[=VERSION]...   installs those missing; prints the venv's bin directory
set -euo pipefail
venv=$(cd "$(dirname "$0")/.." && pwd)/.venv
if [[ ! -x $venv/bin/python3 ]]; then
  python3 -m venv "$venv" >&2 || { echo "python3 -m venv failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
fi
missing=()
for spec in "$@"; do
  name=${spec%%[=<>]*}
  "$venv/bin/python3" -m pip show --quiet "$name" >/dev/null 2>&1 || missing+=("$spec")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "venv: installing ${missing[*]} into $venv" >&2
  "$venv/bin/python3" -m pip install --quiet --disable-pip-version-check "${missing[@]}" >&2
fi
echo "$venv/bin"
