-- Partners that do not sign (`auth = "partner"` in a sources file): a source admitted by a
-- pinned client certificate, its addresses and optionally a bearer token, never by a signature
-- (shared/src/partners.rs). `partner` holds its rules as JSON, validated by `hookctl sources
-- apply` before it is stored; NULL for every other source. A nullable column without a default
-- on a table written only by operators: catalog only.
ALTER TABLE sources ADD COLUMN partner jsonb;

-- The client certificates partners' requests came with: when each was first and last seen and
-- when it expires (API Gateway's validity, or the certificate itself locally), for the check
-- that warns 30 days before a pinned certificate expires. Written at most once a minute per
-- certificate by each ingest environment. A new table.
CREATE TABLE partner_certificates (
    source_id     text NOT NULL REFERENCES sources (source_id) ON DELETE CASCADE,
    sha256        bytea NOT NULL CHECK (octet_length(sha256) = 32),
    subject       text,
    not_after     timestamptz,
    first_seen_at timestamptz NOT NULL DEFAULT now(),
    last_seen_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source_id, sha256)
);
