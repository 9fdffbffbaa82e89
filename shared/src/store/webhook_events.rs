//! The `webhook_events` table: the durable queue and the deduplication key in one.

use sqlx::PgExecutor;

use super::StoreError;

/// `verified_with` of an event fetched from the provider's API by backfill.
pub const PROVIDER_API: &str = "provider_api";

/// A verified delivery, ready to store.
#[derive(Debug, Clone)]
pub struct NewEvent<'a> {
    pub tenant_id: &'a str,
    pub external_id: &'a str,
    pub source_id: &'a str,
    pub event_type: &'a str,
    pub entity_id: Option<&'a str>,
    pub entity_version: Option<i64>,
    pub version_tiebreak: Option<i64>,
    pub sequence: Option<i64>,
    pub payload: &'a [u8],
    pub payload_sha256: [u8; 32],
    pub headers: serde_json::Value,
    /// `current` or `previous` (the secret that verified the delivery), or [`PROVIDER_API`].
    pub verified_with: &'a str,
    /// 1 when the provider marked this delivery as its own retry (Slack's `X-Slack-Retry-Num`).
    pub provider_retries: i32,
    /// The event id was read from a header the signature does not cover (GitHub's
    /// `X-GitHub-Delivery`, Shopify's `X-Shopify-Webhook-Id`): the first event stored with
    /// this body claims it (`signed_bodies`), and the same bytes under another id are held as a
    /// replay ([`Upserted::replay_of`]).
    pub id_outside_signature: bool,
    /// The digest of the signed string, for a layout that signs values rather than the body
    /// (`signature::Verified::signed_digest`): what the replay guard claims in place of
    /// `payload_sha256`, so that re-encoded bytes around one signed string are one body.
    pub signed_digest: Option<[u8; 32]>,
    /// The name of the provider's layout that verified it, for a provider with several
    /// (`verified_layout`, shown on the event's page).
    pub verified_layout: Option<&'a str>,
}

impl NewEvent<'_> {
    /// What `signed_bodies` keys this delivery's body by: the digest of the signed string when
    /// the layout signs values, else the raw bytes' digest.
    pub fn body_claim(&self) -> &[u8] {
        match &self.signed_digest {
            Some(digest) => digest,
            None => &self.payload_sha256,
        }
    }
}

/// What the delivery turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryOutcome {
    /// First delivery of this event: a new row.
    Accepted,
    /// Same id, same payload digest: counted, nothing else changes.
    Duplicate,
    /// Same id, different payload digest: counted and recorded as a security anomaly. An
    /// unprocessed row took the newer payload; a processed row was not touched.
    Conflict,
}

impl DeliveryOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryOutcome::Accepted => "accepted",
            DeliveryOutcome::Duplicate => "duplicate",
            DeliveryOutcome::Conflict => "conflict",
        }
    }
}

/// What the upsert statement did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upserted {
    pub outcome: DeliveryOutcome,
    pub delivery_count: i32,
    pub status: String,
    /// The row now holds this delivery's payload.
    pub holds_delivery: bool,
    /// The event id is stored under this other source of the tenant: its row was left as it
    /// is, and the delivery was recorded as a `source_collision`.
    pub collided_with: Option<String>,
    /// The delivery's id came from outside the signature and its bytes are those of this other
    /// event of the source (`signed_bodies`): a replay, or a distinct delivery of identical
    /// bytes. Stored held (a new id) or left out of the stored row (a stored id), and recorded
    /// as a `replayed_body`.
    pub replay_of: Option<String>,
}

