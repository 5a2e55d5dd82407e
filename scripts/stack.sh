#!/usr/bin/env bash
# The local stack, natively: `up` builds and starts every service against the
# local PostgreSQL and RabbitMQ, `down` stops exactly what `up` started (by
# recorded pid), `logs` follows the logs, `status` shows what runs, `reset`
# stops the stack and drops its databases and queues (its data is lost),
# `verify` holds the projection and the graph to their sources (ADR 0035),
# `observe` starts a Prometheus (Debian's package) on the running stack.
set -euo pipefail
cd "$(dirname "$0")/.."
# make deps writes .env where PostgreSQL asks for passwords.
if [[ -f .env ]]; then set -a; . ./.env; set +a; fi

RUN=.run
PG_HOST=${PG_HOST:-127.0.0.1}
PG_PORT=${PG_PORT:-5432}
ADMIN_DATABASE_URL=${ADMIN_DATABASE_URL:-postgres://postgres@$PG_HOST:$PG_PORT/postgres}
AMQP_URL=${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
PROFILE=${PROFILE:-debug}
export AMQP_URL JWT_SECRET=${JWT_SECRET:-dev-secret-change-me}
# The same broker's management API (enabled below): each consumer holds its
# bindings to the broker's there, for its /readyz.
_amqp=${AMQP_URL#amqp://}
_host=${_amqp#*@}; _host=${_host%%[:/]*}
export RABBITMQ_MANAGEMENT_URL=${RABBITMQ_MANAGEMENT_URL:-http://${_amqp%%@*}@$_host:15672}
unset _amqp _host

# name:port, the provider's simulator and then services/roster.txt (the one
# list of the services); each service's database is of its own name.
SERVICES="psp-sim:8090 $(scripts/roster.sh entries | paste -sd' ')"
for _entry in $SERVICES; do
  _svc=${_entry%%:*}
  [[ $_svc == psp-sim ]] && continue
  _var="$(tr 'a-z-' 'A-Z_' <<<"$_svc")_DATABASE_URL"
  export "$_var=${!_var:-postgres://$PG_HOST:$PG_PORT/$_svc}"
done
unset _entry _svc _var
# The projection verifies its views against these on a schedule (ADR 0035).
export VERIFY_SOURCES=${VERIFY_SOURCES:-orders=$ORDERS_DATABASE_URL,inventory=$INVENTORY_DATABASE_URL,payments=$PAYMENTS_DATABASE_URL}

bin() { echo "${CARGO_TARGET_DIR:-target}/$PROFILE/$1"; }

# Every service but the simulator has a database of its own name.
databases() { for entry in $SERVICES; do [[ ${entry%%:*} == psp-sim ]] || echo "${entry%%:*}"; done; }

alive() { # alive NAME: the recorded pid runs our binary
  local pidfile=$RUN/pids/$1.pid pid
  [[ -f $pidfile ]] || return 1
  pid=$(cat "$pidfile")
  [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$(bin "$1")"
}

tcp_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

need_servers() {
  local missing=0
  if ! tcp_open "$PG_HOST" "$PG_PORT"; then
    echo "PostgreSQL is not reachable on $PG_HOST:$PG_PORT." >&2
    echo "  Debian: sudo apt-get install postgresql && sudo pg_ctlcluster \$(ls /etc/postgresql) main start" >&2
    missing=1
  fi
  local amqp_host_port=${AMQP_URL#*@}; amqp_host_port=${amqp_host_port%%/*}
  if ! tcp_open "${amqp_host_port%%:*}" "${amqp_host_port##*:}"; then
    echo "RabbitMQ is not reachable on $amqp_host_port." >&2
    echo "  Debian: sudo apt-get install rabbitmq-server && sudo rabbitmq-server -detached" >&2
    missing=1
  fi
  if ((missing)); then
    echo "Or, with Docker: docker compose -f compose/docker-compose.yml up --build" >&2
    exit 1
  fi
  # RELAY_MODE=log reads each outbox from a replication slot (docs/adr/0038).
  if [[ ${RELAY_MODE:-poll} == log ]] && command -v psql >/dev/null; then
    local level
    level=$(psql -h "$PG_HOST" -p "$PG_PORT" -U "${PGUSER:-postgres}" -Atc 'SHOW wal_level' 2>/dev/null || true)
    if [[ -n $level && $level != logical ]]; then
      echo "RELAY_MODE=log needs wal_level=logical (it is $level): as a superuser," >&2
      echo "  ALTER SYSTEM SET wal_level = logical; ALTER SYSTEM SET max_slot_wal_keep_size = '1GB';" >&2
      echo "  then restart PostgreSQL (sudo pg_ctlcluster \$(ls /etc/postgresql) main restart)" >&2
      exit 1
    fi
  fi
  # Every published outbox row leaves a dead row behind it; a server with
  # autovacuum off (a CI config) never clears them nor counts the tables,
  # and the relays cost more each minute (bench/src/server.rs). Said, not
  # changed: the server is the developer's.
  if command -v psql >/dev/null; then
    local autovacuum
    autovacuum=$(psql -h "$PG_HOST" -p "$PG_PORT" -U "${PGUSER:-postgres}" -Atc 'SHOW autovacuum' 2>/dev/null || true)
    if [[ $autovacuum == off ]]; then
      echo "warning: autovacuum is off on this PostgreSQL: the outboxes' dead rows are never" >&2
      echo "  cleared and the relays slow down as the stack runs. As a superuser:" >&2
      echo "  ALTER SYSTEM SET autovacuum = on; SELECT pg_reload_conf();" >&2
    fi
  fi
  # The projection's history is an ordered subscription: its partitions
  # hang off a consistent-hash exchange, a plugin that ships with RabbitMQ
  # and is off by default (docs/adr/0028). Enabled here where this user may.
  enable_plugin rabbitmq_consistent_hash_exchange "ordered subscriptions, docs/adr/0028"
  enable_plugin rabbitmq_management "reliability status: unacked counts and bindings"
}

enable_plugin() { # enable_plugin NAME WHY: on the local broker, where this user may
  local plugin=$1
  if command -v rabbitmq-plugins >/dev/null &&
    ! timeout 20 rabbitmq-plugins -q list -e -m 2>/dev/null | grep -qx "$plugin"; then
    echo "== enabling $plugin on the local broker ($2)"
    timeout 60 rabbitmq-plugins -q enable "$plugin" >/dev/null ||
      echo "   could not; run: sudo rabbitmq-plugins enable $plugin   (or make deps)" >&2
  fi
}

wait_ready() { # wait_ready NAME PORT
  local deadline=$((SECONDS + 120))
  until curl -fsS "http://127.0.0.1:$2/readyz" >/dev/null 2>&1; do
    if ! alive "$1"; then
      echo "  $1 exited; last lines of $RUN/logs/$1.log:" >&2
      tail -n 20 "$RUN/logs/$1.log" >&2
      # A migration this database ran has since been edited (a branch that
      # rewrote an unreleased migration): sqlx refuses to guess, and so do we.
      if tail -n 20 "$RUN/logs/$1.log" | grep -q 'VersionMismatch'; then
        echo "  $1's database ran an earlier version of a migration that has since changed." >&2
        echo "  make reset drops the stack's databases and queues (their data is lost); then make up." >&2
      fi
      exit 1
    fi
    if ((SECONDS >= deadline)); then
      echo "  $1 not ready after 120 s; see $RUN/logs/$1.log" >&2
      exit 1
    fi
    sleep 0.5
  done
}

up() {
  need_servers
  mkdir -p "$RUN/pids" "$RUN/logs"
  echo "== building ($PROFILE)"
  # A collector named in the environment: build with span export (docs/adr/0018).
  local features=()
  if [[ -n ${OTEL_EXPORTER_OTLP_ENDPOINT:-}${OTEL_EXPORTER_OTLP_TRACES_ENDPOINT:-} || ${OTEL_TRACES_EXPORTER:-} == *otlp* ]]; then
    features=(--features reliability/otel)
  fi
  # BUILD_FEATURES: the Makefile's, so that make up reuses CI's build.
  # shellcheck disable=SC2086
  if [[ $PROFILE == release ]]; then cargo build --release --locked --bins "${features[@]}"; else cargo build --locked --workspace --bins ${BUILD_FEATURES:-} "${features[@]}"; fi
  # Said before anything starts: pools past the server's limit fail later,
  # one process at a time, with "too many connections".
  local budget
  if budget=$(ADMIN_DATABASE_URL=$ADMIN_DATABASE_URL scripts/pool-budget.sh 2>/dev/null); then
    read -r server stack <<<"$budget"
    if (( server < stack )); then
      echo "warning: PostgreSQL takes $server connections; the stack's pools can hold $stack under load" >&2
      echo "         (raise max_connections, or set DB_POOL_SIZE lower in .env; make doctor)" >&2
    fi
  fi
  echo "== roles and databases"
  # shellcheck disable=SC2046
  "$(bin reliability)" setup --admin-url "$ADMIN_DATABASE_URL" $(databases)
  # The graph's store: a FalkorDB of our own (scripts/falkordb.sh, data in
  # $RUN/falkordb) unless GRAPH_URL names one; make down stops ours.
  if [[ -z ${GRAPH_URL:-} || -f $RUN/pids/falkordb.ours ]]; then
    echo "== FalkorDB (the graph's store)"
    scripts/falkordb.sh start
    touch "$RUN/pids/falkordb.ours"
    GRAPH_URL=$(scripts/falkordb.sh url)
  fi
  export GRAPH_URL
  for entry in $SERVICES; do
    local name=${entry%%:*} port=${entry##*:}
    if alive "$name"; then
      echo "== $name already running (pid $(cat "$RUN/pids/$name.pid"))"
      continue
    fi
    echo "== starting $name on :$port"
    setsid "$(bin "$name")" >>"$RUN/logs/$name.log" 2>&1 </dev/null &
    echo $! >"$RUN/pids/$name.pid"
  done
  for entry in $SERVICES; do
    wait_ready "${entry%%:*}" "${entry##*:}"
    echo "   ${entry%%:*} ready"
  done
  local token
  token=$("$(bin reliability)" token --tenant 1)
  # The CLI logs in as the stack does: with .env's passwords, where there are some.
  local operator="$(bin reliability) status"
  if [[ -f .env ]]; then operator="(set -a; . ./.env; $operator)"; fi
  cat <<MSG

The stack is up.
  orders      http://127.0.0.1:8081   (POST /orders, GET /orders/{id})
  inventory   http://127.0.0.1:8082   (POST /stock/adjustments, GET /products/{sku})
  payments    http://127.0.0.1:8083   (GET /payments?order_id=, POST /refunds)
  projection  http://127.0.0.1:8084   (GET /orders/{id}, GET /history/{order|product}/{id})
  graph       http://127.0.0.1:8085   (GET /graph/orders/{id}, GET /graph/products/{sku}/co-purchased|open-orders)
  psp-sim     http://127.0.0.1:8090   (GET /control/charges)
  metrics     http://127.0.0.1:1108{1,2,3,4,5}/metrics   (ops ports, loopback only: OPS_BIND_ADDRESS)
  operator    $operator   (what is stuck, per service and queue)
  traces      ${OTEL_EXPORTER_OTLP_TRACES_ENDPOINT:-${OTEL_EXPORTER_OTLP_ENDPOINT:-off (set OTEL_EXPORTER_OTLP_ENDPOINT to export spans)}}
  logs        make logs   ($RUN/logs/)

A token for tenant 1 (make token TENANT=n for others):
  export TOKEN=$token

Next: make demo    (or follow the walk-through in docs/walkthrough.md)
Stop: make down
MSG
}

down() {
  local any=0
  for entry in $SERVICES; do
    local name=${entry%%:*} pidfile=$RUN/pids/${entry%%:*}.pid
    if alive "$name"; then
      local pid; pid=$(cat "$pidfile")
      kill -TERM "$pid"
      for _ in $(seq 1 100); do alive "$name" || break; sleep 0.1; done
      if alive "$name"; then kill -KILL "$pid"; fi
      echo "stopped $name (pid $pid)"
      any=1
    fi
    rm -f "$pidfile"
  done
  if prometheus_alive; then
    kill -TERM "$(cat "$RUN/pids/prometheus.pid")"
    echo "stopped prometheus (pid $(cat "$RUN/pids/prometheus.pid"))"
    any=1
  fi
  rm -f "$RUN/pids/prometheus.pid"
  if [[ -f $RUN/pids/falkordb.ours ]]; then
    scripts/falkordb.sh stop
    rm -f "$RUN/pids/falkordb.ours"
    echo "stopped falkordb"
    any=1
  fi
  ((any)) || echo "nothing was running"
}

# Prometheus from Debian's package, scraping every process of `up` on its
# ops port, with the alert rules of compose/, and a page of the dashboard's
# panels as links into Prometheus's graphs (no Grafana needed).
OBSERVE_PORT=${OBSERVE_PORT:-9090}
prometheus_alive() {
  local pidfile=$RUN/pids/prometheus.pid
  [[ -f $pidfile ]] && grep -q prometheus "/proc/$(cat "$pidfile")/cmdline" 2>/dev/null
}

observe() {
  command -v prometheus >/dev/null || {
    echo "prometheus is missing: sudo apt-get install --no-install-recommends prometheus" >&2
    exit 1
  }
  local dir=$RUN/observe targets=() entry
  # The broker's own metrics (per queue: depth, consumers) for the queue alerts.
  enable_plugin rabbitmq_prometheus "per-queue metrics for Prometheus"
  mkdir -p "$dir/data" "$RUN/pids" "$RUN/logs"
  for entry in $SERVICES; do
    [[ ${entry%%:*} == psp-sim ]] || targets+=("\"127.0.0.1:$((${entry##*:} + 3000))\"")
  done
  cat >"$dir/prometheus.yml" <<YML
# Written by make observe: the ops port (API port + 3000) of every process of make up.
global: { scrape_interval: 5s, evaluation_interval: 5s }
rule_files: ["$PWD/compose/prometheus/alerts.yml"]
scrape_configs:
  - job_name: commerce
    static_configs: [{ targets: [$(IFS=,; echo "${targets[*]}")] }]
  - job_name: rabbitmq
    metrics_path: /metrics/per-object
    static_configs: [{ targets: ["127.0.0.1:15692"] }]
YML
  if prometheus_alive; then
    echo "== prometheus already running (pid $(cat "$RUN/pids/prometheus.pid")); reloading its configuration"
    kill -HUP "$(cat "$RUN/pids/prometheus.pid")"
  else
    echo "== starting prometheus on 127.0.0.1:$OBSERVE_PORT"
    setsid prometheus --config.file="$dir/prometheus.yml" --storage.tsdb.path="$dir/data" \
      --web.listen-address="127.0.0.1:$OBSERVE_PORT" >>"$RUN/logs/prometheus.log" 2>&1 </dev/null &
    echo $! >"$RUN/pids/prometheus.pid"
  fi
  python3 - "$OBSERVE_PORT" >"$dir/dashboard.html" <<'PY'
import html, json, sys, urllib.parse
port = sys.argv[1]
panels = json.load(open("compose/grafana/dashboards/commerce.json"))["panels"]
print("<!doctype html><meta charset=utf-8><title>Commerce reliability</title>")
print("<h1>Commerce reliability</h1><p>Each panel of the Grafana dashboard, as Prometheus graphs.</p><ul>")
for p in panels:
    if not p.get("targets"):
        print(f"</ul><h2>{html.escape(p['title'])}</h2><ul>")
        continue
    q = {}
    for i, t in enumerate(p.get("targets", [])):
        q[f"g{i}.expr"], q[f"g{i}.tab"], q[f"g{i}.range_input"] = t["expr"], "0", "1h"
    url = f"http://127.0.0.1:{port}/graph?" + urllib.parse.urlencode(q)
    print(f'<li><a href="{html.escape(url)}">{html.escape(p["title"])}</a></li>')
print(f'</ul><p><a href="http://127.0.0.1:{port}/alerts">Alerts</a> · '
      f'<a href="http://127.0.0.1:{port}/targets">Targets</a></p>')
PY
  # Ready once every process of the stack answered a scrape since now (the
  # data of an earlier run would say so too soon).
  local deadline=$((SECONDS + 60)) up=0 since
  since=$(date +%s)
  until ((up == ${#targets[@]})); do
    if ((SECONDS >= deadline)); then
      echo "  prometheus scrapes $up of ${#targets[@]} processes after 60 s: make status; $RUN/logs/prometheus.log" >&2
      exit 1
    fi
    sleep 1
    up=$(python3 - "$OBSERVE_PORT" "$since" <<'PY' 2>/dev/null || echo 0
import json, sys, urllib.parse, urllib.request
port, since = sys.argv[1], sys.argv[2]
q = f'up{{job="commerce"}} == 1 and timestamp(up{{job="commerce"}}) > {since}'
url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
print(len(json.load(urllib.request.urlopen(url, timeout=5))["data"]["result"]))
PY
)
  done
  cat <<MSG

Prometheus scrapes all ${#targets[@]} processes of the stack, with the alert rules.
  graphs      http://127.0.0.1:$OBSERVE_PORT/graph
  alerts      http://127.0.0.1:$OBSERVE_PORT/alerts
  dashboard   $PWD/$dir/dashboard.html   (each panel of compose/grafana's dashboard)
Stop: make down (stops it with the stack)
MSG
}

# A FalkorDB that is not ours (GRAPH_URL's, or another checkout's on our
# port) outlives the stop: the stack's graph there goes instead, or `up`
# would find the dropped databases' orders in it (a CI rehearsal's
# `make verify` did). Bounded; a server that is gone is nothing to drop.
drop_foreign_graph() {
  local url=${GRAPH_URL:-$(scripts/falkordb.sh url)} name
  local address=${url#*://}
  local host=${address%:*} port=${address##*:}
  for name in "${GRAPH_NAME:-commerce}" "${GRAPH_NAME:-commerce}.rebuild"; do
    timeout 5 bash -c 'exec 3<>"/dev/tcp/$1/$2" || exit 0
      printf "*2\r\n\$12\r\nGRAPH.DELETE\r\n\$%d\r\n%s\r\n" "${#3}" "$3" >&3
      head -n1 <&3 | grep -q "^+" && echo "dropped graph $3 on $1:$2"' _ "$host" "$port" "$name" 2>/dev/null || true
  done
}

reset() {
  down
  # shellcheck disable=SC2086
  if [[ $PROFILE == release ]]; then cargo build --quiet --release --locked --bin reliability; else cargo build --quiet --locked --workspace --bins ${BUILD_FEATURES:-}; fi
  local db
  for db in $(databases); do
    psql "$ADMIN_DATABASE_URL" -qc "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)"
    echo "dropped database $db"
  done
  # Queues hold events of the dropped databases: applying them later would
  # act on orders that no longer exist.
  # The subscriber queues `up` declares (make up prints them); lanes add
  # queues of their own, which rabbitmqctl lists where we may run it.
  local queues="inventory.stock payments.charges orders.saga projection.views projection.history.p0 projection.history.p1 projection.history.p2 projection.history.p3 graph.edges"
  if command -v rabbitmqctl >/dev/null && rabbitmqctl -q status >/dev/null 2>&1; then
    queues=$(timeout 120 rabbitmqctl -q list_queues name | grep -E "^($(databases | paste -sd'|'))\." | grep -v '\.dlq$' || true)
  fi
  # The graph our FalkorDB keeps is derived from the dropped databases too.
  scripts/falkordb.sh stop
  rm -rf "$RUN/falkordb"
  echo "dropped the graph ($RUN/falkordb)"
  drop_foreign_graph
  if [[ -n $queues ]]; then
    # shellcheck disable=SC2086
    "$(bin reliability)" queue delete --yes $queues
  fi
}

status() {
  for entry in $SERVICES; do
    local name=${entry%%:*}
    if alive "$name"; then echo "$name: running (pid $(cat "$RUN/pids/$name.pid"))"; else echo "$name: stopped"; fi
  done
}

logs() {
  mkdir -p "$RUN/logs"
  tail -n 20 -F "$RUN"/logs/*.log
}

# One verification pass of the projection and one of the graph against
# their sources (ADR 0035): exit 1 while a view differs. `make verify
# ARGS=--repair` re-derives them.
verify() {
  local status=0
  PROJECTION_DATABASE_URL=$PROJECTION_DATABASE_URL "$(bin projection)" verify "$@" || status=$?
  GRAPH_URL=${GRAPH_URL:-$(scripts/falkordb.sh url)} "$(bin graph)" verify "$@" || status=$?
  return $status
}

case "${1:-}" in
  up) up ;;
  verify) shift; verify "$@" ;;
  down) down ;;
  status) status ;;
  logs) logs ;;
  reset) reset ;;
  observe) observe ;;
  *) echo "usage: $0 up|down|status|logs|reset|observe|verify [--repair] [--json]" >&2; exit 2 ;;
esac
