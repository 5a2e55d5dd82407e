#!/usr/bin/env bash
# What make up's processes may hold of PostgreSQL's connections, against
# what the server takes: prints "<server> <stack>". Each service process
# (services/roster.txt, role all) holds its own pools: DB_POOL_SIZE +
# DB_RELAY_POOL_SIZE + DB_OWNER_POOL_SIZE (defaults 16, 6, 2, as the
# settings' own), and the projection's and the graph's verification 2 to
# each of the three sources (VERIFY_SOURCES; ADR 0035). The server's count
# leaves out its superuser_reserved_connections. Needs ADMIN_DATABASE_URL.
set -euo pipefail
cd "$(dirname "$0")/.."
server=$(psql "$ADMIN_DATABASE_URL" -Atc "SELECT setting::int - current_setting('superuser_reserved_connections')::int FROM pg_settings WHERE name = 'max_connections'")
services=$(scripts/roster.sh names | wc -l)
verifying=2
stack=$(( services * (${DB_POOL_SIZE:-16} + ${DB_RELAY_POOL_SIZE:-6} + ${DB_OWNER_POOL_SIZE:-2}) + verifying * 3 * 2 ))
echo "$server $stack"
