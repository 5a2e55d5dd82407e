-- Payment and refund ids from the keyed permutation (reliability 0006,
-- docs/adr/0017).
ALTER TABLE payments ALTER COLUMN payment_id DROP IDENTITY;
CREATE SEQUENCE payment_number_seq;
ALTER TABLE payments ALTER COLUMN payment_id SET DEFAULT next_opaque_id('payment_number_seq');
ALTER TABLE refunds ALTER COLUMN refund_id DROP IDENTITY;
CREATE SEQUENCE refund_number_seq;
ALTER TABLE refunds ALTER COLUMN refund_id SET DEFAULT next_opaque_id('refund_number_seq');
