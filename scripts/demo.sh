#!/usr/bin/env bash
# Places a few orders against the running stack (`make up`) and shows how
# each one ends, as the projection tells it: a success, a decline, an
# out-of-stock, and a refund.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v jq >/dev/null || { echo "make demo needs jq (Debian: apt-get install jq)" >&2; exit 1; }

TENANT=${TENANT:-1}
TOKEN=$(${CARGO_TARGET_DIR:-target}/${PROFILE:-debug}/reliability token --tenant "$TENANT")
RUN_ID=$(date +%s%N)
ORDERS=http://127.0.0.1:8081 INVENTORY=http://127.0.0.1:8082 PAYMENTS=http://127.0.0.1:8083 PROJECTION=http://127.0.0.1:8084 GRAPH=http://127.0.0.1:8085

post() { # post URL KEY JSON
  curl -fsS -X POST "$1" -H "Authorization: Bearer $TOKEN" -H "Idempotency-Key: $2" \
    -H 'Content-Type: application/json' -d "$3"
}
get() { curl -fsS "$1" -H "Authorization: Bearer $TOKEN"; }

order() { # order CUSTOMER SKU QUANTITY -> order id
  post "$ORDERS/orders" "demo-$RUN_ID-$1-$2" \
    "{\"customer_id\":\"$1\",\"currency\":\"EUR\",\"lines\":[{\"sku\":\"$2\",\"quantity\":$3,\"unit_price_cents\":1250}]}" | jq -r .order_id
}

settled() { # settled ORDER_ID: wait (30 s at most) until the projection shows a final state
  local deadline=$((SECONDS + 30)) view
  while ((SECONDS < deadline)); do
    view=$(get "$PROJECTION/orders/$1" 2>/dev/null || true)
    if [[ -n $view ]] && jq -e '.status == "confirmed" or .status == "cancelled"' <<<"$view" >/dev/null; then
      echo "$view"; return
    fi
    sleep 0.2
  done
  echo "order $1 did not settle within 30 s; see make logs" >&2; exit 1
}

show() { jq -c '{order_id, status, payment_status, reservation_status, refunded_cents, events: [.events[].type]}' <<<"$1"; }

echo "== stock: 5 x DEMO-$RUN_ID"
post "$INVENTORY/stock/adjustments" "stock-$RUN_ID" "{\"sku\":\"DEMO-$RUN_ID\",\"delta\":5,\"reason\":\"demo\"}" | jq -c .

echo "== a paid order (2 units)"
ok=$(order "c-1" "DEMO-$RUN_ID" 2)
show "$(settled "$ok")"

echo "== a declined payment (customer decline-1)"
show "$(settled "$(order "decline-1" "DEMO-$RUN_ID" 1)")"

echo "== out of stock (10 units)"
show "$(settled "$(order "c-2" "DEMO-$RUN_ID" 10)")"

echo "== refund 500 cents of the paid order, requested twice with one key"
payment=$(get "$PAYMENTS/payments?order_id=$ok" | jq -r '.[0].payment_id')
for _ in 1 2; do
  post "$PAYMENTS/refunds" "refund-$RUN_ID" "{\"payment_id\":$payment,\"amount_cents\":500}" | jq -c .
done
deadline=$((SECONDS + 30))
until [[ $(get "$PROJECTION/orders/$ok" | jq .refunded_cents) == 500 ]]; do
  ((SECONDS < deadline)) || { echo "refund not seen within 30 s" >&2; exit 1; }
  sleep 0.2
done
show "$(get "$PROJECTION/orders/$ok")"

echo "== the graph: the paid order's neighbourhood, once it has the refund"
deadline=$((SECONDS + 30))
until [[ $(get "$GRAPH/graph/orders/$ok" 2>/dev/null | jq '[.payments[].refunds[].amount_cents] | add') == 500 ]]; do
  ((SECONDS < deadline)) || { echo "the graph did not show the refund within 30 s; see make logs" >&2; exit 1; }
  sleep 0.2
done
get "$GRAPH/graph/orders/$ok" | jq -c '{order_id, status, customer_id, lines: [.lines[] | {sku, quantity, reserved, released}], payments: [.payments[] | {status, refunds: [.refunds[].amount_cents]}]}'
echo "== the graph: open orders a stock-out of DEMO-$RUN_ID would touch (none: all decided)"
get "$GRAPH/graph/products/DEMO-$RUN_ID/open-orders" | jq -c .

echo "== stock after: 2 sold, the declined order's unit released"
get "$INVENTORY/products/DEMO-$RUN_ID" | jq -c .
echo "== provider: charges per payment key"
curl -fsS http://127.0.0.1:8090/control/charges | jq -c '{total_charges, total_refunds}'
