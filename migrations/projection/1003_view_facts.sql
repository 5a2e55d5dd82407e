-- projection: the facts an order's current rows in the sources state,
-- written by a re-projection from the rows (docs/adr/0035, amended): an
-- order whose events are gone (past the archive) keeps its view. The view
-- is a function of its events and these facts together, each a true
-- statement that stays true (a terminal status, a held reservation, a
-- succeeded refund), so a fact and the event that said the same count
-- once. The timeline shows events only. RLS forced.

CREATE TABLE order_view_facts (
    tenant_id  bigint      NOT NULL,
    order_id   bigint      NOT NULL,
    -- The event type the fact stands for, and what makes it one of its
    -- kind: 0, or the payment's or the refund's id.
    event_type text        NOT NULL,
    ref        bigint      NOT NULL,
    payload    jsonb       NOT NULL,
    read_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, order_id, event_type, ref)
);

ALTER TABLE order_view_facts ENABLE ROW LEVEL SECURITY;
ALTER TABLE order_view_facts FORCE  ROW LEVEL SECURITY;

CREATE POLICY tenant_isolation ON order_view_facts
    USING (tenant_id = (SELECT app_current_tenant())) WITH CHECK (tenant_id = (SELECT app_current_tenant()));

GRANT SELECT ON order_view_facts TO commerce_app;
