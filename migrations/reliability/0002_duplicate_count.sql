-- Duplicate deliveries a consumer absorbed, per tenant and source: I2 held,
-- and visibly so (`reliability offsets`, the e2e table, a duplicate storm).
ALTER TABLE consumer_offsets ADD COLUMN duplicate_count bigint NOT NULL DEFAULT 0;
