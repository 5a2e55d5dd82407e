#!/usr/bin/env bash
# Creates a service from templates/service:
# `make new-service NAME=shipping [PORT=8085] [ORDERED=4]`
# (scripts/new-service.sh NAME [PORT] [--ordered K]). With ORDERED its
# consumer's subscription is ordered per aggregate over K partitions (ADR 0028).
# The crate, its migrations folder, its line in services/roster.txt (which
# `make up`, the CLI, e2e and the bench read), and its entries in the compose
# file and Prometheus. See docs/template.md for what to change next.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "new-service: $*" >&2; exit 1; }
name=${1:-}
[[ $name =~ ^[a-z][a-z0-9_]{1,30}$ ]] || die "NAME must be 2 to 31 lower-case letters, digits or _, starting with a letter (got '${name}')"
[[ ! -e services/$name && ! -e migrations/$name ]] || die "services/$name or migrations/$name exists already"
shift
port='' ordered=''
while (($#)); do
  case $1 in
    --ordered) ordered=${2:-}; shift 2 || die "--ordered needs a partition count" ;;
    *) [[ -z $port ]] || die "unexpected argument '$1'"; port=$1; shift ;;
  esac
done
[[ -z $ordered || $ordered =~ ^[1-9][0-9]?$ ]] || die "--ordered takes a partition count from 1 to 99 (got '$ordered')"
# The roster's ports, and the provider simulator's.
used=$(scripts/roster.sh ports; echo 8090)
if [[ -z $port ]]; then
  port=8085
  while grep -qx "$port" <<<"$used" || [[ $port == 8090 ]]; do port=$((port + 1)); done
fi
! grep -qx "$port" <<<"$used" || die "port $port is taken"
env=$(tr '[:lower:]' '[:upper:]' <<<"$name")

cp -r templates/service "services/$name"
mkdir -p "migrations/$name"
cp templates/migration/1001.sql "migrations/$name/1001_$name.sql"
grep -rl '__SERVICE__\|__ENV__\|__PORT__' "services/$name" "migrations/$name" \
  | xargs sed -i "s/__SERVICE__/$name/g; s/__ENV__/$env/g; s/__PORT__/$port/g"
if [[ -n $ordered ]]; then
  perl -0pi -e "s/(Subscription::new\([^;]*\));/\1.ordered($ordered);/" "services/$name/src/audit.rs"
  grep -q ".ordered($ordered)" "services/$name/src/audit.rs" || die "could not make the subscription ordered"
fi

# The roster: make up, the CLI (status and the rest), e2e and the bench.
# The template publishes (its outbox): a relay runs for it.
printf '%-13s %-9s %s\n' "$name" "$port" yes >>services/roster.txt
# compose: the service, its database in setup, its binary in the image,
# and Prometheus' targets
python3 - "$name" "$port" "$env" <<'PY'
import pathlib, sys
name, port, env = sys.argv[1:]
compose = pathlib.Path("compose/docker-compose.yml")
text = compose.read_text()
block = f"""  {name}:
    <<: *service
    command: ["{name}"]
    environment:
      <<: *env
      {env}_DATABASE_URL: postgres://postgres:5432/{name}
    ports: ["127.0.0.1:{port}:{port}"]
    healthcheck: {{ test: ["CMD", "curl", "-fsS", "http://localhost:{port}/readyz"], interval: 5s }}

  prometheus:"""
text = text.replace("  prometheus:", block, 1)
text = text.replace('"orders", "inventory", "payments", "projection"', f'"orders", "inventory", "payments", "projection", "{name}"', 1)
compose.write_text(text)
# The image holds every binary a service runs.
dockerfile = pathlib.Path("compose/Dockerfile")
text = dockerfile.read_text()
assert "target/release/reliability /out/" in text, "compose/Dockerfile: where the binaries are copied moved"
dockerfile.write_text(text.replace("target/release/reliability /out/", f"target/release/reliability \\\n       target/release/{name} /out/", 1))
prom = pathlib.Path("compose/prometheus/prometheus.yml")
prom.write_text(prom.read_text().replace('"projection:11084"', f'"projection:11084", "{name}:{int(port) + 3000}"', 1))
PY
# The new workspace member enters Cargo.lock (no dependency changes).
cargo update --workspace --quiet
# Line widths depend on the name: format the new crate as the house does.
cargo fmt -p "$name"

cat <<MSG
Created services/$name (port $port) and migrations/$name.
  test it:      cargo nextest run -p $name
  run it:       make up   (it is in the stack now: http://127.0.0.1:$port)
  next steps:   docs/template.md
MSG
