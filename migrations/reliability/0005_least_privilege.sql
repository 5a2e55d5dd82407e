-- Least privilege (docs/security.md): the relay changes only its own
-- bookkeeping on an outbox row, never what the event says; the runtime
-- role never deletes an idempotency key (expired ones are taken over in
-- place; the owner's maintenance deletes them).
REVOKE UPDATE ON outbox_messages FROM commerce_relay;
GRANT UPDATE (processed_at, attempts, available_at, last_error) ON outbox_messages TO commerce_relay;
REVOKE DELETE ON idempotency_keys FROM commerce_app;