/// Why the upsert stored nothing.
#[derive(Debug, thiserror::Error)]
pub enum UpsertError {
    /// `webhook_events_body_once` refused the row: the source stores these bytes under another
    /// event id that `signed_bodies` does not know (a row written before migration 41 copied
    /// them, by a process still running the previous release). [`adopt_stored_body`] copies it
    /// in; the upsert then sees the replay.
    #[error("the body is stored under another event id that signed_bodies does not hold yet")]
    BodyNotClaimed,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// One statement decides accepted / duplicate / conflict and records what raised a question:
/// an upsert keyed on (tenant_id, external_id) whose `DO UPDATE` compares the delivery against
/// the stored row (locked by the upsert itself).
///
/// First, when the event id came from outside the signature (`$13`: GitHub's
/// `X-GitHub-Delivery`, Shopify's `X-Shopify-Webhook-Id`), the body is claimed in
/// `signed_bodies` under `$15` ([`NewEvent::body_claim`]: the raw bytes' digest, or for a layout
/// that signs values rather than the body, the signed string's, so that re-encoded bytes
/// around one signed string are one body): `ON CONFLICT DO UPDATE` locks the claim and returns the event that first
/// made it, so concurrent deliveries of one body under several ids wait on one key and all but
/// the first see the first's id. The claim outlives the event's identity (retention keeps it
/// longer), so a signed body re-posted after the identity purge is still a replay. A delivery
/// whose bytes another event claimed (`replay_of`) is:
///
/// - under an id not stored yet: stored held, never a second effect: `processed` at once,
///   `expects = 'nothing'`, not queued, no payload copy (the bytes are `replay_of`'s), and
///   `id_outside_signature` false, since the body's effective row is `replay_of`'s
///   (`webhook_events_body_once` keeps one per body). It may be a replay or a distinct delivery
///   of identical bytes (one Shopify endpoint subscribed to `orders/updated` and `orders/paid`):
///   the bytes cannot tell, so it is kept and accounted for, and reviewed from its anomaly.
///   Answered `duplicate`: nothing new happens.
/// - under a stored id: that row's payload is never taken (see below).
///
/// Either way a `replayed_body` anomaly names both events and keeps the delivery's headers.
///
/// Then, as before:
/// - The row belongs to another source of the tenant (`c.ours` false): nothing of it changes;
///   the delivery is answered `duplicate` (same bytes) or `conflict` and recorded, with its
///   bytes, as a `source_collision`.
/// - Same source, same digest: `duplicate`, counted.
/// - Same source, one of the two fetched from the provider's API by backfill and the other a
///   signed delivery, and both name the same type, entity, version and sequence: `duplicate`.
///   The API renders an event in other bytes than the delivery (Stripe's `pending_webhooks`,
///   `request` in another API version), so an event backfilled during an outage whose delivery
///   finally arrives is the same event, not a conflict. The stored copy is kept.
/// - Same source, another digest: `conflict`, counted and recorded as a `digest_conflict`; the
///   payload is replaced only when the row is still pending, the delivery is not an older
///   entity version, and its id is signed: an id outside the signature binds nothing to the
///   bytes, so whoever holds any signed body could otherwise swap a pending event's payload.
///
/// Anomalies are one row per (source, kind, event id, delivered digest), counted
/// (`seen_count`, `last_seen_at`) and keeping the delivered bytes once: a body posted a
/// hundred times is one row, not a hundred megabytes. They, the claim, and for a new event its
/// place in `event_queue`, are written by data-modifying CTEs of the same statement. So is,
/// for a delivery that repeats an event received more than five minutes before
/// ([`super::delivery_hours::MARK_AFTER_SECONDS`]), the mark that makes the anomaly rollup
/// count its hour again (`delivery_hours_dirty`; [`super::delivery_hours`] says why).
const UPSERT: &str = r#"
WITH claim AS (
    INSERT INTO signed_bodies AS b (source_id, payload_sha256, external_id)
    SELECT $3, $15, $2 WHERE $13
    ON CONFLICT (source_id, payload_sha256) DO UPDATE SET last_seen_at = now()
    RETURNING b.external_id
), replay AS (
    SELECT (SELECT c.external_id FROM claim AS c WHERE c.external_id <> $2) AS replay_of
), delivered AS (
    INSERT INTO webhook_events AS stored (
        tenant_id, external_id, source_id, event_type, entity_id, entity_version,
        provider_sequence, payload, payload_sha256, headers, verified_with, provider_retries,
        id_outside_signature, version_tiebreak, received_at, first_received_at, last_seen_at,
        status, processed_at, expects)
    SELECT $1, $2, $3, $4, $5, $6, $7, CASE WHEN r.replay_of IS NULL THEN $8 END, $9, $10, $11,
           $12, $13 AND r.replay_of IS NULL, $14, now(), now(), now(),
           CASE WHEN r.replay_of IS NULL THEN 'pending' ELSE 'processed' END,
           CASE WHEN r.replay_of IS NOT NULL THEN now() END,
           CASE WHEN r.replay_of IS NOT NULL THEN 'nothing' END
    FROM replay AS r
    ON CONFLICT (tenant_id, external_id) DO UPDATE SET
        (delivery_count, last_seen_at, last_delivery_outcome, conflict_count, provider_retries,
         event_type, entity_id, entity_version, version_tiebreak, provider_sequence, payload,
         payload_sha256, headers, verified_with, received_at, superseded_sha256) = (
            SELECT
                stored.delivery_count + k.ours::int,
                CASE WHEN k.ours THEN now() ELSE stored.last_seen_at END,
                CASE WHEN k.ours THEN k.outcome ELSE stored.last_delivery_outcome END,
                stored.conflict_count + (k.ours AND k.outcome = 'conflict')::int,
                stored.provider_retries + CASE WHEN k.ours THEN EXCLUDED.provider_retries ELSE 0 END,
                CASE WHEN k.take THEN EXCLUDED.event_type ELSE stored.event_type END,
                CASE WHEN k.take THEN EXCLUDED.entity_id ELSE stored.entity_id END,
                CASE WHEN k.take THEN EXCLUDED.entity_version ELSE stored.entity_version END,
                CASE WHEN k.take THEN EXCLUDED.version_tiebreak ELSE stored.version_tiebreak END,
                CASE WHEN k.take THEN EXCLUDED.provider_sequence ELSE stored.provider_sequence END,
                CASE WHEN k.take THEN EXCLUDED.payload ELSE stored.payload END,
                CASE WHEN k.take THEN EXCLUDED.payload_sha256 ELSE stored.payload_sha256 END,
                CASE WHEN k.take THEN EXCLUDED.headers ELSE stored.headers END,
                CASE WHEN k.take THEN EXCLUDED.verified_with ELSE stored.verified_with END,
                CASE WHEN k.take THEN EXCLUDED.received_at ELSE stored.received_at END,
                CASE WHEN k.take THEN stored.payload_sha256 ELSE stored.superseded_sha256 END
            FROM (SELECT c.ours, c.outcome,
                         c.ours AND c.outcome = 'conflict' AND stored.status = 'pending'
                         AND NOT $13
                         AND (stored.entity_version IS NULL OR EXCLUDED.entity_version IS NULL
                              OR EXCLUDED.entity_version >= stored.entity_version) AS take
                  FROM (SELECT stored.source_id = EXCLUDED.source_id AS ours,
                               CASE WHEN stored.payload_sha256 = EXCLUDED.payload_sha256
                                    THEN 'duplicate'
                                    WHEN (stored.verified_with = 'provider_api')
                                             <> (EXCLUDED.verified_with = 'provider_api')
                                         AND stored.event_type = EXCLUDED.event_type
                                         AND stored.entity_id IS NOT DISTINCT FROM EXCLUDED.entity_id
                                         AND stored.entity_version
                                             IS NOT DISTINCT FROM EXCLUDED.entity_version
                                         AND stored.provider_sequence
                                             IS NOT DISTINCT FROM EXCLUDED.provider_sequence
                                    THEN 'duplicate'
                                    ELSE 'conflict' END AS outcome) AS c) AS k)
    RETURNING source_id, last_delivery_outcome, delivery_count, status, payload_sha256,
              superseded_sha256, first_received_at
), judged AS (
    SELECT d.*, d.source_id = $3 AS ours, r.replay_of,
           CASE WHEN d.source_id <> $3
                THEN CASE WHEN d.payload_sha256 = $9 THEN 'duplicate' ELSE 'conflict' END
                WHEN r.replay_of IS NOT NULL AND d.last_delivery_outcome = 'accepted'
                THEN 'duplicate'
                ELSE d.last_delivery_outcome END AS outcome
    FROM delivered AS d CROSS JOIN replay AS r
), conflict AS (
    INSERT INTO ingest_anomalies AS a (
        tenant_id, source_id, kind, external_id, payload_sha256, stored_sha256,
        superseded_sha256, payload_replaced, payload, detail, headers, last_seen_at)
    SELECT $1, $3, 'digest_conflict', $2, $9, j.payload_sha256,
           CASE WHEN j.payload_sha256 = $9 THEN j.superseded_sha256 END,
           j.payload_sha256 = $9,
           CASE WHEN j.payload_sha256 = $9 THEN NULL ELSE $8 END,
           CASE WHEN j.payload_sha256 = $9
                THEN 'same event id, different payload: the unprocessed row took the newer payload'
                WHEN $13 AND j.status = 'pending'
                THEN 'same event id, different payload: the stored payload was kept (the id is '
                     || 'outside the signature, so nothing binds it to these bytes)'
                ELSE 'same event id, different payload: the stored payload was kept (row is '
                     || j.status || ')' END,
           $10, now()
    FROM judged AS j
    WHERE j.ours AND j.last_delivery_outcome = 'conflict' AND j.replay_of IS NULL
    ON CONFLICT (source_id, kind, external_id, payload_sha256) WHERE last_seen_at IS NOT NULL
    DO UPDATE SET seen_count = a.seen_count + 1, last_seen_at = now(),
        stored_sha256 = EXCLUDED.stored_sha256,
        superseded_sha256 = COALESCE(EXCLUDED.superseded_sha256, a.superseded_sha256),
        payload_replaced = a.payload_replaced OR EXCLUDED.payload_replaced,
        payload = CASE WHEN a.payload IS NULL THEN EXCLUDED.payload ELSE a.payload END,
        detail = EXCLUDED.detail
), collision AS (
    INSERT INTO ingest_anomalies AS a (
        tenant_id, source_id, kind, external_id, payload_sha256, stored_sha256,
        payload_replaced, payload, detail, headers, last_seen_at)
    SELECT $1, $3, 'source_collision', $2, $9, j.payload_sha256, false, $8,
           'the event id is already stored under source ' || j.source_id
           || ' of the same tenant: that row was left as it is and this delivery is kept here, '
           || 'not stored as an event (' || j.outcome || ')',
           $10, now()
    FROM judged AS j
    WHERE NOT j.ours
    ON CONFLICT (source_id, kind, external_id, payload_sha256) WHERE last_seen_at IS NOT NULL
    DO UPDATE SET seen_count = a.seen_count + 1, last_seen_at = now(),
        stored_sha256 = EXCLUDED.stored_sha256
), replayed AS (
    INSERT INTO ingest_anomalies AS a (
        tenant_id, source_id, kind, external_id, payload_sha256, stored_sha256,
        payload_replaced, detail, headers, replay_of, last_seen_at)
    SELECT $1, $3, 'replayed_body', $2, $9, j.payload_sha256, false,
           CASE WHEN j.last_delivery_outcome = 'accepted'
                THEN 'the signed body of event ' || j.replay_of || ', delivered again under this '
                     || 'id, which is outside the signature: a replay, or a distinct delivery of '
                     || 'identical bytes. Stored as this event, held: processed without effects'
                ELSE 'the signed body of event ' || j.replay_of || ', delivered under the id of '
                     || 'this stored event (' || j.status || '), which is outside the signature: '
                     || 'the stored event was left as it was' END,
           $10, j.replay_of, now()
    FROM judged AS j
    WHERE j.ours AND j.replay_of IS NOT NULL
    ON CONFLICT (source_id, kind, external_id, payload_sha256) WHERE last_seen_at IS NOT NULL
    DO UPDATE SET seen_count = a.seen_count + 1, last_seen_at = now(),
        stored_sha256 = EXCLUDED.stored_sha256
), queued AS (
    INSERT INTO event_queue (tenant_id, external_id)
    SELECT $1, $2 FROM judged AS j
    WHERE j.ours AND j.last_delivery_outcome = 'accepted' AND j.replay_of IS NULL
), filed AS (
    INSERT INTO event_filings AS f (tenant_id, external_id, verified_layout)
    SELECT $1, $2, $16 FROM judged AS j
    WHERE $16 IS NOT NULL AND j.ours AND j.replay_of IS NULL AND j.payload_sha256 = $9
      AND j.last_delivery_outcome <> 'duplicate'
    ON CONFLICT (tenant_id, external_id) DO UPDATE SET verified_layout = EXCLUDED.verified_layout
), repeated AS (
    INSERT INTO delivery_hours_dirty (source_id, hour, rereads_changes)
    SELECT m.source_id, m.hour, m.rereads_changes
    FROM (SELECT j.source_id, date_trunc('hour', j.first_received_at) AS hour,
                 j.last_delivery_outcome = 'conflict' AND j.payload_sha256 = $9 AS rereads_changes
          FROM judged AS j
          WHERE j.ours AND j.last_delivery_outcome <> 'accepted'
            AND j.first_received_at < now() - interval '5 minutes') AS m
    WHERE NOT EXISTS (SELECT 1 FROM delivery_hours_dirty AS d
                      WHERE d.source_id = m.source_id AND d.hour = m.hour
                        AND (d.rereads_changes OR NOT m.rereads_changes))
)
SELECT outcome, delivery_count, status, payload_sha256 = $9 AS holds_delivery,
       CASE WHEN NOT ours THEN source_id END AS collided_with, replay_of
FROM judged
"#;

/// The statement text, for benchmarks that run it outside this crate (pgbench).
pub fn upsert_sql() -> &'static str {
    UPSERT
}

