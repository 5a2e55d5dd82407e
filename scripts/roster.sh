#!/usr/bin/env bash
# The services of services/roster.txt, for the scripts and the Makefile:
#   scripts/roster.sh names     orders inventory …
#   scripts/roster.sh entries   orders:8081 inventory:8082 …
#   scripts/roster.sh ports     8081 8082 …
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:-names} in
  names) awk '{sub(/#.*/, "")} NF {print $1}' services/roster.txt ;;
  entries) awk '{sub(/#.*/, "")} NF {print $1 ":" $2}' services/roster.txt ;;
  ports) awk '{sub(/#.*/, "")} NF {print $2}' services/roster.txt ;;
  *) echo "usage: scripts/roster.sh names|entries|ports" >&2; exit 2 ;;
esac
