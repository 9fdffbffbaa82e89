-- no-transaction
-- The key anomalies of one delivered body under one event id aggregate on (see migration 40).
-- Partial: rows from before it (last_seen_at NULL) may repeat a key.
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS ingest_anomalies_once_per_delivery
    ON ingest_anomalies (source_id, kind, external_id, payload_sha256) WHERE last_seen_at IS NOT NULL;