/// [`UPSERT`] over a set of deliveries: one statement, the deliveries bound as arrays and read
/// with `unnest`, with exactly its semantics per delivery (the claim in `signed_bodies`, held
/// replays, source collisions, the payload taken only when pending, not an older version and
/// the id signed, API copy versus delivery, the counted anomalies, the `event_queue` entry).
///
/// What differs, because the deliveries were buffered: a row's received times (`received_at`,
/// `first_received_at`, and `last_seen_at`, which never moves backwards) and an anomaly's
/// `last_seen_at` are each delivery's own received time (`$16`), not the statement's `now()`.
///
/// No two deliveries of one statement share a key (`(tenant_id, external_id)`, nor, when the id
/// is outside the signature, `(source_id, payload_sha256)`): `ON CONFLICT DO UPDATE` cannot
/// touch one row twice in a statement, so [`upsert_batch`] splits a batch into rounds. Keys
/// being distinct, no delivery of a round sees another's writes, and the round's result is the
/// one the deliveries would have had one after another.
///
/// `webhook_events_body_once` set-wise: where the direct path fails on it, copies the stored
/// body's claim in ([`adopt_stored_body`]) and runs again, the claim here is written, in the
/// same statement, for the event that stores the body under an unsigned id when `signed_bodies`
/// does not know it and the delivery's own id is not stored: the delivery then sees the replay,
/// as the direct path's second run does.
const UPSERT_BATCH: &str = r#"
WITH input AS (
    SELECT * FROM unnest($1::int4[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
                         $7::int8[], $8::int8[], $9::bytea[], $10::bytea[], $11::jsonb[],
                         $12::text[], $13::int4[], $14::bool[], $15::int8[], $16::timestamptz[],
                         $17::bytea[], $18::text[], $19::int4[])
        AS i(ord, tenant_id, external_id, source_id, event_type, entity_id, entity_version,
             provider_sequence, payload, payload_sha256, headers, verified_with, provider_retries,
             outside, version_tiebreak, received_at, body_claim, verified_layout, buffered)
), claim AS (
    INSERT INTO signed_bodies AS b (source_id, payload_sha256, external_id)
    SELECT i.source_id, i.body_claim,
           COALESCE((SELECT w.external_id FROM webhook_events AS w
                     WHERE w.source_id = i.source_id AND w.payload_sha256 = i.payload_sha256
                       AND w.id_outside_signature
                       AND NOT EXISTS (SELECT 1 FROM webhook_events AS o
                                       WHERE o.tenant_id = i.tenant_id
                                         AND o.external_id = i.external_id)
                     LIMIT 1),
                    i.external_id)
    FROM input AS i WHERE i.outside
    ON CONFLICT (source_id, payload_sha256) DO UPDATE SET last_seen_at = now()
    RETURNING b.source_id, b.payload_sha256, b.external_id
), replay AS (
    SELECT i.*,
           (SELECT c.external_id FROM claim AS c
            WHERE i.outside AND c.source_id = i.source_id
              AND c.payload_sha256 = i.body_claim AND c.external_id <> i.external_id)
               AS replay_of
    FROM input AS i
), delivered AS (
    INSERT INTO webhook_events AS stored (
        tenant_id, external_id, source_id, event_type, entity_id, entity_version,
        provider_sequence, payload, payload_sha256, headers, verified_with, provider_retries,
        id_outside_signature, version_tiebreak, received_at, first_received_at, last_seen_at,
        status, processed_at, expects)
    SELECT r.tenant_id, r.external_id, r.source_id, r.event_type, r.entity_id, r.entity_version,
           r.provider_sequence, CASE WHEN r.replay_of IS NULL THEN r.payload END,
           r.payload_sha256, r.headers, r.verified_with, r.provider_retries,
           r.outside AND r.replay_of IS NULL, r.version_tiebreak,
           r.received_at, r.received_at, r.received_at,
           CASE WHEN r.replay_of IS NULL THEN 'pending' ELSE 'processed' END,
           CASE WHEN r.replay_of IS NOT NULL THEN now() END,
           CASE WHEN r.replay_of IS NOT NULL THEN 'nothing' END
    FROM replay AS r
    ON CONFLICT (tenant_id, external_id) DO UPDATE SET
        (delivery_count, last_seen_at, last_delivery_outcome, conflict_count, provider_retries,
         event_type, entity_id, entity_version, version_tiebreak, provider_sequence, payload,
         payload_sha256, headers, verified_with, received_at, superseded_sha256) = (
            SELECT
                stored.delivery_count + k.ours::int,
                CASE WHEN k.ours THEN greatest(stored.last_seen_at, EXCLUDED.last_seen_at)
                     ELSE stored.last_seen_at END,
                CASE WHEN k.ours THEN k.outcome ELSE stored.last_delivery_outcome END,
                stored.conflict_count + (k.ours AND k.outcome = 'conflict')::int,
                stored.provider_retries + CASE WHEN k.ours THEN EXCLUDED.provider_retries ELSE 0 END,
                CASE WHEN k.take THEN EXCLUDED.event_type ELSE stored.event_type END,
                CASE WHEN k.take THEN EXCLUDED.entity_id ELSE stored.entity_id END,
                CASE WHEN k.take THEN EXCLUDED.entity_version ELSE stored.entity_version END,
                CASE WHEN k.take THEN EXCLUDED.version_tiebreak ELSE stored.version_tiebreak END,
                CASE WHEN k.take THEN EXCLUDED.provider_sequence ELSE stored.provider_sequence END,
                CASE WHEN k.take THEN EXCLUDED.payload ELSE stored.payload END,
                CASE WHEN k.take THEN EXCLUDED.payload_sha256 ELSE stored.payload_sha256 END,
                CASE WHEN k.take THEN EXCLUDED.headers ELSE stored.headers END,
                CASE WHEN k.take THEN EXCLUDED.verified_with ELSE stored.verified_with END,
                CASE WHEN k.take THEN EXCLUDED.received_at ELSE stored.received_at END,
                CASE WHEN k.take THEN stored.payload_sha256 ELSE stored.superseded_sha256 END
            -- `NOT $13` of UPSERT: the proposed row is pending (no replay: a replay's id is
            -- always outside the signature) and its id signed.
            FROM (SELECT c.ours, c.outcome,
                         c.ours AND c.outcome = 'conflict' AND stored.status = 'pending'
                         AND EXCLUDED.status = 'pending' AND NOT EXCLUDED.id_outside_signature
                         AND (stored.entity_version IS NULL OR EXCLUDED.entity_version IS NULL
                              OR EXCLUDED.entity_version >= stored.entity_version) AS take
                  FROM (SELECT stored.source_id = EXCLUDED.source_id AS ours,
                               CASE WHEN stored.payload_sha256 = EXCLUDED.payload_sha256
                                    THEN 'duplicate'
                                    WHEN (stored.verified_with = 'provider_api')
                                             <> (EXCLUDED.verified_with = 'provider_api')
                                         AND stored.event_type = EXCLUDED.event_type
                                         AND stored.entity_id IS NOT DISTINCT FROM EXCLUDED.entity_id
                                         AND stored.entity_version
                                             IS NOT DISTINCT FROM EXCLUDED.entity_version
                                         AND stored.provider_sequence
                                             IS NOT DISTINCT FROM EXCLUDED.provider_sequence
                                    THEN 'duplicate'
                                    ELSE 'conflict' END AS outcome) AS c) AS k)
    RETURNING tenant_id, external_id, source_id, last_delivery_outcome, delivery_count, status,
              payload_sha256, superseded_sha256, first_received_at
), judged AS (
    SELECT r.ord, r.tenant_id, r.external_id, r.source_id AS delivered_source,
           r.payload_sha256 AS delivered_sha256, r.payload AS delivered_payload,
           r.headers AS delivered_headers, r.outside, r.received_at, r.replay_of,
           r.verified_layout, r.buffered,
           d.source_id, d.last_delivery_outcome, d.delivery_count, d.status, d.payload_sha256,
           d.superseded_sha256, d.first_received_at, d.source_id = r.source_id AS ours,
           CASE WHEN d.source_id <> r.source_id
                THEN CASE WHEN d.payload_sha256 = r.payload_sha256 THEN 'duplicate'
                          ELSE 'conflict' END
                WHEN r.replay_of IS NOT NULL AND d.last_delivery_outcome = 'accepted'
                THEN 'duplicate'
                ELSE d.last_delivery_outcome END AS outcome
    FROM delivered AS d
    JOIN replay AS r ON r.tenant_id = d.tenant_id AND r.external_id = d.external_id
), conflict AS (
    INSERT INTO ingest_anomalies AS a (
        tenant_id, source_id, kind, external_id, payload_sha256, stored_sha256,
        superseded_sha256, payload_replaced, payload, detail, headers, last_seen_at)
    SELECT j.tenant_id, j.delivered_source, 'digest_conflict', j.external_id, j.delivered_sha256,
           j.payload_sha256,
           CASE WHEN j.payload_sha256 = j.delivered_sha256 THEN j.superseded_sha256 END,
           j.payload_sha256 = j.delivered_sha256,
           CASE WHEN j.payload_sha256 = j.delivered_sha256 THEN NULL ELSE j.delivered_payload END,
           CASE WHEN j.payload_sha256 = j.delivered_sha256
                THEN 'same event id, different payload: the unprocessed row took the newer payload'
                WHEN j.outside AND j.status = 'pending'
                THEN 'same event id, different payload: the stored payload was kept (the id is '
                     || 'outside the signature, so nothing binds it to these bytes)'
                ELSE 'same event id, different payload: the stored payload was kept (row is '
                     || j.status || ')' END,
           j.delivered_headers, j.received_at
    FROM judged AS j
    WHERE j.ours AND j.last_delivery_outcome = 'conflict' AND j.replay_of IS NULL
    ON CONFLICT (source_id, kind, external_id, payload_sha256) WHERE last_seen_at IS NOT NULL
    DO UPDATE SET seen_count = a.seen_count + 1,
        last_seen_at = greatest(a.last_seen_at, EXCLUDED.last_seen_at),
        stored_sha256 = EXCLUDED.stored_sha256,
        superseded_sha256 = COALESCE(EXCLUDED.superseded_sha256, a.superseded_sha256),
        payload_replaced = a.payload_replaced OR EXCLUDED.payload_replaced,
        payload = CASE WHEN a.payload IS NULL THEN EXCLUDED.payload ELSE a.payload END,
        detail = EXCLUDED.detail
), collision AS (
    INSERT INTO ingest_anomalies AS a (
        tenant_id, source_id, kind, external_id, payload_sha256, stored_sha256,
        payload_replaced, payload, detail, headers, last_seen_at)
    SELECT j.tenant_id, j.delivered_source, 'source_collision', j.external_id, j.delivered_sha256,
           j.payload_sha256, false, j.delivered_payload,
           'the event id is already stored under source ' || j.source_id
           || ' of the same tenant: that row was left as it is and this delivery is kept here, '
           || 'not stored as an event (' || j.outcome || ')',
           j.delivered_headers, j.received_at
    FROM judged AS j
    WHERE NOT j.ours
    ON CONFLICT (source_id, kind, external_id, payload_sha256) WHERE last_seen_at IS NOT NULL
    DO UPDATE SET seen_count = a.seen_count + 1,
        last_seen_at = greatest(a.last_seen_at, EXCLUDED.last_seen_at),
        stored_sha256 = EXCLUDED.stored_sha256
), replayed AS (
    INSERT INTO ingest_anomalies AS a (
        tenant_id, source_id, kind, external_id, payload_sha256, stored_sha256,
        payload_replaced, detail, headers, replay_of, last_seen_at)
    SELECT j.tenant_id, j.delivered_source, 'replayed_body', j.external_id, j.delivered_sha256,
           j.payload_sha256, false,
           CASE WHEN j.last_delivery_outcome = 'accepted'
                THEN 'the signed body of event ' || j.replay_of || ', delivered again under this '
                     || 'id, which is outside the signature: a replay, or a distinct delivery of '
                     || 'identical bytes. Stored as this event, held: processed without effects'
                ELSE 'the signed body of event ' || j.replay_of || ', delivered under the id of '
                     || 'this stored event (' || j.status || '), which is outside the signature: '
                     || 'the stored event was left as it was' END,
           j.delivered_headers, j.replay_of, j.received_at
    FROM judged AS j
    WHERE j.ours AND j.replay_of IS NOT NULL
    ON CONFLICT (source_id, kind, external_id, payload_sha256) WHERE last_seen_at IS NOT NULL
    DO UPDATE SET seen_count = a.seen_count + 1,
        last_seen_at = greatest(a.last_seen_at, EXCLUDED.last_seen_at),
        stored_sha256 = EXCLUDED.stored_sha256
), queued AS (
    INSERT INTO event_queue (tenant_id, external_id)
    SELECT j.tenant_id, j.external_id FROM judged AS j
    WHERE j.ours AND j.last_delivery_outcome = 'accepted' AND j.replay_of IS NULL
), filed AS (
    -- The layout of a payload this delivery stored (new, or taken in a conflict), and one more
    -- delivery the buffer filed.
    INSERT INTO event_filings AS f (tenant_id, external_id, verified_layout, buffered_deliveries)
    SELECT j.tenant_id, j.external_id,
           CASE WHEN j.replay_of IS NULL AND j.payload_sha256 = j.delivered_sha256
                     AND j.last_delivery_outcome <> 'duplicate' THEN j.verified_layout END,
           COALESCE(j.buffered, 0)
    FROM judged AS j
    WHERE j.ours AND (j.buffered IS NOT NULL
                      OR (j.verified_layout IS NOT NULL AND j.replay_of IS NULL
                          AND j.payload_sha256 = j.delivered_sha256
                          AND j.last_delivery_outcome <> 'duplicate'))
    ON CONFLICT (tenant_id, external_id) DO UPDATE SET
        verified_layout = COALESCE(EXCLUDED.verified_layout, f.verified_layout),
        buffered_deliveries = f.buffered_deliveries + EXCLUDED.buffered_deliveries
), repeated AS (
    INSERT INTO delivery_hours_dirty (source_id, hour, rereads_changes)
    SELECT m.source_id, m.hour, m.rereads_changes
    FROM (SELECT j.source_id, date_trunc('hour', j.first_received_at) AS hour,
                 bool_or(j.last_delivery_outcome = 'conflict'
                         AND j.payload_sha256 = j.delivered_sha256) AS rereads_changes
          FROM judged AS j
          WHERE j.ours AND j.last_delivery_outcome <> 'accepted'
            AND j.first_received_at < now() - interval '5 minutes'
          GROUP BY 1, 2) AS m
    WHERE NOT EXISTS (SELECT 1 FROM delivery_hours_dirty AS d
                      WHERE d.source_id = m.source_id AND d.hour = m.hour
                        AND (d.rereads_changes OR NOT m.rereads_changes))
)
SELECT ord, outcome, delivery_count, status, payload_sha256 = delivered_sha256 AS holds_delivery,
       CASE WHEN NOT ours THEN source_id END AS collided_with, replay_of
FROM judged
ORDER BY ord
"#;

/// The batch statement's text, for benchmarks that run it outside this crate.
pub fn upsert_batch_sql() -> &'static str {
    UPSERT_BATCH
}

