-- A buffered delivery whose source was disabled between ingest's verification and the consumer
-- filing it: it can never be stored as an event, so it is kept here, with its bytes, and
-- deleted from the queue. Added NOT VALID (no scan under the lock; every new row is checked
-- at once) and validated by the next migration.
ALTER TABLE ingest_anomalies DROP CONSTRAINT ingest_anomalies_kind_check;
ALTER TABLE ingest_anomalies ADD CONSTRAINT ingest_anomalies_kind_check
    CHECK (kind IN ('digest_conflict', 'unparseable_payload', 'missing_field', 'invalid_field',
                    'redelivered_after_purge', 'replayed_body', 'source_collision',
                    'ambiguous_version', 'buffered_source_unavailable')) NOT VALID;
