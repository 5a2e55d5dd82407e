-- Progress rows striped per consumer lane (docs/adr/0010): a lane adds to a
-- row of its own, so lanes and replicas of one consumer do not queue on one
-- hot row per tenant and source. Readers sum over the stripes.
ALTER TABLE consumer_offsets ADD COLUMN stripe smallint NOT NULL DEFAULT 0;
ALTER TABLE consumer_offsets DROP CONSTRAINT consumer_offsets_pkey;
ALTER TABLE consumer_offsets ADD PRIMARY KEY (tenant_id, consumer, source, stripe);