#[derive(sqlx::FromRow)]
struct UpsertRow {
    outcome: String,
    delivery_count: i32,
    status: String,
    holds_delivery: bool,
    collided_with: Option<String>,
    replay_of: Option<String>,
}

/// The unique index that keeps one effective row per body whose event id is unsigned.
const BODY_ONCE: &str = "webhook_events_body_once";

/// Stores a verified delivery exactly once. Returns only after the statement committed (when
/// the executor is a pool connection) or as part of the caller's transaction. A body stored
/// under another id that `signed_bodies` does not hold ([`UpsertError::BodyNotClaimed`]) fails
/// the statement: in a caller's transaction, that transaction is then aborted.
#[tracing::instrument(skip_all, fields(tenant_id = event.tenant_id, external_id = event.external_id), err)]
pub async fn upsert(
    executor: impl PgExecutor<'_>,
    event: &NewEvent<'_>,
) -> Result<Upserted, UpsertError> {
    let row: Result<UpsertRow, sqlx::Error> = sqlx::query_as(UPSERT)
        .bind(event.tenant_id)
        .bind(event.external_id)
        .bind(event.source_id)
        .bind(event.event_type)
        .bind(event.entity_id)
        .bind(event.entity_version)
        .bind(event.sequence)
        .bind(event.payload)
        .bind(&event.payload_sha256[..])
        .bind(&event.headers)
        .bind(event.verified_with)
        .bind(event.provider_retries)
        .bind(event.id_outside_signature)
        .bind(event.version_tiebreak)
        .bind(event.body_claim())
        .bind(event.verified_layout)
        .fetch_one(executor)
        .await;
    let row = match row {
        Err(sqlx::Error::Database(db)) if db.constraint() == Some(BODY_ONCE) => {
            return Err(UpsertError::BodyNotClaimed);
        }
        other => other.map_err(StoreError::from)?,
    };
    let outcome = match row.outcome.as_str() {
        "accepted" => DeliveryOutcome::Accepted,
        "duplicate" => DeliveryOutcome::Duplicate,
        "conflict" => DeliveryOutcome::Conflict,
        other => {
            return Err(StoreError::Corrupt {
                what: "delivery outcome",
                reason: other.to_owned(),
            }
            .into());
        }
    };
    Ok(Upserted {
        outcome,
        delivery_count: row.delivery_count,
        status: row.status,
        holds_delivery: row.holds_delivery,
        collided_with: row.collided_with,
        replay_of: row.replay_of,
    })
}

