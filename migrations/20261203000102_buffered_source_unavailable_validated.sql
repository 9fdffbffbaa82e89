-- Validates the kind check of migration 101: a scan under SHARE UPDATE EXCLUSIVE, which lets
-- ingest write on.
ALTER TABLE ingest_anomalies VALIDATE CONSTRAINT ingest_anomalies_kind_check;
