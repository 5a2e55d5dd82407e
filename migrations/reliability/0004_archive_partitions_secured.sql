-- Archive partitions get the parent's row-level security and grants
-- (docs/adr/0014): a policy on the partitioned table does not cover a query
-- that names a partition, and grants are not inherited.
CREATE FUNCTION secure_archive_partition(part regclass) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    grant_row record;
BEGIN
    EXECUTE format('ALTER TABLE %s ENABLE ROW LEVEL SECURITY', part);
    EXECUTE format('ALTER TABLE %s FORCE ROW LEVEL SECURITY', part);
    IF NOT EXISTS (SELECT 1 FROM pg_policy WHERE polrelid = part AND polname = 'tenant_isolation') THEN
        EXECUTE format('CREATE POLICY tenant_isolation ON %s
                            USING (tenant_id = (SELECT app_current_tenant()))
                            WITH CHECK (tenant_id = (SELECT app_current_tenant()))', part);
    END IF;
    FOR grant_row IN
        SELECT a.privilege_type, r.rolname
        FROM pg_class c, aclexplode(c.relacl) a JOIN pg_roles r ON r.oid = a.grantee
        WHERE c.oid = 'outbox_messages_archive'::regclass AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT %s ON %s TO %I', grant_row.privilege_type, part, grant_row.rolname);
    END LOOP;
END $$;

SELECT secure_archive_partition(i.inhrelid::regclass)
FROM pg_inherits i WHERE i.inhparent = 'outbox_messages_archive'::regclass;