/// A verified delivery taken from the buffer, and when ingest received it.
#[derive(Debug, Clone)]
pub struct BatchedEvent<'a> {
    pub event: NewEvent<'a>,
    /// The row's received time: when ingest received the delivery, not when it was filed.
    pub received_at: chrono::DateTime<chrono::Utc>,
    /// The SQS buffer's consumer files it (counted in `buffered_deliveries`).
    pub buffered: bool,
}

#[derive(sqlx::FromRow)]
struct BatchRow {
    ord: i32,
    outcome: String,
    delivery_count: i32,
    status: String,
    holds_delivery: bool,
    collided_with: Option<String>,
    replay_of: Option<String>,
}

/// Splits a batch into rounds, in order, so that no key repeats within a round: a delivery goes
/// to the round after the latest one holding any of its keys (`(tenant_id, external_id)`, and
/// `(source_id, payload_sha256)` when its id is outside the signature). Returns each
/// delivery's round.
fn rounds(events: &[&BatchedEvent<'_>]) -> Vec<usize> {
    use std::collections::HashMap;
    let mut by_event: HashMap<(&str, &str), usize> = HashMap::new();
    let mut by_body: HashMap<(&str, &[u8]), usize> = HashMap::new();
    let mut by_claim: HashMap<(&str, &[u8]), usize> = HashMap::new();
    let mut assigned = Vec::with_capacity(events.len());
    for e in events {
        let ev = &e.event;
        let event_key = (ev.tenant_id, ev.external_id);
        let body_key = (ev.source_id, &ev.payload_sha256[..]);
        let claim_key = (ev.source_id, ev.body_claim());
        let mut round = by_event.get(&event_key).map_or(0, |r| r + 1);
        if ev.id_outside_signature {
            round = round.max(by_body.get(&body_key).map_or(0, |r| r + 1));
            round = round.max(by_claim.get(&claim_key).map_or(0, |r| r + 1));
            by_body.insert(body_key, round);
            by_claim.insert(claim_key, round);
        }
        by_event.insert(event_key, round);
        assigned.push(round);
    }
    assigned
}

/// Stores a batch of deliveries (buffered, or the elements of a batched request) as [`upsert`]
/// would one after another: the events not stored yet in one plain insert ([`INSERT_NEW`]),
/// then the others with one [`UPSERT_BATCH`] statement per round (see [`rounds`]; a batch
/// without repeated keys is one round). Runs in the caller's transaction and returns the
/// outcomes in input order.
///
/// Should a body stored under another unsigned id be written concurrently between the
/// statement's read and its insert (only a process running the release before migration 41
/// writes one), `webhook_events_body_once` fails the statement
/// ([`UpsertError::BodyNotClaimed`]) and the caller's transaction with it: run it again.
pub async fn upsert_batch(
    conn: &mut sqlx::PgConnection,
    events: &[BatchedEvent<'_>],
) -> Result<Vec<Upserted>, UpsertError> {
    let mut results: Vec<Option<Upserted>> = vec![None; events.len()];
    // New events first, in one plain insert: see [`INSERT_NEW`].
    let mut seen = std::collections::HashSet::new();
    let fresh: Vec<usize> = (0..events.len())
        .filter(|&i| {
            let e = &events[i].event;
            !e.id_outside_signature && seen.insert((e.tenant_id, e.external_id))
        })
        .collect();
    if !fresh.is_empty() {
        for index in insert_new(&mut *conn, events, &fresh).await? {
            let slot = results.get_mut(index).ok_or_else(|| StoreError::Corrupt {
                what: "batch insert",
                reason: format!("answered for delivery {index} of {}", events.len()),
            })?;
            *slot = Some(Upserted {
                outcome: DeliveryOutcome::Accepted,
                delivery_count: 1,
                status: "pending".to_owned(),
                holds_delivery: true,
                collided_with: None,
                replay_of: None,
            });
        }
    }
    // The rest (a stored id, a key repeated in the batch, an id outside the signature) with
    // the whole judgement, round by round.
    let rest: Vec<usize> = (0..events.len())
        .filter(|&i| results[i].is_none())
        .collect();
    let assigned = rounds(&rest.iter().map(|&i| &events[i]).collect::<Vec<_>>());
    let count = assigned.iter().max().map_or(0, |r| r + 1);
    for round in 0..count {
        let mut members: Vec<usize> = rest
            .iter()
            .zip(&assigned)
            .filter(|(_, r)| **r == round)
            .map(|(i, _)| *i)
            .collect();
        // A round's keys are distinct, so its order changes no outcome; taken in key order, two
        // statements holding the same events wait on each other instead of deadlocking.
        members.sort_by_key(|&i| (events[i].event.tenant_id, events[i].event.external_id));
        let rows = upsert_round(&mut *conn, events, &members).await?;
        if rows.len() != members.len() {
            return Err(StoreError::Corrupt {
                what: "batch upsert",
                reason: format!(
                    "{} rows answered for {} deliveries",
                    rows.len(),
                    members.len()
                ),
            }
            .into());
        }
        for row in rows {
            let index = usize::try_from(row.ord)
                .ok()
                .filter(|i| *i < events.len())
                .ok_or_else(|| StoreError::Corrupt {
                    what: "batch upsert",
                    reason: format!("answered for delivery {} of {}", row.ord, events.len()),
                })?;
            results[index] = Some(Upserted {
                outcome: parse_outcome(&row.outcome)?,
                delivery_count: row.delivery_count,
                status: row.status,
                holds_delivery: row.holds_delivery,
                collided_with: row.collided_with,
                replay_of: row.replay_of,
            });
        }
    }
    results
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            r.ok_or_else(|| {
                StoreError::Corrupt {
                    what: "batch upsert",
                    reason: format!("no answer for delivery {i}"),
                }
                .into()
            })
        })
        .collect()
}

