-- Deliveries refused before anything was stored (a signature that does not verify, a stale
-- timestamp, a method or size the source does not take, fields that cannot be read), kept for
-- the operator with their reason and the parts of the request that tell a misconfigured secret
-- from an attack: never the body, a signature or any header's value but the user agent and
-- content type. Only a known source's: an unknown source id is counted (metric), not kept.
--
-- Bounded twice: each insert keeps its source's newest 100 and deletes the rest, so the table
-- holds at most 100 rows a source on day 60 as on day one; and ingest records at most one
-- refusal a second for each source and reason, so a flood of forgeries costs a write a second,
-- not one a request. A new table: no lock on any table the pipeline writes.
CREATE TABLE refused_deliveries (
    refusal_id   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    refused_at   timestamptz NOT NULL DEFAULT now(),
    tenant_id    text NOT NULL,
    source_id    text NOT NULL,
    -- The answer's status, and why: the refused-deliveries metric's reason (signature,
    -- too_large, unreadable, ...) and the check that failed (no_match, stale_timestamp, ...).
    status       smallint NOT NULL,
    reason       text NOT NULL,
    check_failed text NOT NULL,
    detail       text NOT NULL,
    method       text NOT NULL,
    body_bytes   integer NOT NULL,
    body_sha256  bytea NOT NULL CHECK (octet_length(body_sha256) = 32),
    -- The names of the headers it carried (no values).
    header_names text[] NOT NULL,
    user_agent   text,
    content_type text,
    -- Refusals of this source and reason not kept in the second before this one.
    also_refused integer NOT NULL DEFAULT 0
);

CREATE INDEX refused_deliveries_by_source ON refused_deliveries (source_id, refusal_id);
