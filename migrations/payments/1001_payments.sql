-- payments: one payment per order, refunds against it. RLS forced.

CREATE TABLE payments (
    tenant_id          bigint      NOT NULL,
    payment_id         bigint      GENERATED ALWAYS AS IDENTITY,
    order_id           bigint      NOT NULL,
    customer_id        text        NOT NULL,
    amount_cents       bigint      NOT NULL CHECK (amount_cents >= 0),
    currency           text        NOT NULL,
    status             text        NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'captured', 'failed')),
    provider_charge_id text,
    failure_reason     text,
    -- Refunds accepted so far, in progress or done: the guard against refunding more than was captured.
    refunded_cents     bigint      NOT NULL DEFAULT 0,
    attempts           integer     NOT NULL DEFAULT 0,
    -- When the provider worker may next try; in the future while a worker holds the lease.
    next_attempt_at    timestamptz NOT NULL DEFAULT now(),
    last_error         text,
    -- The trace of the order, continued by the worker's events.
    traceparent        text,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, payment_id),
    UNIQUE (tenant_id, order_id),
    CONSTRAINT payments_refunds_within_amount CHECK (refunded_cents BETWEEN 0 AND amount_cents)
);
CREATE INDEX payments_due ON payments (next_attempt_at) WHERE status = 'pending';

CREATE TABLE refunds (
    tenant_id          bigint      NOT NULL,
    refund_id          bigint      GENERATED ALWAYS AS IDENTITY,
    payment_id         bigint      NOT NULL,
    amount_cents       bigint      NOT NULL CHECK (amount_cents > 0),
    status             text        NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'succeeded', 'failed')),
    provider_refund_id text,
    attempts           integer     NOT NULL DEFAULT 0,
    next_attempt_at    timestamptz NOT NULL DEFAULT now(),
    last_error         text,
    -- The trace of the refund request, continued by the worker's event.
    traceparent        text,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, refund_id),
    FOREIGN KEY (tenant_id, payment_id) REFERENCES payments (tenant_id, payment_id)
);
CREATE INDEX refunds_due ON refunds (next_attempt_at) WHERE status = 'pending';

ALTER TABLE payments ENABLE ROW LEVEL SECURITY;
ALTER TABLE payments FORCE  ROW LEVEL SECURITY;
ALTER TABLE refunds  ENABLE ROW LEVEL SECURITY;
ALTER TABLE refunds  FORCE  ROW LEVEL SECURITY;

CREATE POLICY tenant_isolation ON payments
    USING (tenant_id = (SELECT app_current_tenant())) WITH CHECK (tenant_id = (SELECT app_current_tenant()));
CREATE POLICY tenant_isolation ON refunds
    USING (tenant_id = (SELECT app_current_tenant())) WITH CHECK (tenant_id = (SELECT app_current_tenant()));

GRANT SELECT, INSERT, UPDATE ON payments TO commerce_app;
GRANT SELECT, INSERT, UPDATE ON refunds TO commerce_app;

-- The provider worker must find due work of every tenant, then handles each
-- item in a transaction scoped to its tenant. These functions (run as the
-- owner) reveal only which ids are due, and nothing else, to the runtime role.
CREATE FUNCTION due_payments(max_rows integer) RETURNS TABLE (tenant_id bigint, payment_id bigint)
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public
    AS $$ SELECT tenant_id, payment_id FROM payments
          WHERE status = 'pending' AND next_attempt_at <= now()
          ORDER BY next_attempt_at LIMIT max_rows $$;
CREATE FUNCTION due_refunds(max_rows integer) RETURNS TABLE (tenant_id bigint, refund_id bigint)
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public
    AS $$ SELECT tenant_id, refund_id FROM refunds
          WHERE status = 'pending' AND next_attempt_at <= now()
          ORDER BY next_attempt_at LIMIT max_rows $$;
REVOKE ALL ON FUNCTION due_payments(integer), due_refunds(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION due_payments(integer), due_refunds(integer) TO commerce_app;

-- Wakes the worker on commit of new work.
CREATE FUNCTION payments_work_notify() RETURNS trigger
    LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_notify('payments_work', ''); RETURN NULL; END $$;
CREATE TRIGGER payments_work_notify AFTER INSERT ON payments FOR EACH STATEMENT EXECUTE FUNCTION payments_work_notify();
CREATE TRIGGER refunds_work_notify AFTER INSERT ON refunds FOR EACH STATEMENT EXECUTE FUNCTION payments_work_notify();
