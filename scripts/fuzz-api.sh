#!/usr/bin/env bash
# schemathesis against every service of the running stack (`make up`):
# every check, positive and negative data, FUZZ_EXAMPLES cases per
# operation and phase. Fails on any failure (5xx included).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v schemathesis >/dev/null || pip install --quiet schemathesis
TOKEN=$(target/debug/reliability token --tenant "${FUZZ_TENANT:-1}")
export TOKEN
examples=${FUZZ_EXAMPLES:-50}
status=0
for svc in orders:${ORDERS_PORT:-8081} inventory:${INVENTORY_PORT:-8082} payments:${PAYMENTS_PORT:-8083} projection:${PROJECTION_PORT:-8084} graph:${GRAPH_PORT:-8085}; do
  name=${svc%%:*} port=${svc##*:}
  echo "== schemathesis: $name (http://127.0.0.1:$port/openapi.json, $examples examples per phase)"
  if ! schemathesis run "http://127.0.0.1:$port/openapi.json" --checks all \
      --phases examples,coverage,fuzzing --max-examples "$examples" --workers 2; then
    status=1
  fi
done
exit $status
