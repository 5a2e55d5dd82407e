-- claim_due_work with a deadline: the same claim, and each leased
-- payment's row as the claim left it, which the worker read before in a
-- transaction of its own per call (issue 44: one transaction fewer per
-- decided order). Refunds still read theirs: their columns are NULL here.
--
-- An overload, not a replacement: a worker of the previous release calls
-- the five-argument claim, and keeps working beside this one through a
-- rolling upgrade. That one becomes a wrapper of this one (at the end), so
-- the claim's rules live in one body. The search_path is set as migration
-- 1006 sets every definer's.
CREATE FUNCTION claim_due_work(max_rows integer, per_tenant integer, busy_tenants bigint[],
                               busy_counts integer[], lease_secs double precision,
                               deadline_secs double precision)
    RETURNS TABLE (kind text, tenant_id bigint, id bigint, attempt integer,
                   order_id bigint, customer_id text, amount_cents bigint, currency text,
                   outcome_unknown boolean, traceparent text, expired boolean,
                   not_after timestamptz)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
    AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH busy AS (SELECT * FROM unnest(busy_tenants, busy_counts) AS b (tenant_id, n)),
         tenants AS (
             SELECT t.tenant_id, greatest(per_tenant - coalesce(b.n, 0), 0) AS room
             FROM (SELECT DISTINCT p.tenant_id FROM payments p WHERE p.status = 'pending' AND p.next_attempt_at <= now()
                   UNION
                   SELECT DISTINCT r.tenant_id FROM refunds r WHERE r.status = 'pending' AND r.next_attempt_at <= now()) t
             LEFT JOIN busy b ON b.tenant_id = t.tenant_id),
         due AS (
             SELECT 'charge'::text AS kind, t.tenant_id, c.payment_id AS id, c.next_attempt_at, t.room
             FROM tenants t CROSS JOIN LATERAL (
                 SELECT p.payment_id, p.next_attempt_at FROM payments p
                 WHERE p.tenant_id = t.tenant_id AND p.status = 'pending' AND p.next_attempt_at <= now()
                 ORDER BY p.next_attempt_at LIMIT t.room FOR UPDATE SKIP LOCKED) c
             UNION ALL
             SELECT 'refund'::text, t.tenant_id, c.refund_id, c.next_attempt_at, t.room
             FROM tenants t CROSS JOIN LATERAL (
                 SELECT r.refund_id, r.next_attempt_at FROM refunds r
                 WHERE r.tenant_id = t.tenant_id AND r.status = 'pending' AND r.next_attempt_at <= now()
                 ORDER BY r.next_attempt_at LIMIT t.room FOR UPDATE SKIP LOCKED) c),
         ranked AS (
             SELECT d.*, row_number() OVER (PARTITION BY d.tenant_id ORDER BY d.next_attempt_at, d.id) AS rank
             FROM due d),
         picked AS (
             SELECT r.kind, r.tenant_id, r.id FROM ranked r WHERE r.rank <= r.room
             ORDER BY r.rank, r.next_attempt_at, r.tenant_id, r.kind, r.id LIMIT max_rows),
         charges AS (
             UPDATE payments p
             SET attempts = p.attempts + 1,
                 first_attempt_at = coalesce(p.first_attempt_at, now()),
                 -- The previous attempt's answer was never recorded: it may have charged.
                 doubt_sent_at = CASE WHEN p.answered_attempts < p.attempts
                                      THEN greatest(p.doubt_sent_at, p.sent_at) ELSE p.doubt_sent_at END,
                 outcome_unknown = p.outcome_unknown OR p.answered_attempts < p.attempts,
                 prev_sent_at = p.sent_at, sent_at = now(),
                 next_attempt_at = now() + make_interval(secs => lease_secs), updated_at = now()
             FROM picked
             WHERE picked.kind = 'charge' AND p.tenant_id = picked.tenant_id AND p.payment_id = picked.id
             -- The row as updated: what the call needs, read with its lease.
             RETURNING 'charge'::text, p.tenant_id, p.payment_id, p.attempts,
                       p.order_id, p.customer_id, p.amount_cents, p.currency, p.outcome_unknown,
                       p.traceparent,
                       -- Past the deadline only once an attempt made after it has not
                       -- settled the payment: a worker outage alone fails nothing.
                       coalesce(p.prev_sent_at >= p.first_attempt_at + make_interval(secs => deadline_secs), false),
                       p.sent_at + make_interval(secs => lease_secs)),
         refunded AS (
             UPDATE refunds r
             SET attempts = r.attempts + 1,
                 doubt_sent_at = CASE WHEN r.answered_attempts < r.attempts
                                      THEN greatest(r.doubt_sent_at, r.sent_at) ELSE r.doubt_sent_at END,
                 outcome_unknown = r.outcome_unknown OR r.answered_attempts < r.attempts,
                 sent_at = now(),
                 next_attempt_at = now() + make_interval(secs => lease_secs), updated_at = now()
             FROM picked
             WHERE picked.kind = 'refund' AND r.tenant_id = picked.tenant_id AND r.refund_id = picked.id
             RETURNING 'refund'::text, r.tenant_id, r.refund_id, r.attempts,
                       NULL::bigint, NULL::text, NULL::bigint, NULL::text, NULL::boolean,
                       NULL::text, NULL::boolean, NULL::timestamptz)
    SELECT * FROM charges UNION ALL SELECT * FROM refunded;
END $$;
REVOKE ALL ON FUNCTION claim_due_work(integer, integer, bigint[], integer[], double precision, double precision) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION claim_due_work(integer, integer, bigint[], integer[], double precision, double precision) TO commerce_app;

-- The five-argument claim, for a worker of the previous release: the same
-- claim, its four columns. The deadline only decides `expired`, which it
-- does not return.
CREATE OR REPLACE FUNCTION claim_due_work(max_rows integer, per_tenant integer, busy_tenants bigint[],
                                          busy_counts integer[], lease_secs double precision)
    RETURNS TABLE (kind text, tenant_id bigint, id bigint, attempt integer)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
    AS $$
BEGIN
    RETURN QUERY
    SELECT c.kind, c.tenant_id, c.id, c.attempt
    FROM claim_due_work(max_rows, per_tenant, busy_tenants, busy_counts, lease_secs, 0) c;
END $$;
