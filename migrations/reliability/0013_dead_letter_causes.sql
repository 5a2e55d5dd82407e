-- Why a consumer dead-lettered an event: the handler's error, which the
-- broker's dead letter does not carry (its x-death says only "rejected").
-- Written, committed on its own, just before the reject, so that the
-- operator's console can group a queue's dead letters by cause (ADR 0037,
-- amended in session 36). A letter whose cause was never written (a
-- malformed message has no tenant; a sink keeps no table here) shows as
-- such. Rows are forgotten with the dedup records.
CREATE TABLE dead_letter_causes (
    tenant_id        bigint      NOT NULL,
    consumer         text        NOT NULL,
    source           text        NOT NULL,
    message_id       bigint      NOT NULL,
    event_type       text        NOT NULL,
    reason           text        NOT NULL,
    error_class      text        NOT NULL,
    error            text        NOT NULL,
    dead_lettered_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, consumer, source, message_id)
);
CREATE INDEX dead_letter_causes_age ON dead_letter_causes (dead_lettered_at);
ALTER TABLE dead_letter_causes ENABLE ROW LEVEL SECURITY;
ALTER TABLE dead_letter_causes FORCE  ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON dead_letter_causes
    USING (tenant_id = (SELECT app_current_tenant()))
    WITH CHECK (tenant_id = (SELECT app_current_tenant()));
GRANT SELECT, INSERT, UPDATE ON dead_letter_causes TO commerce_app;
