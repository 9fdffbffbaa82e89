//! The `entities` table: the generic versioned projection.

use sqlx::PgExecutor;

use super::{StoreError, column};

#[derive(Debug, Clone)]
pub struct EntityChange<'a> {
    pub tenant_id: &'a str,
    pub entity_type: &'a str,
    pub entity_id: &'a str,
    pub version: i64,
    /// Orders changes of one version (Shopify's trigger time); `None` orders lowest.
    pub version_tiebreak: Option<i64>,
    /// The entity's state: JSON text (PostgreSQL parses it; invalid JSON fails the statement).
    pub state: &'a str,
    pub deleted: bool,
    pub external_id: &'a str,
    /// The event's source and payload digest, for the anomaly an ambiguous version records.
    pub source_id: &'a str,
    pub payload_sha256: &'a [u8],
    /// The outbox row's idempotency key.
    pub outbox_key: String,
    /// When the event was first received: an entity last changed before then holds an effect
    /// that predates the event row.
    pub since: chrono::DateTime<chrono::Utc>,
}

/// What applying a versioned change did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct Applied {
    pub applied: bool,
    /// Not applied, and the entity already holds this very event's version.
    pub held_by_this_event: bool,
    /// ... and was last changed before `since` (the event's first receipt): the effect
    /// predates the event row, so this delivery repeats one whose identity was purged.
    pub changed_before: bool,
}

