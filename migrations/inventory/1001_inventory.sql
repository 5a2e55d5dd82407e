-- inventory: stock per sku, reservations per order, adjustments. RLS forced.

CREATE TABLE products (
    tenant_id  bigint      NOT NULL,
    sku        text        NOT NULL,
    on_hand    bigint      NOT NULL,
    reserved   bigint      NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, sku),
    -- The database's own wall against overselling (I5): available = on_hand - reserved >= 0.
    CONSTRAINT products_on_hand_not_negative CHECK (on_hand >= 0),
    CONSTRAINT products_reserved_not_negative CHECK (reserved >= 0),
    CONSTRAINT products_reserved_within_on_hand CHECK (reserved <= on_hand)
);

CREATE TABLE reservations (
    tenant_id  bigint      NOT NULL,
    order_id   bigint      NOT NULL,
    status     text        NOT NULL CHECK (status IN ('reserved', 'rejected', 'committed', 'released')),
    reason     text,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, order_id)
);

CREATE TABLE reservation_lines (
    tenant_id bigint NOT NULL,
    order_id  bigint NOT NULL,
    sku       text   NOT NULL,
    quantity  bigint NOT NULL CHECK (quantity > 0),
    PRIMARY KEY (tenant_id, order_id, sku),
    FOREIGN KEY (tenant_id, order_id) REFERENCES reservations (tenant_id, order_id)
);

CREATE TABLE stock_adjustments (
    tenant_id     bigint      NOT NULL,
    adjustment_id bigint      GENERATED ALWAYS AS IDENTITY,
    sku           text        NOT NULL,
    delta         bigint      NOT NULL,
    reason        text        NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, adjustment_id)
);

ALTER TABLE products          ENABLE ROW LEVEL SECURITY;
ALTER TABLE products          FORCE  ROW LEVEL SECURITY;
ALTER TABLE reservations      ENABLE ROW LEVEL SECURITY;
ALTER TABLE reservations      FORCE  ROW LEVEL SECURITY;
ALTER TABLE reservation_lines ENABLE ROW LEVEL SECURITY;
ALTER TABLE reservation_lines FORCE  ROW LEVEL SECURITY;
ALTER TABLE stock_adjustments ENABLE ROW LEVEL SECURITY;
ALTER TABLE stock_adjustments FORCE  ROW LEVEL SECURITY;

CREATE POLICY tenant_isolation ON products
    USING (tenant_id = (SELECT app_current_tenant())) WITH CHECK (tenant_id = (SELECT app_current_tenant()));
CREATE POLICY tenant_isolation ON reservations
    USING (tenant_id = (SELECT app_current_tenant())) WITH CHECK (tenant_id = (SELECT app_current_tenant()));
CREATE POLICY tenant_isolation ON reservation_lines
    USING (tenant_id = (SELECT app_current_tenant())) WITH CHECK (tenant_id = (SELECT app_current_tenant()));
CREATE POLICY tenant_isolation ON stock_adjustments
    USING (tenant_id = (SELECT app_current_tenant())) WITH CHECK (tenant_id = (SELECT app_current_tenant()));

GRANT SELECT, INSERT, UPDATE ON products TO commerce_app;
GRANT SELECT, INSERT, UPDATE ON reservations TO commerce_app;
GRANT SELECT, INSERT ON reservation_lines TO commerce_app;
GRANT SELECT, INSERT ON stock_adjustments TO commerce_app;
