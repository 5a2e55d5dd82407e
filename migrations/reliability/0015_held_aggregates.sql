-- An aggregate of a whole ordered subscription whose next number has not
-- come yet is held, not parked for a failure (docs/adr/0040): its later
-- events wait in the parked store, in number order, until the number
-- skipped arrives or `held_until` passes. NULL: parked for a failure, as
-- before, until an operator unparks or skips.
ALTER TABLE parked_aggregates ADD COLUMN held_until timestamptz;

-- The overview a consumer's release loop reads, with the hold's bound.
DROP FUNCTION parked_overview(text);
CREATE FUNCTION parked_overview(p_consumer text)
    RETURNS TABLE (tenant_id bigint, source text, aggregate_type text, aggregate_id text,
                   parked_at timestamptz, release_requested boolean, held_until timestamptz)
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
    AS $$ SELECT tenant_id, source, aggregate_type, aggregate_id, parked_at,
                 release_requested_at IS NOT NULL, held_until
          FROM parked_aggregates WHERE consumer = p_consumer $$;
REVOKE ALL ON FUNCTION parked_overview(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION parked_overview(text) TO commerce_app;
