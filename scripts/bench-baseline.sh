#!/usr/bin/env bash
# Builds the service binaries of a baseline commit, once, for `make bench`
# to run the saga through beside this tree's (issue 24: decided orders per
# core-second against the main the issue was written against). Prints the
# directory that holds them.
#
#   scripts/bench-baseline.sh [REV]     # REV defaults to 953eb30 (make bench: f3ff5b8)
#   BASELINE_PROFILE=debug scripts/bench-baseline.sh   # make e2e-upgrade's
#
# The build shares this tree's target directory, so only the workspace's
# own crates compile again; the binaries are copied out before this tree's
# build puts its own back (cargo re-links a fresh binary it finds replaced).
set -euo pipefail
rev=${1:-953eb30}
root=$(git rev-parse --show-toplevel)
target=${CARGO_TARGET_DIR:-$root/target}
case $target in /*) ;; *) target=$root/$target ;; esac
profile=${BASELINE_PROFILE:-release}
out=$target/baseline/$rev-$profile
bins=(orders inventory payments projection psp-sim)
# The graph too where the revision has one: the same subscriptions as
# this tree's stack (953eb30, make e2e-upgrade's, has none).
if git -C "$root" cat-file -e "$rev:services/graph" 2>/dev/null; then bins+=(graph); fi
if [ -x "$out/bin/psp-sim" ]; then
  echo "$out/bin"
  exit 0
fi
git -C "$root" cat-file -e "$rev^{commit}" 2>/dev/null || {
  echo "bench-baseline: commit $rev is not in this clone (a shallow clone? git fetch --unshallow)" >&2
  exit 1
}
rm -rf "$out/src" && mkdir -p "$out/src" "$out/bin"
git -C "$root" archive "$rev" | tar -x -C "$out/src"
echo "bench-baseline: building $rev's services ($profile) into $out/bin" >&2
pkgs=()
for b in "${bins[@]}"; do pkgs+=(-p "$b"); done
flag=--release
[ "$profile" = release ] || flag=
# A debug build takes this tree's debug level ([profile.dev] in
# Cargo.toml), not the baseline's own (953eb30 sets none: full debuginfo).
# Its dependencies are then the ones this tree's build compiled already,
# where versions and features match: 45 crates compiled here against 268
# (make e2e-upgrade builds this tree first for that).
if [ "$profile" = debug ]; then
  debug=$(sed -n '/^\[profile\.dev\]/,/^\[/{s/^debug *= *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p}' "$root/Cargo.toml")
  if [ -n "$debug" ]; then export CARGO_PROFILE_DEV_DEBUG=$debug; fi
fi
(cd "$out/src" && CARGO_TARGET_DIR=$target cargo build --locked $flag "${pkgs[@]}") >&2
for b in "${bins[@]}"; do cp "$target/$profile/$b" "$out/bin/$b"; done
# Nothing of the baseline's sources is needed any more.
rm -rf "$out/src"
echo "$out/bin"
