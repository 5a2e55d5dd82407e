-- projection.history: each aggregate's events in the order they happened,
-- applied by an ordered subscription (docs/adr/0028). `position` is the
-- order this consumer applied them in; `aggregate_seq` the relay's number:
-- the e2e checker compares the two. RLS forced.

CREATE TABLE aggregate_history (
    tenant_id      bigint      NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    position       integer     NOT NULL,
    aggregate_seq  bigint,
    source         text        NOT NULL,
    message_id     bigint      NOT NULL,
    event_type     text        NOT NULL,
    occurred_at    timestamptz NOT NULL,
    payload        jsonb       NOT NULL,
    applied_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (tenant_id, aggregate_type, aggregate_id, position),
    UNIQUE (tenant_id, source, message_id)
);

ALTER TABLE aggregate_history ENABLE ROW LEVEL SECURITY;
ALTER TABLE aggregate_history FORCE  ROW LEVEL SECURITY;

CREATE POLICY tenant_isolation ON aggregate_history
    USING (tenant_id = (SELECT app_current_tenant())) WITH CHECK (tenant_id = (SELECT app_current_tenant()));

GRANT SELECT, INSERT ON aggregate_history TO commerce_app;
