-- Ids a client sees reveal nothing about other tenants (docs/adr/0017):
-- each comes from a plain sequence, put through a keyed permutation of
-- 48 bits (a 4-round Feistel network whose round function is HMAC-SHA-256
-- with a key made here, per database), then offset by 2^48. So ids are
-- unique (a permutation), never meet the ids issued before this migration
-- (all < 2^48), stay below 2^53 (exact in JavaScript numbers), and the gap
-- between two of a tenant's ids says nothing about what others did.
CREATE EXTENSION IF NOT EXISTS pgcrypto;

CREATE TABLE id_permutation_key (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    key      bytea   NOT NULL
);
INSERT INTO id_permutation_key (key) VALUES (gen_random_bytes(32));
REVOKE ALL ON id_permutation_key FROM PUBLIC;

-- The permutation itself: pure, for tests and for operators who must map
-- a sequence number to its id.
CREATE FUNCTION opaque_id(n bigint) RETURNS bigint
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    k bytea := (SELECT key FROM id_permutation_key);
    l bigint;
    r bigint;
    t bigint;
BEGIN
    IF n < 0 OR n >= 281474976710656 THEN
        RAISE EXCEPTION 'opaque_id: % is outside 0 .. 2^48', n;
    END IF;
    l := n >> 24;
    r := n & 16777215;
    FOR round IN 1..4 LOOP
        t := r;
        r := l # ('x' || encode(substring(hmac(convert_to(round || ':' || r, 'UTF8'), k, 'sha256') FROM 1 FOR 3), 'hex'))::bit(24)::bigint;
        l := t;
    END LOOP;
    RETURN 281474976710656 + ((l << 24) | r);
END $$;

-- A column default: the next number of `seq`, permuted. Runs as the owner,
-- so the roles that insert need no grant on the sequence or the key.
CREATE FUNCTION next_opaque_id(seq regclass) RETURNS bigint
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, public AS $$
    SELECT opaque_id(nextval(seq))
$$;
REVOKE ALL ON FUNCTION opaque_id(bigint), next_opaque_id(regclass) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION next_opaque_id(regclass) TO commerce_app;
