-- Order per aggregate and parking (docs/adr/0028).

-- Each aggregate's events are numbered 1, 2, 3... by the relay that
-- publishes them, when an ordered subscription takes them: in the claim's
-- transaction, holding the aggregate (an advisory lock) to the commit, so
-- two relays never publish events of one aggregate at the same time and
-- the numbers follow the order of publication (docs/adr/0028).
ALTER TABLE outbox_messages ADD COLUMN aggregate_seq bigint;
ALTER TABLE outbox_messages_dlq ADD COLUMN aggregate_seq bigint;
ALTER TABLE outbox_messages_archive ADD COLUMN aggregate_seq bigint;

CREATE TABLE outbox_sequences (
    tenant_id      bigint NOT NULL,
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    last_seq       bigint NOT NULL,
    PRIMARY KEY (tenant_id, aggregate_type, aggregate_id)
);

-- The relay's ordering guard: is an earlier event of this aggregate still
-- pending? Walks only pending rows, like the claim.
CREATE INDEX outbox_messages_pending_aggregate
    ON outbox_messages (tenant_id, aggregate_type, aggregate_id, id) WHERE processed_at IS NULL;

-- An ordered consumer's position in each aggregate: the number of the
-- last event it applied. An event at or below it that is not a duplicate
-- came out of order: it parks its aggregate instead of being applied.
CREATE TABLE aggregate_positions (
    tenant_id      bigint      NOT NULL,
    consumer       text        NOT NULL,
    source         text        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    last_seq       bigint      NOT NULL,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, consumer, source, aggregate_type, aggregate_id)
);

-- A parked aggregate: its first event failed for good, so it and every
-- later event of the aggregate wait here, in arrival order, while the
-- consumer's other aggregates flow. `reliability park` lists, unparks
-- (release_requested_at: the consumer replays them in order, then
-- resumes) and skips.
CREATE TABLE parked_aggregates (
    tenant_id            bigint      NOT NULL,
    consumer             text        NOT NULL,
    source               text        NOT NULL,
    aggregate_type       text        NOT NULL,
    aggregate_id         text        NOT NULL,
    error                text        NOT NULL,
    parked_at            timestamptz NOT NULL DEFAULT now(),
    release_requested_at timestamptz,
    PRIMARY KEY (tenant_id, consumer, source, aggregate_type, aggregate_id)
);

CREATE TABLE parked_events (
    position       bigint      GENERATED ALWAYS AS IDENTITY,
    tenant_id      bigint      NOT NULL,
    consumer       text        NOT NULL,
    source         text        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    message_id     bigint      NOT NULL,
    aggregate_seq  bigint,
    event_type     text        NOT NULL,
    envelope       jsonb       NOT NULL,
    parked_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, consumer, source, message_id),
    FOREIGN KEY (tenant_id, consumer, source, aggregate_type, aggregate_id)
        REFERENCES parked_aggregates ON DELETE CASCADE
);
CREATE INDEX parked_events_in_order
    ON parked_events (tenant_id, consumer, source, aggregate_type, aggregate_id, position);

ALTER TABLE outbox_sequences    ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox_sequences    FORCE  ROW LEVEL SECURITY;
ALTER TABLE aggregate_positions ENABLE ROW LEVEL SECURITY;
ALTER TABLE aggregate_positions FORCE  ROW LEVEL SECURITY;
ALTER TABLE parked_aggregates   ENABLE ROW LEVEL SECURITY;
ALTER TABLE parked_aggregates   FORCE  ROW LEVEL SECURITY;
ALTER TABLE parked_events       ENABLE ROW LEVEL SECURITY;
ALTER TABLE parked_events       FORCE  ROW LEVEL SECURITY;

-- Only relays number events: they see every tenant's counters.
CREATE POLICY relay_all_tenants ON outbox_sequences TO commerce_relay USING (true) WITH CHECK (true);
CREATE POLICY tenant_isolation ON aggregate_positions
    USING (tenant_id = (SELECT app_current_tenant()))
    WITH CHECK (tenant_id = (SELECT app_current_tenant()));
CREATE POLICY tenant_isolation ON parked_aggregates
    USING (tenant_id = (SELECT app_current_tenant()))
    WITH CHECK (tenant_id = (SELECT app_current_tenant()));
CREATE POLICY tenant_isolation ON parked_events
    USING (tenant_id = (SELECT app_current_tenant()))
    WITH CHECK (tenant_id = (SELECT app_current_tenant()));

GRANT SELECT, INSERT, UPDATE ON outbox_sequences TO commerce_relay;
GRANT UPDATE (aggregate_seq) ON outbox_messages TO commerce_relay;
GRANT SELECT, INSERT, UPDATE ON aggregate_positions TO commerce_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON parked_aggregates TO commerce_app;
GRANT SELECT, INSERT, DELETE ON parked_events TO commerce_app;

-- What a consumer needs to see across tenants, and no more: which of its
-- aggregates are parked, since when, and which an operator released.
-- Runs as the owner (BYPASSRLS); the rows themselves stay tenant-scoped.
CREATE FUNCTION parked_overview(p_consumer text)
    RETURNS TABLE (tenant_id bigint, source text, aggregate_type text, aggregate_id text,
                   parked_at timestamptz, release_requested boolean)
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public
    AS $$ SELECT tenant_id, source, aggregate_type, aggregate_id, parked_at,
                 release_requested_at IS NOT NULL
          FROM parked_aggregates WHERE consumer = p_consumer $$;
REVOKE ALL ON FUNCTION parked_overview(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION parked_overview(text) TO commerce_app;
