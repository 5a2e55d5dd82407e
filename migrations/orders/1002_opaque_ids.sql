-- Order ids from the keyed permutation (reliability 0006, docs/adr/0017).
ALTER TABLE orders ALTER COLUMN order_id DROP IDENTITY;
CREATE SEQUENCE order_number_seq;
ALTER TABLE orders ALTER COLUMN order_id SET DEFAULT next_opaque_id('order_number_seq');
