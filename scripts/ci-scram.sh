#!/usr/bin/env bash
# CI's proof of the first-run path on a stock Debian PostgreSQL: a second
# cluster created with Debian's defaults (its own port, scram-sha-256 for
# host connections, peer on the socket), on which `make doctor` must report
# the password problem, and `make deps` then `make up` (the README's path)
# must bring the stack up. Drops the cluster and the .env it wrote after.
# Needs root (pg_createcluster); nothing else of the stack may be running.
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${SCRAM_PG_PORT:-5433}
VERSION=$(ls /etc/postgresql | sort -V | tail -1)
NAME=scramci

[ ! -e .env ] || { echo "ci-scram: .env exists; it would be clobbered" >&2; exit 1; }
cleanup() {
  scripts/stack.sh down >/dev/null 2>&1 || true
  rm -f .env
  pg_dropcluster --stop "$VERSION" "$NAME" >/dev/null 2>&1 || true
}
trap cleanup EXIT
pg_dropcluster --stop "$VERSION" "$NAME" >/dev/null 2>&1 || true

echo "== a stock cluster: $VERSION/$NAME on $PORT (Debian defaults)"
pg_createcluster "$VERSION" "$NAME" -p "$PORT" >/dev/null
pg_ctlcluster --skip-systemctl-redirect "$VERSION" "$NAME" start
grep -E '^host\s+all\s+all\s+127' "/etc/postgresql/$VERSION/$NAME/pg_hba.conf"

echo "== make doctor must name the problem"
if out=$(PG_PORT=$PORT make -s doctor 2>&1); then
  echo "$out"; echo "ci-scram: doctor passed on a cluster that asks for passwords" >&2; exit 1
fi
echo "$out" | grep -A1 "asks for a password" || { echo "$out"; echo "ci-scram: doctor did not say why" >&2; exit 1; }
echo "$out" | grep -q "fix: make deps" || { echo "ci-scram: doctor's fix is not make deps" >&2; exit 1; }

echo "== make deps (the README's fix)"
PG_PORT=$PORT make -s deps
grep -q "^PG_PORT=$PORT$" .env

echo "== make doctor now passes the PostgreSQL checks"
out=$(make -s doctor 2>&1 || true)
echo "$out" | sed -n '/^PostgreSQL/,/^RabbitMQ/p'
if echo "$out" | sed -n '/^PostgreSQL/,/^RabbitMQ/p' | grep -q FAIL; then
  echo "ci-scram: PostgreSQL still fails after make deps" >&2; exit 1
fi

echo "== make up and make demo on it"
make -s up
make -s demo
# The stack really runs on the scram cluster, with passwords.
PGPASSWORD=$(sed -n 's/^DB_ROLE_PASSWORD=//p' .env) \
  psql "postgres://commerce_owner@127.0.0.1:$PORT/orders" -Atc "SELECT count(*) FROM orders" \
  | grep -qv '^0$' || { echo "ci-scram: no orders on the scram cluster" >&2; exit 1; }
echo "ci-scram: ok"
