-- A rolling upgrade from a release whose relays do not number (before
-- docs/adr/0028) keeps every ordered history in outbox order, decided here
-- and not by a coordinator of ours (docs/adr/0028, amended in session 34).
--
-- The outbox shows its rows to a relay only if the session says it is one
-- of this release's: `reliability.relay` = 'numbers', which
-- `db::options_for_role` sends at connect for the relay role. A relay of an
-- older release, still running, then claims nothing from the moment this
-- commits, and goes idle; today's relays publish everything, numbered.
--
-- Why this is enough: CREATE POLICY takes the table's ACCESS EXCLUSIVE
-- lock, so it waits for an old relay's claim in flight (held across its
-- publish, ADR 0001), and its events are published and marked before this
-- commits. Today's consumers declare the ordered subscriptions' partitions
-- after their migrations, so no event an old relay published ever reaches
-- a partition. A policy with no row in it is a one-time filter: the claim's
-- plan is unchanged.
CREATE POLICY relays_that_number ON outbox_messages AS RESTRICTIVE TO commerce_relay
    USING (current_setting('reliability.relay', true) = 'numbers');
