-- The ingest path: trusted source configuration, the event queue (which is also the dedup key),
-- and the record of authenticated deliveries that could not join the queue.

-- One row per webhook endpoint (`POST /webhooks/{source_id}`). This is trusted configuration:
-- the tenant of every event comes from here, never from a request body.
CREATE TABLE sources (
    source_id           text PRIMARY KEY
                        CHECK (source_id ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$'),
    tenant_id           text NOT NULL CHECK (length(tenant_id) BETWEEN 1 AND 128),
    scheme              text NOT NULL
                        CHECK (scheme IN ('stripe', 'standard_webhooks', 'github', 'shopify', 'slack')),
    -- Secrets Manager secret name or ARN (or a key of the local secrets file). The signing
    -- secret is the secret's AWSCURRENT value; AWSPREVIOUS is accepted too during rotation.
    secret_ref          text NOT NULL CHECK (length(secret_ref) > 0),
    tolerance_seconds   integer NOT NULL DEFAULT 300 CHECK (tolerance_seconds BETWEEN 1 AND 86400),
    -- Where each field is read: 'header:<name>' or 'json:<JSON pointer>'.
    external_id_from    text NOT NULL,
    event_type_from     text NOT NULL,
    entity_id_from      text,
    entity_version_from text,
    sequence_from       text,
    enabled             boolean NOT NULL DEFAULT true,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now()
);

-- The durable queue and the dedup key in one table. One row per (tenant, provider event id),
-- written by a single INSERT ... ON CONFLICT statement.
CREATE TABLE webhook_events (
    tenant_id             text NOT NULL,
    external_id           text NOT NULL CHECK (length(external_id) BETWEEN 1 AND 255),
    source_id             text NOT NULL REFERENCES sources (source_id),
    event_type            text NOT NULL,
    entity_id             text,
    entity_version        bigint,
    provider_sequence     bigint,
    -- Raw request body exactly as signed; NULL once retention purged the bytes.
    payload               bytea,
    payload_sha256        bytea NOT NULL CHECK (octet_length(payload_sha256) = 32),
    headers               jsonb NOT NULL DEFAULT '{}'::jsonb,
    -- Which signing secret verified the stored payload: tells when a previous secret is unused.
    verified_with         text NOT NULL CHECK (verified_with IN ('current', 'previous')),
    received_at           timestamptz NOT NULL,  -- when the stored payload arrived
    first_received_at     timestamptz NOT NULL,
    last_seen_at          timestamptz NOT NULL,
    delivery_count        integer NOT NULL DEFAULT 1,
    last_delivery_outcome text NOT NULL DEFAULT 'accepted'
                          CHECK (last_delivery_outcome IN ('accepted', 'duplicate', 'conflict')),
    conflict_count        integer NOT NULL DEFAULT 0,
    -- Digest of the payload this row replaced at its last conflict, if it replaced one.
    superseded_sha256     bytea,
    status                text NOT NULL DEFAULT 'pending'
                          CHECK (status IN ('pending', 'processed', 'dead_lettered')),
    attempts              integer NOT NULL DEFAULT 0,
    next_attempt_at       timestamptz NOT NULL DEFAULT now(),
    last_error            text,
    processed_at          timestamptz,
    PRIMARY KEY (tenant_id, external_id)
);

-- Authenticated deliveries that raised a security or integrity question. Unauthenticated
-- requests (bad signatures) are never written here: they are counted in logs and metrics, so
-- an attacker cannot make the database grow.
CREATE TABLE ingest_anomalies (
    anomaly_id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    detected_at       timestamptz NOT NULL DEFAULT now(),
    tenant_id         text NOT NULL,
    source_id         text NOT NULL REFERENCES sources (source_id),
    kind              text NOT NULL
                      CHECK (kind IN ('digest_conflict', 'unparseable_payload', 'missing_field', 'invalid_field')),
    external_id       text,
    -- Digest of the delivery that raised the anomaly.
    payload_sha256    bytea NOT NULL,
    -- For digest conflicts: what the queue row holds after the delivery, what it held before
    -- (when the delivery replaced it) and whether it was replaced.
    stored_sha256     bytea,
    superseded_sha256 bytea,
    payload_replaced  boolean,
    -- The delivered bytes when they are not in webhook_events (signed, so worth keeping).
    payload           bytea,
    detail            text NOT NULL
);

CREATE INDEX ingest_anomalies_by_kind ON ingest_anomalies (kind, detected_at);
CREATE INDEX ingest_anomalies_by_event ON ingest_anomalies (tenant_id, external_id)
    WHERE external_id IS NOT NULL;
