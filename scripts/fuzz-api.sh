#!/usr/bin/env bash
# schemathesis against every service of the running stack (`make up`):
# every check, positive and negative data, FUZZ_EXAMPLES cases per
# operation and phase. Fails on any failure (5xx included).
set -euo pipefail
cd "$(dirname "$0")/.."
# From PyPI into the checkout's .venv (scripts/venv.sh), not the system.
PATH=$(scripts/venv.sh schemathesis):$PATH
TOKEN=$(target/debug/reliability token --tenant "${FUZZ_TENANT:-1}")
export TOKEN
examples=${FUZZ_EXAMPLES:-50}
status=0
for svc in $(scripts/roster.sh entries); do
  name=${svc%%:*} port=${svc##*:}
  var="$(tr 'a-z-' 'A-Z_' <<<"$name")_PORT"
  port=${!var:-$port}
  echo "== schemathesis: $name (http://127.0.0.1:$port/openapi.json, $examples examples per phase)"
  if ! schemathesis run "http://127.0.0.1:$port/openapi.json" --checks all \
      --phases examples,coverage,fuzzing --max-examples "$examples" --workers 2; then
    status=1
  fi
done
exit $status
