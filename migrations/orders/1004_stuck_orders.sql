-- Admission (docs/adr/0027, amended in session 34) counts a tenant's
-- pending orders placed in the last ADMISSION_STUCK_AFTER_SECS as in
-- flight, and older ones as stuck: both from this index, by its range on
-- created_at, where the index it replaces had to read each pending row.
CREATE INDEX orders_pending_since ON orders (tenant_id, created_at) WHERE status = 'pending';
DROP INDEX orders_in_flight;
