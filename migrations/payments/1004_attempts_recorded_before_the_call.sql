-- A request that may have left for the provider has an unknown outcome
-- until the provider says otherwise by key (docs/adr/0011, amended). The
-- claim that leases a payment or refund is the durable record that a
-- request may now leave: it numbers the attempt and stamps when it was
-- sent, and an attempt whose answer was never recorded (a crash, a failed
-- record transaction) makes the row's outcome unknown at the next claim.

ALTER TABLE payments
    -- The first claim: the deadline counts from here, not from when the
    -- payment was recorded (a worker outage before it fails nothing).
    ADD COLUMN first_attempt_at timestamptz,
    -- When the latest attempt was claimed (its request may have left then),
    -- and the one before it: a payment fails on its deadline only once an
    -- attempt made after the deadline has not settled it.
    ADD COLUMN sent_at timestamptz,
    ADD COLUMN prev_sent_at timestamptz,
    -- The latest attempt whose answer was recorded.
    ADD COLUMN answered_attempts integer NOT NULL DEFAULT 0,
    -- When the latest request whose outcome we do not know was sent: a
    -- look-up by key that finds nothing is final only once this is older
    -- than the provider's processing bound (PSP_LOOKUP_GRACE_SECS).
    ADD COLUMN doubt_sent_at timestamptz;

ALTER TABLE refunds
    ADD COLUMN sent_at timestamptz,
    ADD COLUMN answered_attempts integer NOT NULL DEFAULT 0,
    ADD COLUMN doubt_sent_at timestamptz;

-- Reconciliation queues at most one repair refund per payment at a time.
ALTER TABLE refunds ADD COLUMN repair boolean NOT NULL DEFAULT false;
CREATE UNIQUE INDEX refunds_one_open_repair ON refunds (tenant_id, payment_id)
    WHERE repair AND status = 'pending';

CREATE INDEX payments_due_by_tenant ON payments (tenant_id, next_attempt_at) WHERE status = 'pending';
CREATE INDEX refunds_due_by_tenant ON refunds (tenant_id, next_attempt_at) WHERE status = 'pending';

-- One claim for charges and refunds together: per tenant with due work, up
-- to its share (per_tenant less its calls in flight in the calling
-- process, busy), oldest first, rows another worker holds skipped (SKIP
-- LOCKED, so workers woken by one NOTIFY never queue behind each other);
-- then round-robin across tenants by rank, up to max_rows, leased and
-- numbered in the same statement. Returns ids only, as the functions it
-- replaces did (dropped below).
CREATE FUNCTION claim_due_work(max_rows integer, per_tenant integer, busy_tenants bigint[],
                               busy_counts integer[], lease_secs double precision)
    RETURNS TABLE (kind text, tenant_id bigint, id bigint, attempt integer)
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = public
    AS $$
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
    SELECT * FROM charges UNION ALL SELECT * FROM refunded $$;

REVOKE ALL ON FUNCTION claim_due_work(integer, integer, bigint[], integer[], double precision) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION claim_due_work(integer, integer, bigint[], integer[], double precision) TO commerce_app;

-- Replaced by claim_due_work: nothing calls them any more.
DROP FUNCTION claim_due_payments(integer, integer, bigint[], integer[], double precision);
DROP FUNCTION claim_due_refunds(integer, integer, bigint[], integer[], double precision);
DROP FUNCTION due_payments(integer);
DROP FUNCTION due_refunds(integer);