/// The deliveries at `members`, column by column, as the batch statements bind them (each
/// column one array, read with `unnest`).
struct Columns<'a> {
    ord: Vec<i32>,
    tenant: Vec<&'a str>,
    external: Vec<&'a str>,
    source: Vec<&'a str>,
    event_type: Vec<&'a str>,
    entity_id: Vec<Option<&'a str>>,
    entity_version: Vec<Option<i64>>,
    sequence: Vec<Option<i64>>,
    payload: Vec<&'a [u8]>,
    digest: Vec<&'a [u8]>,
    headers: Vec<serde_json::Value>,
    verified_with: Vec<&'a str>,
    retries: Vec<i32>,
    outside: Vec<bool>,
    tiebreak: Vec<Option<i64>>,
    received: Vec<chrono::DateTime<chrono::Utc>>,
    claims: Vec<&'a [u8]>,
    layouts: Vec<Option<&'a str>>,
    /// 1 for a delivery the buffer's consumer files, else NULL: `buffered_deliveries` as the
    /// row would start.
    buffered: Vec<Option<i32>>,
}

impl<'a> Columns<'a> {
    fn of(events: &'a [BatchedEvent<'a>], members: &[usize]) -> Self {
        let n = members.len();
        let mut c = Columns {
            ord: Vec::with_capacity(n),
            tenant: Vec::with_capacity(n),
            external: Vec::with_capacity(n),
            source: Vec::with_capacity(n),
            event_type: Vec::with_capacity(n),
            entity_id: Vec::with_capacity(n),
            entity_version: Vec::with_capacity(n),
            sequence: Vec::with_capacity(n),
            payload: Vec::with_capacity(n),
            digest: Vec::with_capacity(n),
            headers: Vec::with_capacity(n),
            verified_with: Vec::with_capacity(n),
            retries: Vec::with_capacity(n),
            outside: Vec::with_capacity(n),
            tiebreak: Vec::with_capacity(n),
            received: Vec::with_capacity(n),
            claims: Vec::with_capacity(n),
            layouts: Vec::with_capacity(n),
            buffered: Vec::with_capacity(n),
        };
        for &i in members {
            let Some(b) = events.get(i) else { continue };
            let e = &b.event;
            c.ord.push(i32::try_from(i).unwrap_or(i32::MAX));
            c.tenant.push(e.tenant_id);
            c.external.push(e.external_id);
            c.source.push(e.source_id);
            c.event_type.push(e.event_type);
            c.entity_id.push(e.entity_id);
            c.entity_version.push(e.entity_version);
            c.sequence.push(e.sequence);
            c.payload.push(e.payload);
            c.digest.push(&e.payload_sha256[..]);
            c.headers.push(e.headers.clone());
            c.verified_with.push(e.verified_with);
            c.retries.push(e.provider_retries);
            c.outside.push(e.id_outside_signature);
            c.tiebreak.push(e.version_tiebreak);
            c.received.push(b.received_at);
            c.claims.push(e.body_claim());
            c.layouts.push(e.verified_layout);
            c.buffered.push(b.buffered.then_some(1));
        }
        c
    }
}