/// Applies each change only when the stored (version, tiebreak, event id) is lower, and in the
/// same statement writes the outbox row announcing it (with the version it replaced,
/// `previous_version`, null for a new entity): one statement for all of `changes`,
/// which must name distinct entities (the caller applies a second change of one entity in a
/// later call). Returns what happened to each change, in order. A delete keeps the last state
/// and sets `deleted`; a lower version (a late update) changes nothing, so a deleted entity is
/// never resurrected by one.
///
/// Two events of one version are ordered by their tiebreak (a missing one orders lowest) and,
/// when that does not tell them apart, by the greater event id: any processing order ends on the
/// same event. When two different changes meet that way (same version, no tiebreak telling them
/// apart, other state) nothing says which came later, and an `ambiguous_version` anomaly is
/// recorded. The entities are locked first, all of them, in key order (so concurrent drainers
/// never deadlock on them), and compared with what is committed; new ones are inserted in key
/// order too.
///
/// A change is stamped with the time of this statement, never the transaction's start: the
/// statement runs after the claim that read the event, so the stamp is never older than the
/// event's receipt, however long before it the drain's transaction began. `changed_before`
/// and reconcile compare against that stamp.
pub async fn apply_versioned(
    executor: impl PgExecutor<'_>,
    changes: &[EntityChange<'_>],
    outbox_action: &str,
) -> Result<Vec<Applied>, StoreError> {
    const SQL: &str = "WITH c AS ( \
             SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bigint[], \
                 $6::text[], $7::bool[], $8::text[], $9::text[], $10::bytea[], $11::text[], $12::timestamptz[]) \
             WITH ORDINALITY AS c(tenant_id, entity_type, entity_id, version, version_tiebreak, \
                 state, deleted, external_id, source_id, payload_sha256, outbox_key, since, n)), \
         before AS ( \
             SELECT e.tenant_id, e.entity_type, e.entity_id, e.version, e.version_tiebreak, \
                 e.last_event_id, e.state, e.deleted, e.updated_at \
             FROM entities AS e JOIN c USING (tenant_id, entity_type, entity_id) \
             ORDER BY e.tenant_id, e.entity_type, e.entity_id \
             FOR UPDATE OF e), \
         applied AS ( \
             INSERT INTO entities AS cur (tenant_id, entity_type, entity_id, version, version_tiebreak, \
                 state, deleted, deleted_at, last_event_id, updated_at) \
             SELECT c.tenant_id, c.entity_type, c.entity_id, c.version, c.version_tiebreak, \
                 c.state::jsonb, c.deleted, CASE WHEN c.deleted THEN statement_timestamp() END, c.external_id, \
                 statement_timestamp() \
             FROM c \
             WHERE (SELECT count(*) FROM before) >= 0 \
             ORDER BY c.tenant_id, c.entity_type, c.entity_id \
             ON CONFLICT (tenant_id, entity_type, entity_id) DO UPDATE SET \
                 version = EXCLUDED.version, \
                 version_tiebreak = EXCLUDED.version_tiebreak, \
                 state = CASE WHEN EXCLUDED.deleted THEN cur.state ELSE EXCLUDED.state END, \
                 deleted = EXCLUDED.deleted, \
                 deleted_at = CASE WHEN EXCLUDED.deleted THEN statement_timestamp() END, \
                 last_event_id = EXCLUDED.last_event_id, \
                 updated_at = statement_timestamp() \
             WHERE (cur.version, COALESCE(cur.version_tiebreak, -9223372036854775808), cur.last_event_id) \
                 < (EXCLUDED.version, COALESCE(EXCLUDED.version_tiebreak, -9223372036854775808), EXCLUDED.last_event_id) \
             RETURNING tenant_id, entity_type, entity_id, version, deleted), \
         announced AS ( \
             INSERT INTO outbox (tenant_id, external_id, action, payload, idempotency_key) \
             SELECT a.tenant_id, c.external_id, $13, jsonb_build_object('entity_type', a.entity_type, \
                    'entity_id', a.entity_id, 'version', a.version, 'deleted', a.deleted, \
                    'previous_version', b.version), c.outbox_key \
             FROM applied AS a JOIN c USING (tenant_id, entity_type, entity_id) \
             LEFT JOIN before AS b USING (tenant_id, entity_type, entity_id) \
             ON CONFLICT (tenant_id, external_id, action) DO NOTHING), \
         ambiguous AS ( \
             INSERT INTO ingest_anomalies (tenant_id, source_id, kind, external_id, payload_sha256, detail) \
             SELECT c.tenant_id, c.source_id, 'ambiguous_version', c.external_id, c.payload_sha256, \
                 'events ' || least(b.last_event_id, c.external_id) || ' and ' || greatest(b.last_event_id, c.external_id) \
                 || ' change ' || c.entity_type || ' ' || c.entity_id || ' differently with the same version ' || c.version \
                 || ' and nothing orders them (no tiebreak tells them apart): the projection keeps ' \
                 || greatest(b.last_event_id, c.external_id) || ', the greater event id' \
             FROM c JOIN before AS b USING (tenant_id, entity_type, entity_id) \
             WHERE b.version = c.version AND b.last_event_id <> c.external_id \
               AND (b.version_tiebreak IS NULL OR c.version_tiebreak IS NULL OR b.version_tiebreak = c.version_tiebreak) \
               AND (b.deleted <> c.deleted OR b.state <> c.state::jsonb)) \
         SELECT a.entity_id IS NOT NULL AS applied, \
             COALESCE(a.entity_id IS NULL AND b.last_event_id = c.external_id, false) AS held_by_this_event, \
             COALESCE(b.updated_at < c.since, false) AS changed_before \
         FROM c \
         LEFT JOIN before AS b USING (tenant_id, entity_type, entity_id) \
         LEFT JOIN applied AS a USING (tenant_id, entity_type, entity_id) \
         ORDER BY c.n";
    if changes.is_empty() {
        return Ok(Vec::new());
    }
    // Planned afresh each time (an unnamed statement), never from a cached generic plan: one
    // planned while `entities` was small joins it by a sequential scan, and nothing replans it
    // as the table grows until the table is next analyzed (a drain with autovacuum off slowed
    // to half its rate in five minutes). Planned with the arrays in hand, it looks every key up
    // in the index. Planning costs about a millisecond, once per batch.
    let applied: Vec<Applied> = sqlx::query_as(SQL)
        .persistent(false)
        .bind(column(changes, |c| c.tenant_id))
        .bind(column(changes, |c| c.entity_type))
        .bind(column(changes, |c| c.entity_id))
        .bind(column(changes, |c| c.version))
        .bind(column(changes, |c| c.version_tiebreak))
        .bind(column(changes, |c| c.state))
        .bind(column(changes, |c| c.deleted))
        .bind(column(changes, |c| c.external_id))
        .bind(column(changes, |c| c.source_id))
        .bind(column(changes, |c| c.payload_sha256))
        .bind(column(changes, |c| c.outbox_key.as_str()))
        .bind(column(changes, |c| c.since))
        .bind(outbox_action)
        .fetch_all(executor)
        .await?;
    if applied.len() != changes.len() {
        return Err(StoreError::Corrupt {
            what: "entity changes",
            reason: format!(
                "{} results for {} changes: two changes name one entity",
                applied.len(),
                changes.len()
            ),
        });
    }
    Ok(applied)
}

/// The announcement of an entity change the entity already holds, written if missing (the
/// reconciler's repair of a lost outbox row).
pub async fn ensure_announced(
    executor: impl PgExecutor<'_>,
    c: &EntityChange<'_>,
    outbox_action: &str,
) -> Result<bool, StoreError> {
    const SQL: &str = "INSERT INTO outbox (tenant_id, external_id, action, payload, idempotency_key) \
         SELECT tenant_id, $4, $5, jsonb_build_object('entity_type', entity_type, 'entity_id', entity_id, \
                'version', version, 'deleted', deleted), $6 \
         FROM entities WHERE tenant_id = $1 AND entity_type = $2 AND entity_id = $3 AND last_event_id = $4 \
         ON CONFLICT (tenant_id, external_id, action) DO NOTHING";
    let done = sqlx::query(SQL)
        .bind(c.tenant_id)
        .bind(c.entity_type)
        .bind(c.entity_id)
        .bind(c.external_id)
        .bind(outbox_action)
        .bind(&c.outbox_key)
        .execute(executor)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// An entity as the projection holds it now.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct Entity {
    pub entity_type: String,
    pub entity_id: String,
    pub version: i64,
    pub deleted: bool,
    /// The event whose version it holds.
    pub last_event_id: String,
    pub updated_at: chrono::DateTime<chrono::Utc>,
}

/// The entity `(tenant_id, entity_type, entity_id)`, if the projection holds it.
pub async fn current(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    entity_type: &str,
    entity_id: &str,
) -> Result<Option<Entity>, StoreError> {
    const SQL: &str = "SELECT entity_type, entity_id, version, deleted, last_event_id, updated_at \
         FROM entities WHERE tenant_id = $1 AND entity_type = $2 AND entity_id = $3";
    Ok(sqlx::query_as(SQL)
        .bind(tenant_id)
        .bind(entity_type)
        .bind(entity_id)
        .fetch_optional(executor)
        .await?)
}
