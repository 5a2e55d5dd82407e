-- A delivery the broker hands back (its consumer died holding it) is tried
-- again only after one more try is recorded here, committed on its own.
-- The broker's count of returns cannot tell the event that takes its
-- consumer down from those prefetched behind it, handed back by the same
-- crashes and never tried; this count can (docs/adr/0028, amended in
-- session 29). A row lives until its event is applied, parked or
-- dead-lettered.
CREATE TABLE consumer_tries (
    tenant_id  bigint      NOT NULL,
    consumer   text        NOT NULL,
    source     text        NOT NULL,
    message_id bigint      NOT NULL,
    tries      integer     NOT NULL DEFAULT 1,
    tried_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, consumer, source, message_id)
);
ALTER TABLE consumer_tries ENABLE ROW LEVEL SECURITY;
ALTER TABLE consumer_tries FORCE  ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON consumer_tries
    USING (tenant_id = (SELECT app_current_tenant()))
    WITH CHECK (tenant_id = (SELECT app_current_tenant()));
GRANT SELECT, INSERT, UPDATE, DELETE ON consumer_tries TO commerce_app;
