-- The reliability tables every service database carries: outbox (+ DLQ and
-- monthly archive), idempotency keys, consumer dedup and offsets.
--
-- Run by the owner role (commerce_owner). The runtime role commerce_app and
-- the relay role commerce_relay must already exist: `reliability setup-roles`
-- creates them. See docs/adr/0003-tenancy-and-roles.md.

-- A tenant-owned row is visible when its tenant_id equals the transaction's
-- app.tenant_id. An unset setting errors in current_setting() without the
-- `true`, and is '' on a pooled connection that served another tenant, so both
-- collapse to NULL, which matches nothing: fail closed. STABLE lets the planner
-- evaluate it once per statement.
CREATE FUNCTION app_current_tenant() RETURNS bigint
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT NULLIF(current_setting('app.tenant_id', true), '')::bigint $$;

------------------------------------------------------------------------------
-- Outbox
------------------------------------------------------------------------------
CREATE TABLE outbox_messages (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id      bigint      NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    event_version  integer     NOT NULL DEFAULT 1,
    payload        jsonb       NOT NULL,
    -- carried as AMQP headers (W3C traceparent, ...)
    headers        jsonb       NOT NULL DEFAULT '{}',
    occurred_at    timestamptz NOT NULL DEFAULT now(),
    available_at   timestamptz NOT NULL DEFAULT now(),
    processed_at   timestamptz,
    attempts       integer     NOT NULL DEFAULT 0,
    last_error     text
);

-- The relay's claim walks this index in id order and nothing else.
CREATE INDEX outbox_messages_pending ON outbox_messages (id) WHERE processed_at IS NULL;
-- Archival finds old processed rows without scanning pending ones.
CREATE INDEX outbox_messages_processed ON outbox_messages (processed_at) WHERE processed_at IS NOT NULL;

-- Every processed row is a dead tuple-to-be; the default 20 % scale factor
-- lets the claim slow down ~2.5x before autovacuum catches up.
ALTER TABLE outbox_messages SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02
);

-- Wake the relay on commit (NOTIFY is delivered at commit, deduplicated per
-- transaction), so latency is not the poll interval.
CREATE FUNCTION outbox_messages_notify() RETURNS trigger
    LANGUAGE plpgsql
    AS $$ BEGIN PERFORM pg_notify('outbox_messages', ''); RETURN NULL; END $$;

CREATE TRIGGER outbox_messages_notify
    AFTER INSERT ON outbox_messages
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_messages_notify();

CREATE TABLE outbox_messages_dlq (
    id             bigint      PRIMARY KEY, -- the outbox id, kept for tracing and re-drive
    tenant_id      bigint      NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    event_version  integer     NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL,
    occurred_at    timestamptz NOT NULL,
    attempts       integer     NOT NULL,
    last_error     text,
    failed_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE outbox_messages_archive (
    id             bigint      NOT NULL,
    tenant_id      bigint      NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    event_version  integer     NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL,
    occurred_at    timestamptz NOT NULL,
    available_at   timestamptz NOT NULL,
    processed_at   timestamptz,
    attempts       integer     NOT NULL,
    last_error     text,
    PRIMARY KEY (id, occurred_at)
) PARTITION BY RANGE (occurred_at);

-- Catches rows older than the oldest monthly partition (or newer than the
-- newest) so archival never fails on a missing partition.
CREATE TABLE outbox_messages_archive_default PARTITION OF outbox_messages_archive DEFAULT;

------------------------------------------------------------------------------
-- Idempotency keys
------------------------------------------------------------------------------
-- A key is claimed by inserting its row in the same transaction as the
-- handler's writes, so an in-flight key is an uncommitted row: concurrent
-- requests wait on it (bounded by lock_timeout), a crash rolls it back, and a
-- committed row always carries its response.
CREATE TABLE idempotency_keys (
    tenant_id             bigint      NOT NULL,
    scope                 text        NOT NULL,
    key                   text        NOT NULL,
    request_hash          bytea       NOT NULL,
    response_status       smallint,
    response_content_type text,
    response_body         bytea,
    created_at            timestamptz NOT NULL DEFAULT now(),
    completed_at          timestamptz,
    expires_at            timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, scope, key)
);
CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);

