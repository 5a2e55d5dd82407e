-- orders: the order and its lines. Tenant-owned, RLS forced (ADR 0003).

CREATE TABLE orders (
    tenant_id     bigint      NOT NULL,
    order_id      bigint      GENERATED ALWAYS AS IDENTITY,
    customer_id   text        NOT NULL CHECK (length(customer_id) BETWEEN 1 AND 64),
    currency      text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    total_cents   bigint      NOT NULL CHECK (total_cents >= 0),
    status        text        NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'confirmed', 'cancelled')),
    cancel_reason text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, order_id)
);

CREATE TABLE order_lines (
    tenant_id        bigint  NOT NULL,
    order_id         bigint  NOT NULL,
    line_no          integer NOT NULL,
    sku              text    NOT NULL,
    quantity         integer NOT NULL CHECK (quantity BETWEEN 1 AND 10000),
    unit_price_cents bigint  NOT NULL CHECK (unit_price_cents BETWEEN 0 AND 100000000),
    PRIMARY KEY (tenant_id, order_id, line_no),
    FOREIGN KEY (tenant_id, order_id) REFERENCES orders (tenant_id, order_id)
);

ALTER TABLE orders      ENABLE ROW LEVEL SECURITY;
ALTER TABLE orders      FORCE  ROW LEVEL SECURITY;
ALTER TABLE order_lines ENABLE ROW LEVEL SECURITY;
ALTER TABLE order_lines FORCE  ROW LEVEL SECURITY;

CREATE POLICY tenant_isolation ON orders
    USING (tenant_id = (SELECT app_current_tenant()))
    WITH CHECK (tenant_id = (SELECT app_current_tenant()));
CREATE POLICY tenant_isolation ON order_lines
    USING (tenant_id = (SELECT app_current_tenant()))
    WITH CHECK (tenant_id = (SELECT app_current_tenant()));

GRANT SELECT, INSERT, UPDATE ON orders TO commerce_app;
GRANT SELECT, INSERT ON order_lines TO commerce_app;
