-- projection: an order view built only from events. RLS forced.

-- Every event the projection applied, per order: the view is a pure
-- function of this set, so delivery order cannot change it.
CREATE TABLE order_view_events (
    tenant_id   bigint      NOT NULL,
    order_id    bigint      NOT NULL,
    source      text        NOT NULL,
    message_id  bigint      NOT NULL,
    event_type  text        NOT NULL,
    occurred_at timestamptz NOT NULL,
    payload     jsonb       NOT NULL,
    PRIMARY KEY (tenant_id, order_id, source, message_id)
);

CREATE TABLE order_views (
    tenant_id          bigint      NOT NULL,
    order_id           bigint      NOT NULL,
    status             text        NOT NULL,
    total_cents        bigint,
    currency           text,
    payment_status     text        NOT NULL,
    reservation_status text        NOT NULL,
    refunded_cents     bigint      NOT NULL DEFAULT 0,
    updated_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, order_id)
);

ALTER TABLE order_view_events ENABLE ROW LEVEL SECURITY;
ALTER TABLE order_view_events FORCE  ROW LEVEL SECURITY;
ALTER TABLE order_views       ENABLE ROW LEVEL SECURITY;
ALTER TABLE order_views       FORCE  ROW LEVEL SECURITY;

CREATE POLICY tenant_isolation ON order_view_events
    USING (tenant_id = (SELECT app_current_tenant())) WITH CHECK (tenant_id = (SELECT app_current_tenant()));
CREATE POLICY tenant_isolation ON order_views
    USING (tenant_id = (SELECT app_current_tenant())) WITH CHECK (tenant_id = (SELECT app_current_tenant()));

GRANT SELECT, INSERT ON order_view_events TO commerce_app;
GRANT SELECT, INSERT, UPDATE ON order_views TO commerce_app;
