-- __SERVICE__: its domain tables. Tenant-owned, RLS forced (docs/adr/0003).

CREATE TABLE items (
    tenant_id  bigint      NOT NULL,
    item_id    bigint      GENERATED ALWAYS AS IDENTITY,
    name       text        NOT NULL CHECK (length(name) BETWEEN 1 AND 100),
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, item_id)
);

CREATE TABLE item_audit (
    tenant_id bigint      NOT NULL,
    item_id   bigint      NOT NULL,
    seen_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, item_id)
);

ALTER TABLE items      ENABLE ROW LEVEL SECURITY;
ALTER TABLE items      FORCE  ROW LEVEL SECURITY;
ALTER TABLE item_audit ENABLE ROW LEVEL SECURITY;
ALTER TABLE item_audit FORCE  ROW LEVEL SECURITY;

CREATE POLICY tenant_isolation ON items
    USING (tenant_id = (SELECT app_current_tenant())) WITH CHECK (tenant_id = (SELECT app_current_tenant()));
CREATE POLICY tenant_isolation ON item_audit
    USING (tenant_id = (SELECT app_current_tenant())) WITH CHECK (tenant_id = (SELECT app_current_tenant()));

GRANT SELECT, INSERT ON items TO commerce_app;
GRANT SELECT, INSERT ON item_audit TO commerce_app;
