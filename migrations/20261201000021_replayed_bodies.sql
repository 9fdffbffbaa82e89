-- GitHub and Shopify sign only the body: the event id headers (X-GitHub-Delivery,
-- X-Shopify-Webhook-Id) are outside the signature, so whoever holds one signed delivery can send
-- it again under fresh ids. An event whose id came from outside the signature says so, and a
-- source stores each such body once: the same bytes under another id violate this index, and
-- ingest answers the replay `duplicate` and records it (kind replayed_body). Enforced by the
-- index, not by a read before the write: concurrent replays cannot both land.
ALTER TABLE webhook_events ADD COLUMN id_outside_signature boolean NOT NULL DEFAULT false;
CREATE UNIQUE INDEX webhook_events_body_once ON webhook_events (source_id, payload_sha256)
    WHERE id_outside_signature;

ALTER TABLE ingest_anomalies DROP CONSTRAINT ingest_anomalies_kind_check;
ALTER TABLE ingest_anomalies ADD CONSTRAINT ingest_anomalies_kind_check
    CHECK (kind IN ('digest_conflict', 'unparseable_payload', 'missing_field', 'invalid_field',
                    'redelivered_after_purge', 'replayed_body'));
