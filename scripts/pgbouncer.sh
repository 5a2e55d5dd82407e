#!/usr/bin/env bash
# Prints the path of a PgBouncer that `make e2e-pgbouncer` can use: 1.21 or
# later, the first with `max_prepared_statements` (sqlx names every
# statement it prepares; docs/adr/0026). The system's own if it is new
# enough; else Debian 13's source of 1.24.1, checked against the SHA-256
# Debian publishes, built once under target/tools. Progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

MIN=1.21
VERSION=1.24.1
SHA256=da72a3aba13072876d055a3e58dd4aba4a5de4ed6148e73033185245598fd3e0
URL=http://deb.debian.org/debian/pool/main/p/pgbouncer/pgbouncer_${VERSION}.orig.tar.gz
TOOLS=${CARGO_TARGET_DIR:-target}/tools
case $TOOLS in /*) ;; *) TOOLS=$PWD/$TOOLS ;; esac
PREFIX=$TOOLS/pgbouncer-$VERSION

say() { echo "pgbouncer: $*" >&2; }
new_enough() { # new_enough BINARY
  local v
  v=$("$1" --version 2>/dev/null | awk 'NR == 1 { print $2 }') || return 1
  [ -n "$v" ] && [ "$(printf '%s\n%s\n' "$MIN" "$v" | sort -V | head -1)" = "$MIN" ]
}

for candidate in "$(command -v pgbouncer || true)" /usr/sbin/pgbouncer "$PREFIX/bin/pgbouncer"; do
  if [ -n "$candidate" ] && [ -x "$candidate" ] && new_enough "$candidate"; then
    echo "$candidate"
    exit 0
  fi
done

# What the build needs, from Debian's packages.
missing=()
command -v make >/dev/null || missing+=(make)
command -v cc >/dev/null || missing+=(gcc)
command -v pkg-config >/dev/null || missing+=(pkg-config)
if command -v pkg-config >/dev/null; then
  pkg-config --exists libevent || missing+=(libevent-dev)
  pkg-config --exists openssl || missing+=(libssl-dev)
fi
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    say "installing ${missing[*]}"
    apt-get update -qq >&2 && apt-get install -y -qq "${missing[@]}" >&2
  elif command -v sudo >/dev/null; then
    say "installing ${missing[*]} (sudo)"
    sudo apt-get update -qq >&2 && sudo apt-get install -y -qq "${missing[@]}" >&2
  else
    say "the build needs: ${missing[*]} (apt-get install them)"
    exit 1
  fi
fi

say "building PgBouncer $VERSION from Debian's source (about 15 s on 2 cores), once"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
curl -fsSL --retry 3 -o "$work/src.tar.gz" "$URL"
echo "$SHA256  $work/src.tar.gz" | sha256sum -c --quiet >&2
tar xzf "$work/src.tar.gz" -C "$work"
(
  cd "$work/pgbouncer-$VERSION"
  ./configure --prefix="$PREFIX" --without-cares --without-pam --without-systemd >"$work/build.log" 2>&1 &&
    make -j"$(nproc)" >>"$work/build.log" 2>&1 &&
    make install >>"$work/build.log" 2>&1
) || { tail -30 "$work/build.log" >&2; exit 1; }
new_enough "$PREFIX/bin/pgbouncer"
echo "$PREFIX/bin/pgbouncer"
