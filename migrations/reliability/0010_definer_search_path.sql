-- A SECURITY DEFINER function runs with its owner's rights, so the tables
-- it names must be the ones meant. A search_path that does not list
-- pg_temp searches it first: a caller's temporary table named like ours
-- (parked_aggregates, payments) would stand in for it. PostgreSQL's
-- documentation prescribes pg_temp last (CREATE FUNCTION, "Writing
-- SECURITY DEFINER Functions Safely"). Every such function of this
-- database, whichever migration made it; a later one repeats this.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure FROM pg_proc p
        JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = 'public' AND p.prosecdef
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = pg_catalog, public, pg_temp', f);
    END LOOP;
END $$;
