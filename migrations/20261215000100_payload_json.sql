-- The console's payload search (`hookctl console`, JSON containment) reads a stored payload as
-- JSON. A payload that is not JSON (a form, other bytes) reads as NULL instead of failing the
-- whole search. A new function: no table is touched, no lock taken on one.
CREATE FUNCTION payload_json(payload bytea) RETURNS jsonb
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN convert_from(payload, 'UTF8')::jsonb;
EXCEPTION WHEN others THEN
    RETURN NULL;
END
$$;
