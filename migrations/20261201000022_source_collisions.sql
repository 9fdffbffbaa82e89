-- A delivery whose (tenant, event id) is already stored under another source of the tenant is
-- never a replacement of that source's row: it is kept here, with its bytes.
ALTER TABLE ingest_anomalies DROP CONSTRAINT ingest_anomalies_kind_check;
ALTER TABLE ingest_anomalies ADD CONSTRAINT ingest_anomalies_kind_check
    CHECK (kind IN ('digest_conflict', 'unparseable_payload', 'missing_field', 'invalid_field',
                    'redelivered_after_purge', 'replayed_body', 'source_collision'));
