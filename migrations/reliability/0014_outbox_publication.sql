-- The log relay (docs/adr/0038) reads the outbox's inserts from a logical
-- replication slot through this publication: inserts only (the relay's own
-- marks and the archive's deletes are no news). Created whatever wal_level
-- is (PostgreSQL warns below `logical`); only a slot needs `logical`.
CREATE PUBLICATION reliability_outbox FOR TABLE outbox_messages WITH (publish = 'insert');
