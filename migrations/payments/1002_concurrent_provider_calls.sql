-- Many provider calls in flight, fairly (docs/adr/0011).

-- An attempt whose outcome we could not learn (timeout, reset, 5xx, a 2xx
-- that is not final): money may have moved, so a later 4xx alone may not
-- fail it, and past the deadline it is refunded by key.
ALTER TABLE payments ADD COLUMN outcome_unknown boolean NOT NULL DEFAULT false;
ALTER TABLE refunds  ADD COLUMN outcome_unknown boolean NOT NULL DEFAULT false;
-- A refund of whatever the provider charged under this key (a payment that
-- ran out of time with an unknown outcome has no charge id of ours).
ALTER TABLE refunds  ADD COLUMN charge_key text;

-- Claims up to max_rows due payments for the worker and leases them in one
-- statement, round-robin across tenants: a tenant's rank counts its calls
-- already in flight in the calling process (busy), and no tenant gets more
-- than per_tenant. Returns ids only, like due_payments.
CREATE FUNCTION claim_due_payments(max_rows integer, per_tenant integer, busy_tenants bigint[],
                                   busy_counts integer[], lease_secs double precision)
    RETURNS TABLE (tenant_id bigint, payment_id bigint)
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = public
    AS $$
    WITH busy AS (SELECT * FROM unnest(busy_tenants, busy_counts) AS b (tenant_id, n)),
         due AS (
             SELECT p.tenant_id, p.payment_id, p.next_attempt_at,
                    row_number() OVER (PARTITION BY p.tenant_id ORDER BY p.next_attempt_at, p.payment_id)
                        + COALESCE(b.n, 0) AS rank
             FROM payments p LEFT JOIN busy b ON b.tenant_id = p.tenant_id
             WHERE p.status = 'pending' AND p.next_attempt_at <= now()),
         picked AS (
             SELECT d.tenant_id, d.payment_id FROM due d WHERE d.rank <= per_tenant
             ORDER BY d.rank, d.next_attempt_at LIMIT max_rows)
    UPDATE payments p
    SET attempts = p.attempts + 1, next_attempt_at = now() + make_interval(secs => lease_secs), updated_at = now()
    FROM picked
    WHERE p.tenant_id = picked.tenant_id AND p.payment_id = picked.payment_id
      AND p.status = 'pending' AND p.next_attempt_at <= now()  -- another worker may have taken it
    RETURNING p.tenant_id, p.payment_id $$;

CREATE FUNCTION claim_due_refunds(max_rows integer, per_tenant integer, busy_tenants bigint[],
                                  busy_counts integer[], lease_secs double precision)
    RETURNS TABLE (tenant_id bigint, refund_id bigint)
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = public
    AS $$
    WITH busy AS (SELECT * FROM unnest(busy_tenants, busy_counts) AS b (tenant_id, n)),
         due AS (
             SELECT r.tenant_id, r.refund_id, r.next_attempt_at,
                    row_number() OVER (PARTITION BY r.tenant_id ORDER BY r.next_attempt_at, r.refund_id)
                        + COALESCE(b.n, 0) AS rank
             FROM refunds r LEFT JOIN busy b ON b.tenant_id = r.tenant_id
             WHERE r.status = 'pending' AND r.next_attempt_at <= now()),
         picked AS (
             SELECT d.tenant_id, d.refund_id FROM due d WHERE d.rank <= per_tenant
             ORDER BY d.rank, d.next_attempt_at LIMIT max_rows)
    UPDATE refunds r
    SET attempts = r.attempts + 1, next_attempt_at = now() + make_interval(secs => lease_secs), updated_at = now()
    FROM picked
    WHERE r.tenant_id = picked.tenant_id AND r.refund_id = picked.refund_id
      AND r.status = 'pending' AND r.next_attempt_at <= now()
    RETURNING r.tenant_id, r.refund_id $$;

REVOKE ALL ON FUNCTION claim_due_payments(integer, integer, bigint[], integer[], double precision),
                       claim_due_refunds(integer, integer, bigint[], integer[], double precision) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION claim_due_payments(integer, integer, bigint[], integer[], double precision),
                          claim_due_refunds(integer, integer, bigint[], integer[], double precision) TO commerce_app;