------------------------------------------------------------------------------
-- Consumers
------------------------------------------------------------------------------
-- One row per message a consumer has applied: the dedup record that makes an
-- effect happen once whatever the delivery order (docs/adr/0002).
CREATE TABLE processed_messages (
    tenant_id    bigint      NOT NULL,
    consumer     text        NOT NULL,
    source       text        NOT NULL,
    message_id   bigint      NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, consumer, source, message_id)
);
CREATE INDEX processed_messages_processed_at ON processed_messages (processed_at);

-- Per consumer and source partition (the publishing service and tenant): the
-- highest id applied and how many. Progress and lag for operators; never
-- used to skip a message.
CREATE TABLE consumer_offsets (
    tenant_id     bigint      NOT NULL,
    consumer      text        NOT NULL,
    source        text        NOT NULL,
    last_seen_id  bigint      NOT NULL,
    applied_count bigint      NOT NULL DEFAULT 0,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, consumer, source)
);

------------------------------------------------------------------------------
-- Row-level security: every table above is tenant-owned.
------------------------------------------------------------------------------
ALTER TABLE outbox_messages          ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox_messages          FORCE  ROW LEVEL SECURITY;
ALTER TABLE outbox_messages_dlq      ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox_messages_dlq      FORCE  ROW LEVEL SECURITY;
ALTER TABLE outbox_messages_archive  ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox_messages_archive  FORCE  ROW LEVEL SECURITY;
ALTER TABLE idempotency_keys         ENABLE ROW LEVEL SECURITY;
ALTER TABLE idempotency_keys         FORCE  ROW LEVEL SECURITY;
ALTER TABLE processed_messages       ENABLE ROW LEVEL SECURITY;
ALTER TABLE processed_messages       FORCE  ROW LEVEL SECURITY;
ALTER TABLE consumer_offsets         ENABLE ROW LEVEL SECURITY;
ALTER TABLE consumer_offsets         FORCE  ROW LEVEL SECURITY;

CREATE POLICY tenant_isolation ON outbox_messages
    USING (tenant_id = (SELECT app_current_tenant()))
    WITH CHECK (tenant_id = (SELECT app_current_tenant()));
CREATE POLICY tenant_isolation ON outbox_messages_dlq
    USING (tenant_id = (SELECT app_current_tenant()))
    WITH CHECK (tenant_id = (SELECT app_current_tenant()));
CREATE POLICY tenant_isolation ON outbox_messages_archive
    USING (tenant_id = (SELECT app_current_tenant()))
    WITH CHECK (tenant_id = (SELECT app_current_tenant()));
CREATE POLICY tenant_isolation ON idempotency_keys
    USING (tenant_id = (SELECT app_current_tenant()))
    WITH CHECK (tenant_id = (SELECT app_current_tenant()));
CREATE POLICY tenant_isolation ON processed_messages
    USING (tenant_id = (SELECT app_current_tenant()))
    WITH CHECK (tenant_id = (SELECT app_current_tenant()));
CREATE POLICY tenant_isolation ON consumer_offsets
    USING (tenant_id = (SELECT app_current_tenant()))
    WITH CHECK (tenant_id = (SELECT app_current_tenant()));

-- The relay publishes every tenant's events: it alone sees all outbox rows,
-- and may move them to the DLQ. It has no grant on any other table.
CREATE POLICY relay_all_tenants ON outbox_messages TO commerce_relay USING (true) WITH CHECK (true);
CREATE POLICY relay_all_tenants ON outbox_messages_dlq TO commerce_relay USING (true) WITH CHECK (true);

GRANT SELECT, INSERT ON outbox_messages TO commerce_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency_keys TO commerce_app;
GRANT SELECT, INSERT ON processed_messages TO commerce_app;
GRANT SELECT, INSERT, UPDATE ON consumer_offsets TO commerce_app;

GRANT SELECT, UPDATE, DELETE ON outbox_messages TO commerce_relay;
GRANT SELECT, INSERT ON outbox_messages_dlq TO commerce_relay;