async fn upsert_round(
    conn: &mut sqlx::PgConnection,
    events: &[BatchedEvent<'_>],
    members: &[usize],
) -> Result<Vec<BatchRow>, UpsertError> {
    let c = Columns::of(events, members);
    let rows: Result<Vec<BatchRow>, sqlx::Error> = sqlx::query_as(UPSERT_BATCH)
        .bind(c.ord)
        .bind(c.tenant)
        .bind(c.external)
        .bind(c.source)
        .bind(c.event_type)
        .bind(c.entity_id)
        .bind(c.entity_version)
        .bind(c.sequence)
        .bind(c.payload)
        .bind(c.digest)
        .bind(c.headers)
        .bind(c.verified_with)
        .bind(c.retries)
        .bind(c.outside)
        .bind(c.tiebreak)
        .bind(c.received)
        .bind(c.claims)
        .bind(c.layouts)
        .bind(c.buffered)
        .fetch_all(conn)
        .await;
    match rows {
        Err(sqlx::Error::Database(db)) if db.constraint() == Some(BODY_ONCE) => {
            Err(UpsertError::BodyNotClaimed)
        }
        other => Ok(other.map_err(StoreError::from)?),
    }
}

/// The events of a batch whose id is not stored yet, inserted as [`UPSERT_BATCH`] would insert
/// them, without its judgement of a stored row: pending, queued, the delivery's own received
/// time. What it skips is what happens only to a stored row (a duplicate, a conflict and its
/// anomaly, a source collision, the hour mark of a repeat) or to an id outside the signature
/// (the body's claim, a replay), so only events whose id the signature covers come here, each
/// key once; `ON CONFLICT DO NOTHING` leaves a stored one (or one a concurrent transaction
/// stored first) to the whole statement. Returns the input positions (`ord`) it inserted.
const INSERT_NEW: &str = r#"
WITH input AS (
    SELECT * FROM unnest($1::int4[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
                         $7::int8[], $8::int8[], $9::bytea[], $10::bytea[], $11::jsonb[],
                         $12::text[], $13::int4[], $14::int8[], $15::timestamptz[], $16::text[],
                         $17::int4[])
        AS i(ord, tenant_id, external_id, source_id, event_type, entity_id, entity_version,
             provider_sequence, payload, payload_sha256, headers, verified_with, provider_retries,
             version_tiebreak, received_at, verified_layout, buffered)
), inserted AS (
    INSERT INTO webhook_events (
        tenant_id, external_id, source_id, event_type, entity_id, entity_version,
        provider_sequence, payload, payload_sha256, headers, verified_with, provider_retries,
        id_outside_signature, version_tiebreak, received_at, first_received_at, last_seen_at,
        status)
    SELECT i.tenant_id, i.external_id, i.source_id, i.event_type, i.entity_id, i.entity_version,
           i.provider_sequence, i.payload, i.payload_sha256, i.headers, i.verified_with,
           i.provider_retries, false, i.version_tiebreak, i.received_at, i.received_at,
           i.received_at, 'pending'
    FROM input AS i
    ORDER BY i.tenant_id, i.external_id
    ON CONFLICT (tenant_id, external_id) DO NOTHING
    RETURNING tenant_id, external_id
), queued AS (
    INSERT INTO event_queue (tenant_id, external_id)
    SELECT n.tenant_id, n.external_id FROM inserted AS n
), filed AS (
    INSERT INTO event_filings (tenant_id, external_id, verified_layout, buffered_deliveries)
    SELECT i.tenant_id, i.external_id, i.verified_layout, COALESCE(i.buffered, 0)
    FROM input AS i JOIN inserted AS n USING (tenant_id, external_id)
    WHERE i.verified_layout IS NOT NULL OR i.buffered IS NOT NULL
)
SELECT i.ord FROM input AS i JOIN inserted AS n USING (tenant_id, external_id)
"#;

/// [`INSERT_NEW`] for the events at `members` (ids signed, each key once).
async fn insert_new(
    conn: &mut sqlx::PgConnection,
    events: &[BatchedEvent<'_>],
    members: &[usize],
) -> Result<Vec<usize>, StoreError> {
    let c = Columns::of(events, members);
    let inserted: Vec<i32> = sqlx::query_scalar(INSERT_NEW)
        .bind(c.ord)
        .bind(c.tenant)
        .bind(c.external)
        .bind(c.source)
        .bind(c.event_type)
        .bind(c.entity_id)
        .bind(c.entity_version)
        .bind(c.sequence)
        .bind(c.payload)
        .bind(c.digest)
        .bind(c.headers)
        .bind(c.verified_with)
        .bind(c.retries)
        .bind(c.tiebreak)
        .bind(c.received)
        .bind(c.layouts)
        .bind(c.buffered)
        .fetch_all(conn)
        .await?;
    Ok(inserted
        .into_iter()
        .map(|ord| usize::try_from(ord).unwrap_or(usize::MAX))
        .collect())
}

fn parse_outcome(outcome: &str) -> Result<DeliveryOutcome, StoreError> {
    match outcome {
        "accepted" => Ok(DeliveryOutcome::Accepted),
        "duplicate" => Ok(DeliveryOutcome::Duplicate),
        "conflict" => Ok(DeliveryOutcome::Conflict),
        other => Err(StoreError::Corrupt {
            what: "delivery outcome",
            reason: other.to_owned(),
        }),
    }
}

/// Claims in `signed_bodies`, for the event that holds it, a body `webhook_events` stores under
/// an unsigned id but `signed_bodies` does not know (see [`UpsertError::BodyNotClaimed`]).
/// Returns whether a claim was written.
///
/// The claim is written under `body_claim`, the key this delivery claims by
/// ([`NewEvent::body_claim`]): the stored row's raw digest for a layout that signs the body, the
/// digest of the signed string for one that signs values (a row stored before claims were keyed
/// by it holds the same bytes, so the same signed string).
pub async fn adopt_stored_body(
    executor: impl PgExecutor<'_>,
    source_id: &str,
    payload_sha256: &[u8],
    body_claim: &[u8],
) -> Result<bool, StoreError> {
    const SQL: &str = "INSERT INTO signed_bodies (source_id, payload_sha256, external_id, first_seen_at, last_seen_at) \
         SELECT source_id, $3, external_id, first_received_at, last_seen_at FROM webhook_events \
         WHERE source_id = $1 AND payload_sha256 = $2 AND id_outside_signature \
         ON CONFLICT (source_id, payload_sha256) DO NOTHING";
    Ok(sqlx::query(SQL)
        .bind(source_id)
        .bind(payload_sha256)
        .bind(body_claim)
        .execute(executor)
        .await?
        .rows_affected()
        == 1)
}

/// One source's recent traffic, as `hookctl status` shows it. "The last day" runs from the
/// start of the hour a day ago (24 to 25 hours), the hours the anomaly pass's rollup calls the
/// last day.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct SourceActivity {
    pub source_id: String,
    pub tenant_id: String,
    pub scheme: String,
    pub enabled: bool,
    /// When its newest event first arrived (ever).
    pub last_received_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Events first received in the last hour, and in the last day.
    pub events_last_hour: i64,
    pub events_last_day: i64,
    /// Redeliveries of the last day's events (deliveries beyond the first).
    pub duplicates_last_day: i64,
    /// Deliveries of the last day's events that carried a different payload.
    pub conflicts_last_day: i64,
    /// Of the last day's events, those held: stored without effects because their bytes are
    /// another event's and their id is outside the signature (a replay, or a distinct delivery
    /// of identical bytes to review: see their `replayed_body` anomalies).
    #[serde(default)]
    pub held_last_day: i64,
}

/// Every source's recent traffic, each figure read so that its cost does not grow with the
/// traffic kept (issue 26):
///
/// - The newest event is read off the `(source_id, first_received_at)` index as a row
///   comparison: with a plain `source_id = ...` the planner took the `first_received_at` index
///   and filtered by source, which for `max()` of a quiet source walks the whole table's index
///   backwards. The row comparison bounds only the composite index, so the newest event is the
///   greatest key at or below `(source, infinity)`: one index entry, `NULL` when it is another
///   source's.
/// - The last hour's events are counted on the same index, per source, without the table.
/// - The last day's events, duplicates and conflicts are the hourly rollup's
///   (`delivery_hours`, see [`super::delivery_hours`]) for each hour it has computed, as of the
///   statement that computed it (the anomaly pass computes an hour again when it has new
///   events or a writer marked it), plus the events received in that hour since; an hour it
///   has not computed, or one a writer has marked since (the buffer filing a late delivery into
///   it, retention deleting from it), is read from `webhook_events` whole. So the table is read for what came
///   since the pass last ran, not for the day. The hours are counted by an integer series,
///   whose 25 rows the planner knows (over a series of timestamps it assumed 1000 and costed
///   the statement for a 40th of the table). A later delivery of an event already counted (a
///   duplicate, a conflict) shows from the pass's next run.
/// - Held events are found from their `replayed_body` anomalies (few), each event by its key.
pub async fn activity_by_source(
    executor: impl PgExecutor<'_>,
) -> Result<Vec<SourceActivity>, StoreError> {
    const SQL: &str = "SET LOCAL jit = off; \
         WITH slots AS ( \
             SELECT h.hour, c.hour IS NOT NULL AND NOT m.marked AS rolled, \
                    CASE WHEN m.marked THEN h.hour \
                         ELSE GREATEST(h.hour, LEAST(COALESCE(c.computed_at, h.hour), h.hour + interval '1 hour')) \
                    END AS live_from, \
                    CASE WHEN h.hour = date_trunc('hour', now()) THEN 'infinity'::timestamptz \
                         ELSE h.hour + interval '1 hour' END AS live_until \
             FROM generate_series(0, 24) AS k \
             CROSS JOIN LATERAL (SELECT date_trunc('hour', now() - interval '1 day') + make_interval(hours => k) \
                                 AS hour) AS h \
             CROSS JOIN LATERAL (SELECT EXISTS (SELECT 1 FROM delivery_hours_dirty AS d WHERE d.hour = h.hour) \
                                 AS marked) AS m \
             LEFT JOIN delivery_hours_computed AS c ON c.hour = h.hour), \
         day AS ( \
             SELECT f.source_id, sum(f.events) AS events, sum(f.redeliveries) AS redeliveries, \
                    sum(f.conflicts) AS conflicts \
             FROM ( \
                 SELECT d.source_id, d.events, d.redeliveries, d.conflicts \
                 FROM slots JOIN delivery_hours AS d \
                   ON d.hour >= slots.hour AND d.hour < slots.hour + interval '1 hour' \
                 WHERE slots.rolled \
                 UNION ALL \
                 SELECT a.source_id, a.events, a.redeliveries, a.conflicts \
                 FROM slots CROSS JOIN LATERAL ( \
                     SELECT e.source_id, count(*) AS events, sum(e.delivery_count - 1) AS redeliveries, \
                            sum(e.conflict_count) AS conflicts \
                     FROM webhook_events AS e \
                     WHERE e.first_received_at >= slots.live_from AND e.first_received_at < slots.live_until \
                     GROUP BY e.source_id) AS a) AS f \
             GROUP BY f.source_id), \
         held AS ( \
             SELECT e.source_id, count(DISTINCT (e.tenant_id, e.external_id)) AS events \
             FROM ingest_anomalies AS a \
             JOIN webhook_events AS e ON e.tenant_id = a.tenant_id AND e.external_id = a.external_id \
             WHERE a.kind = 'replayed_body' \
               AND a.detected_at >= date_trunc('hour', now() - interval '1 day') - interval '1 hour' \
               AND e.first_received_at >= date_trunc('hour', now() - interval '1 day') \
               AND e.payload_sha256 = a.payload_sha256 AND e.status = 'processed' \
               AND e.expects = 'nothing' AND NOT e.id_outside_signature \
             GROUP BY e.source_id) \
         SELECT s.source_id, s.tenant_id, s.scheme, s.enabled, \
             (SELECT n.first_received_at FROM ( \
                 SELECT e.source_id, e.first_received_at FROM webhook_events AS e \
                 WHERE (e.source_id, e.first_received_at) <= (s.source_id, 'infinity'::timestamptz) \
                 ORDER BY e.source_id DESC, e.first_received_at DESC LIMIT 1) AS n \
              WHERE n.source_id = s.source_id) AS last_received_at, \
             (SELECT count(*) FROM webhook_events AS e \
              WHERE e.source_id = s.source_id AND e.first_received_at > now() - interval '1 hour') AS events_last_hour, \
             COALESCE(d.events, 0)::bigint AS events_last_day, \
             COALESCE(d.redeliveries, 0)::bigint AS duplicates_last_day, \
             COALESCE(d.conflicts, 0)::bigint AS conflicts_last_day, \
             COALESCE(h.events, 0)::bigint AS held_last_day \
         FROM sources AS s \
         LEFT JOIN day AS d ON d.source_id = s.source_id \
         LEFT JOIN held AS h ON h.source_id = s.source_id \
         ORDER BY s.source_id";
    use sqlx::FromRow;
    // Without JIT: the planner cannot see how few rows an hour's range holds since the rollup
    // ran, costs the 25 ranges at 0.5% of the table each, and past `jit_above_cost` (5 M rows
    // here) compiled the statement for longer than it runs. `SET LOCAL` holds for the implicit
    // transaction of this one simple query (no parameters): one round trip.
    let rows = sqlx::raw_sql(SQL).fetch_all(executor).await?;
    Ok(rows
        .iter()
        .map(SourceActivity::from_row)
        .collect::<Result<_, _>>()?)
}

/// One stored event as an operator (or a subscriber fetching what its envelope left out) reads
/// it: what it is, where it stands, and its payload unless retention purged it.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct StoredEvent {
    pub tenant_id: String,
    pub external_id: String,
    pub source_id: String,
    pub event_type: String,
    pub entity_id: Option<String>,
    pub entity_version: Option<i64>,
    pub status: String,
    pub first_received_at: chrono::DateTime<chrono::Utc>,
    pub last_seen_at: chrono::DateTime<chrono::Utc>,
    pub delivery_count: i32,
    pub conflict_count: i32,
    pub processed_at: Option<chrono::DateTime<chrono::Utc>>,
    #[serde(skip)]
    pub payload: Option<Vec<u8>>,
}

/// The event by its key.
pub async fn find(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    external_id: &str,
) -> Result<Option<StoredEvent>, StoreError> {
    const SQL: &str = "SELECT tenant_id, external_id, source_id, event_type, entity_id, entity_version, \
             status, first_received_at, last_seen_at, delivery_count, conflict_count, processed_at, payload \
         FROM webhook_events WHERE tenant_id = $1 AND external_id = $2";
    Ok(sqlx::query_as(SQL)
        .bind(tenant_id)
        .bind(external_id)
        .fetch_optional(executor)
        .await?)
}

/// What an operator looks for among stored events (the console's events page): every field
/// optional, all given ones must hold. Newest first.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventSearch {
    #[serde(default)]
    pub source_id: Option<String>,
    #[serde(default)]
    pub event_type: Option<String>,
    /// `pending`, `processed` or `dead_lettered`.
    #[serde(default)]
    pub status: Option<String>,
    /// The provider's event id, exactly (what its support names).
    #[serde(default)]
    pub external_id: Option<String>,
    /// First received at or after.
    #[serde(default)]
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    /// First received before.
    #[serde(default)]
    pub until: Option<chrono::DateTime<chrono::Utc>>,
    /// JSON the payload contains (PostgreSQL's `@>`): `{"data":{"object":{"customer":"cus_1"}}}`.
    /// A payload that is not JSON, or was purged, never matches.
    #[serde(default)]
    pub contains: Option<serde_json::Value>,
    /// The page after the one that ended with this event.
    #[serde(default)]
    pub after: Option<EventCursor>,
}

