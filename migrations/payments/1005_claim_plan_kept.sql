-- claim_due_work, unchanged in what it does, as PL/pgSQL instead of SQL.
--
-- PostgreSQL (before 18) plans the body of a SQL function that it cannot
-- inline (this one: SECURITY DEFINER, SET search_path, several statements'
-- worth of CTEs) afresh on every call. Measured on an empty table with
-- pgbench, one client: 0.77 ms a call as SQL, 0.10 ms as PL/pgSQL, whose
-- statements keep their plans for the session. The worker claims two or
-- three times per order (every commit of new work wakes it), so the SQL
-- version cost about 2 ms of PostgreSQL's CPU per decided order: the
-- single costliest statement in `make bench`'s pg_stat_statements.
-- docs/adr/0032-plans-kept-by-the-session.md.
CREATE OR REPLACE FUNCTION claim_due_work(max_rows integer, per_tenant integer, busy_tenants bigint[],
                               busy_counts integer[], lease_secs double precision)
    RETURNS TABLE (kind text, tenant_id bigint, id bigint, attempt integer)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = public
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
             RETURNING 'charge'::text, p.tenant_id, p.payment_id, p.attempts),
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
             RETURNING 'refund'::text, r.tenant_id, r.refund_id, r.attempts)
    SELECT * FROM charges UNION ALL SELECT * FROM refunded;
END $$;
