-- Shopify: deletes project, and two changes in one second are ordered.
--
-- A `*/delete` body is only {"id": N}: no admin_graphql_api_id and no updated_at. The numeric id
-- is in every resource body, so it names the entity (with the topic's resource as its type);
-- a version missing from the body is read from a fallback (X-Shopify-Triggered-At); and events of
-- one entity and version are ordered by a tiebreak (X-Shopify-Triggered-At, nanoseconds:
-- updated_at has one-second precision).
ALTER TABLE sources
    ADD COLUMN entity_version_fallback_from text,
    ADD COLUMN version_tiebreak_from text;

-- The tiebreak as read from the event (Unix microseconds for timestamps), and the one the
-- projection holds: an entity takes an event whose (version, tiebreak, event id) is greater.
ALTER TABLE webhook_events ADD COLUMN version_tiebreak bigint;
ALTER TABLE entities ADD COLUMN version_tiebreak bigint;

-- Two different changes of one entity with the same version and nothing to order them.
ALTER TABLE ingest_anomalies DROP CONSTRAINT ingest_anomalies_kind_check;
ALTER TABLE ingest_anomalies ADD CONSTRAINT ingest_anomalies_kind_check
    CHECK (kind IN ('digest_conflict', 'unparseable_payload', 'missing_field', 'invalid_field',
                    'redelivered_after_purge', 'replayed_body', 'source_collision',
                    'ambiguous_version'));

-- Shopify sources on the old defaults take the new ones. A source's fields are stored resolved,
-- so one that named json:/admin_graphql_api_id explicitly moves too; re-applying a file that
-- names it keeps deletes off the projection again.
UPDATE sources
SET entity_version_fallback_from = 'header:x-shopify-triggered-at',
    version_tiebreak_from = 'header:x-shopify-triggered-at',
    updated_at = now()
WHERE scheme = 'shopify' AND entity_version_from = 'json:/updated_at'
  AND entity_version_fallback_from IS NULL AND version_tiebreak_from IS NULL;

UPDATE sources SET entity_id_from = 'json:/id', updated_at = now()
WHERE scheme = 'shopify' AND entity_id_from = 'json:/admin_graphql_api_id';

-- What those sources already stored keeps one key per entity: the GraphQL id's numeric tail is
-- the resource's id.
UPDATE webhook_events AS e
SET entity_id = substring(e.entity_id FROM '^gid://shopify/[A-Za-z]+/([0-9]+)$')
FROM sources AS s
WHERE s.source_id = e.source_id AND s.scheme = 'shopify' AND s.entity_id_from = 'json:/id'
  AND e.entity_id ~ '^gid://shopify/[A-Za-z]+/[0-9]+$';

UPDATE entities AS x
SET entity_id = substring(x.entity_id FROM '^gid://shopify/[A-Za-z]+/([0-9]+)$')
WHERE x.entity_id ~ '^gid://shopify/[A-Za-z]+/[0-9]+$'
  AND x.tenant_id IN (SELECT tenant_id FROM sources WHERE scheme = 'shopify' AND entity_id_from = 'json:/id')
  AND NOT EXISTS (
      SELECT 1 FROM entities AS y
      WHERE y.tenant_id = x.tenant_id AND y.entity_type = x.entity_type
        AND y.entity_id = substring(x.entity_id FROM '^gid://shopify/[A-Za-z]+/([0-9]+)$'));
