#!/usr/bin/env bash
# Makes sure the local PostgreSQL accepts TLS, so that the TLS tests (and
# `sslmode=require` URLs) work: Debian's clusters usually have it on with
# the snakeoil certificate; if not, a self-signed certificate is made in the
# data directory and TLS turned on (a reload, no restart). Idempotent.
set -euo pipefail
url=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
if [ "$(psql "$url" -Atc 'SHOW ssl')" = "on" ]; then
  exit 0
fi
datadir=$(psql "$url" -Atc 'SHOW data_directory')
echo "PostgreSQL has TLS off; making a self-signed certificate in $datadir"
openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=localhost" \
  -addext "subjectAltName=DNS:localhost,IP:127.0.0.1" \
  -keyout "$datadir/server.key" -out "$datadir/server.crt" 2>/dev/null
owner=$(stat -c %U "$datadir")
chown "$owner" "$datadir/server.key" "$datadir/server.crt" 2>/dev/null || true
chmod 600 "$datadir/server.key"
psql "$url" -qc "ALTER SYSTEM SET ssl_cert_file = '$datadir/server.crt'" \
  -c "ALTER SYSTEM SET ssl_key_file = '$datadir/server.key'" \
  -c "ALTER SYSTEM SET ssl = on" -c "SELECT pg_reload_conf()"
for _ in $(seq 1 20); do
  [ "$(psql "$url" -Atc 'SHOW ssl')" = "on" ] && exit 0
  sleep 0.5
done
echo "PostgreSQL did not turn TLS on; see its log" >&2
exit 1
