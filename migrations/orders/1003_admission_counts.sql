-- Admission (docs/adr/0027) counts, per tenant and at most every
-- ADMISSION_REFRESH_MS per serving process, the orders in flight and those
-- created since its last count: both from an index, never the tenant's
-- whole history.
CREATE INDEX orders_in_flight ON orders (tenant_id) WHERE status = 'pending';
CREATE INDEX orders_created ON orders (tenant_id, created_at);