/// Where a page of [`search`] ended: its last event's place in the order.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventCursor {
    pub first_received_at: chrono::DateTime<chrono::Utc>,
    pub tenant_id: String,
    pub external_id: String,
}

/// One event in a list: what it is and where it stands, without its bytes.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct ListedEvent {
    pub tenant_id: String,
    pub external_id: String,
    pub source_id: String,
    pub event_type: String,
    pub entity_id: Option<String>,
    pub status: String,
    pub first_received_at: chrono::DateTime<chrono::Utc>,
    pub delivery_count: i32,
    pub conflict_count: i32,
    /// Retention purged the payload.
    pub purged: bool,
}

/// Events matching `search`, newest first (first received), at most `limit`. A page reads about
/// the rows it returns: the order is the `(first_received_at)` and `(source_id,
/// first_received_at)` indexes' (read backwards, stopped by the limit), and a provider id is
/// looked up by the primary key. The state and the payload are checked on the rows those
/// indexes give: a rare state or payload reads until the page is full or the range ends
/// (`since`, `until` bound it).
pub async fn search(
    executor: impl PgExecutor<'_>,
    search: &EventSearch,
    limit: i64,
) -> Result<Vec<ListedEvent>, StoreError> {
    let mut query = sqlx::QueryBuilder::<sqlx::Postgres>::new(
        "SELECT tenant_id, external_id, source_id, event_type, entity_id, status, \
             first_received_at, delivery_count, conflict_count, payload IS NULL AS purged \
         FROM webhook_events WHERE true",
    );
    if let Some(source_id) = &search.source_id {
        query.push(" AND source_id = ").push_bind(source_id.clone());
    }
    if let Some(event_type) = &search.event_type {
        query
            .push(" AND event_type = ")
            .push_bind(event_type.clone());
    }
    if let Some(status) = &search.status {
        query.push(" AND status = ").push_bind(status.clone());
    }
    if let Some(external_id) = &search.external_id {
        // By the primary key, (tenant_id, external_id), once for each tenant: an id alone
        // is indexed by nothing.
        query
            .push(" AND tenant_id = ANY(ARRAY(SELECT DISTINCT tenant_id FROM sources))")
            .push(" AND external_id = ")
            .push_bind(external_id.clone());
    }
    if let Some(since) = search.since {
        query.push(" AND first_received_at >= ").push_bind(since);
    }
    if let Some(until) = search.until {
        query.push(" AND first_received_at < ").push_bind(until);
    }
    if let Some(contains) = &search.contains {
        query
            .push(" AND payload_json(payload) @> ")
            .push_bind(sqlx::types::Json(contains.clone()))
            .push("::jsonb");
    }
    if let Some(after) = &search.after {
        query
            .push(" AND (first_received_at, tenant_id, external_id) < (")
            .push_bind(after.first_received_at)
            .push(", ")
            .push_bind(after.tenant_id.clone())
            .push(", ")
            .push_bind(after.external_id.clone())
            .push(")");
    }
    query
        .push(" ORDER BY first_received_at DESC, tenant_id DESC, external_id DESC LIMIT ")
        .push_bind(limit);
    Ok(query.build_query_as().fetch_all(executor).await?)
}
