-- The drain's whole-batch work written as ONE plain SQL statement, for pgbench: the claim and
-- completion of `event_queue::claim_completed` (queue rows deleted, events marked processed with
-- what the standard registry declares, latencies recorded) and the entity projection of
-- `entities::apply_versioned` (entities locked in key order and compared, upserted, announced,
-- ambiguous versions recorded, each event's result returned), with what the drain's client
-- does between them done here (entity type and delete from the event type, the first change of
-- each entity, the outbox key). Not product code: the experiment behind "The drain's own work
-- as one statement" in docs/benchmarks.md, which compares it with the drain bench's
-- `same_writes_in_sql` script on the same backlog, to tell the cost of the drain's semantics
-- from the cost of the round trips and the client between its statements.
--
-- Run by hand on a scratch database with every migration applied, a `bench` source
-- (scheme standard_webhooks) and the drain bench's fill queued (see docs/benchmarks.md):
--   pgbench -n -c 1 -T 25 -M extended -f benches/sql/drain_as_one_statement.sql DB
-- `-M extended` parses and plans it every batch, as the drain's unnamed projection is;
-- `-M prepared` parses it once.
BEGIN;
WITH claimed AS (
  SELECT q.ctid AS queue_row, e.ctid AS event_row, q.ready_at,
     CASE WHEN e.status = 'processed' THEN NULL
          WHEN e.entity_id IS NOT NULL AND e.entity_version IS NOT NULL
          THEN CASE WHEN r.scheme IS NULL THEN 'projection' ELSE r.if_versioned END
          ELSE CASE WHEN r.scheme IS NULL THEN 'nothing' ELSE r.otherwise END END AS expects,
     r.scheme IS NULL AS projects,
     q.tenant_id, q.external_id, e.source_id, s.scheme, e.event_type, e.entity_id,
     e.entity_version, e.version_tiebreak, e.payload, e.payload_sha256, e.first_received_at,
     e.attempts, e.status = 'processed' AS repair
  FROM event_queue AS q
  JOIN webhook_events AS e ON e.tenant_id = q.tenant_id AND e.external_id = q.external_id
  JOIN sources AS s ON s.source_id = e.source_id
  LEFT JOIN unnest(ARRAY['stripe'], ARRAY['payment_intent.succeeded'], ARRAY['fulfilment'], ARRAY['fulfilment'])
     AS r(scheme, event_type, if_versioned, otherwise) ON r.scheme = s.scheme AND r.event_type = e.event_type
  WHERE q.ready_at <= now() ORDER BY q.ready_at LIMIT 100 FOR UPDATE OF q, e SKIP LOCKED),
numbered AS (SELECT claimed.*, row_number() OVER (ORDER BY ready_at, queue_row) AS n FROM claimed),
left_queue AS (DELETE FROM event_queue AS q WHERE q.ctid = ANY(ARRAY(SELECT queue_row FROM claimed))),
processed AS (
  UPDATE webhook_events AS e
  SET status = 'processed', processed_at = statement_timestamp(), attempts = e.attempts + 1, last_error = NULL,
      expects = c.expects
  FROM claimed AS c
  WHERE e.ctid = ANY(ARRAY(SELECT event_row FROM claimed WHERE NOT claimed.repair)) AND e.ctid = c.event_row
  RETURNING e.first_received_at, EXTRACT(EPOCH FROM e.processed_at - e.received_at)::float8 AS seconds),
recorded AS (
  INSERT INTO processing_completions (completed_at, seconds)
  SELECT statement_timestamp(), array_agg(seconds) FROM processed
  WHERE first_received_at >= statement_timestamp() - interval '1 day' HAVING count(*) > 0),
kinds AS (
  SELECT numbered.*, substring(event_type from '^(.*)[./][^./]*$') AS prefix,
      substring(event_type from '[./]([^./]*)$') AS verb
  FROM numbered WHERE projects AND entity_id IS NOT NULL AND entity_version IS NOT NULL),
c AS (
  SELECT DISTINCT ON (tenant_id, etype, entity_id) tenant_id, etype AS entity_type, entity_id, entity_version AS version, version_tiebreak,
      convert_from(payload, 'UTF8') AS state, COALESCE(verb IN ('deleted', 'delete', 'removed'), false) AS deleted,
      external_id, source_id, payload_sha256,
      encode(sha256(int8send(octet_length(tenant_id)) || convert_to(tenant_id, 'UTF8')
          || int8send(octet_length(external_id)) || convert_to(external_id, 'UTF8')
          || int8send(14) || convert_to('entity.changed', 'UTF8')), 'hex') AS outbox_key,
      first_received_at AS since, n
  FROM (SELECT k.*, COALESCE(prefix, event_type) AS etype FROM kinds AS k) AS k2
  WHERE payload IS NOT NULL
  ORDER BY tenant_id, etype, entity_id, n),
before AS (
  SELECT e.tenant_id, e.entity_type, e.entity_id, e.version, e.version_tiebreak,
      e.last_event_id, e.state, e.deleted, e.updated_at
  FROM entities AS e JOIN c USING (tenant_id, entity_type, entity_id)
  ORDER BY e.tenant_id, e.entity_type, e.entity_id
  FOR UPDATE OF e),
applied AS (
  INSERT INTO entities AS cur (tenant_id, entity_type, entity_id, version, version_tiebreak,
      state, deleted, deleted_at, last_event_id, updated_at)
  SELECT c.tenant_id, c.entity_type, c.entity_id, c.version, c.version_tiebreak,
      c.state::jsonb, c.deleted, CASE WHEN c.deleted THEN statement_timestamp() END, c.external_id,
      statement_timestamp()
  FROM c
  WHERE (SELECT count(*) FROM before) >= 0
  ORDER BY c.tenant_id, c.entity_type, c.entity_id
  ON CONFLICT (tenant_id, entity_type, entity_id) DO UPDATE SET
      version = EXCLUDED.version,
      version_tiebreak = EXCLUDED.version_tiebreak,
      state = CASE WHEN EXCLUDED.deleted THEN cur.state ELSE EXCLUDED.state END,
      deleted = EXCLUDED.deleted,
      deleted_at = CASE WHEN EXCLUDED.deleted THEN statement_timestamp() END,
      last_event_id = EXCLUDED.last_event_id,
      updated_at = statement_timestamp()
  WHERE (cur.version, COALESCE(cur.version_tiebreak, -9223372036854775808), cur.last_event_id)
      < (EXCLUDED.version, COALESCE(EXCLUDED.version_tiebreak, -9223372036854775808), EXCLUDED.last_event_id)
  RETURNING tenant_id, entity_type, entity_id, version, deleted),
announced AS (
  INSERT INTO outbox (tenant_id, external_id, action, payload, idempotency_key)
  SELECT a.tenant_id, c.external_id, 'entity.changed', jsonb_build_object('entity_type', a.entity_type,
         'entity_id', a.entity_id, 'version', a.version, 'deleted', a.deleted), c.outbox_key
  FROM applied AS a JOIN c USING (tenant_id, entity_type, entity_id)
  ON CONFLICT (tenant_id, external_id, action) DO NOTHING),
ambiguous AS (
  INSERT INTO ingest_anomalies (tenant_id, source_id, kind, external_id, payload_sha256, detail)
  SELECT c.tenant_id, c.source_id, 'ambiguous_version', c.external_id, c.payload_sha256,
      'events ' || least(b.last_event_id, c.external_id) || ' and ' || greatest(b.last_event_id, c.external_id)
      || ' change ' || c.entity_type || ' ' || c.entity_id || ' differently with the same version ' || c.version
      || ' and nothing orders them (no tiebreak tells them apart): the projection keeps '
      || greatest(b.last_event_id, c.external_id) || ', the greater event id'
  FROM c JOIN before AS b USING (tenant_id, entity_type, entity_id)
  WHERE b.version = c.version AND b.last_event_id <> c.external_id
    AND (b.version_tiebreak IS NULL OR c.version_tiebreak IS NULL OR b.version_tiebreak = c.version_tiebreak)
    AND (b.deleted <> c.deleted OR b.state <> c.state::jsonb))
SELECT nb.tenant_id, nb.external_id, nb.source_id, nb.scheme, nb.event_type, nb.entity_id, nb.entity_version,
    nb.version_tiebreak, nb.payload, nb.payload_sha256, nb.first_received_at, nb.attempts, nb.repair, nb.expects,
    c.n IS NOT NULL AS projected, a.entity_id IS NOT NULL AS applied,
    COALESCE(a.entity_id IS NULL AND b.last_event_id = c.external_id, false) AS held_by_this_event,
    COALESCE(b.updated_at < c.since, false) AS changed_before
FROM numbered AS nb
LEFT JOIN c USING (n)
LEFT JOIN before AS b ON b.tenant_id = c.tenant_id AND b.entity_type = c.entity_type AND b.entity_id = c.entity_id
LEFT JOIN applied AS a ON a.tenant_id = c.tenant_id AND a.entity_type = c.entity_type AND a.entity_id = c.entity_id
ORDER BY nb.n;
COMMIT;
