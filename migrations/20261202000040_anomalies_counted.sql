-- Anomalies of one delivered body under one event id are one row that counts them, not a row
-- (with up to a megabyte of payload) per request: digest conflicts, source collisions and
-- replayed bodies are written `ON CONFLICT ... DO UPDATE` on (source_id, kind, external_id,
-- payload_sha256) (the unique index is built concurrently by migration 42).
-- seen_count: deliveries it stands for; last_seen_at: the latest of them (NULL on rows written
-- before this migration, which stand for one delivery each and are not aggregated: the index is
-- partial on last_seen_at IS NOT NULL, so duplicates already stored never fail its build).
-- headers: the delivery's kept headers (what the field map reads: topic, trigger time, ...), so
-- a held delivery can be reviewed and acted on. replay_of: for a `replayed_body`, the stored
-- event whose bytes these are. Constant defaults and nullable columns: no rewrite.
ALTER TABLE ingest_anomalies
    ADD COLUMN seen_count   integer NOT NULL DEFAULT 1,
    ADD COLUMN last_seen_at timestamptz,
    ADD COLUMN headers      jsonb,
    ADD COLUMN replay_of    text;
