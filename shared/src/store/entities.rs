//! The `entities` table: the generic versioned projection.

use sqlx::PgExecutor;

use super::StoreError;

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
    pub outbox_action: &'a str,
    pub outbox_key: &'a str,
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

/// Applies the change only when the stored (version, tiebreak, event id) is lower, and in the
/// same statement writes the outbox row announcing it. A delete keeps the last state and sets
/// `deleted`; a lower version (a late update) changes nothing, so a deleted entity is never
/// resurrected by one.
///
/// Two events of one version are ordered by their tiebreak (a missing one orders lowest) and,
/// when that does not tell them apart, by the greater event id: any processing order ends on the
/// same event. When two different changes meet that way (same version, no tiebreak telling them
/// apart, other state) nothing says which came later, and an `ambiguous_version` anomaly is
/// recorded. The entity row is locked first, so the comparison is with what is committed.
pub async fn apply_versioned(
    executor: impl PgExecutor<'_>,
    c: &EntityChange<'_>,
    since: chrono::DateTime<chrono::Utc>,
) -> Result<Applied, StoreError> {
    const SQL: &str = "WITH before AS ( \
             SELECT version, version_tiebreak, last_event_id, state, deleted FROM entities \
             WHERE tenant_id = $1 AND entity_type = $2 AND entity_id = $3 FOR UPDATE), \
         applied AS ( \
             INSERT INTO entities AS cur (tenant_id, entity_type, entity_id, version, version_tiebreak, \
                 state, deleted, deleted_at, last_event_id) \
             SELECT $1, $2, $3, $4, $11, $5::jsonb, $6, CASE WHEN $6 THEN now() END, $7 \
             FROM (SELECT 1) AS one LEFT JOIN before ON true \
             ON CONFLICT (tenant_id, entity_type, entity_id) DO UPDATE SET \
                 version = EXCLUDED.version, \
                 version_tiebreak = EXCLUDED.version_tiebreak, \
                 state = CASE WHEN EXCLUDED.deleted THEN cur.state ELSE EXCLUDED.state END, \
                 deleted = EXCLUDED.deleted, \
                 deleted_at = CASE WHEN EXCLUDED.deleted THEN now() END, \
                 last_event_id = EXCLUDED.last_event_id, \
                 updated_at = now() \
             WHERE (cur.version, COALESCE(cur.version_tiebreak, -9223372036854775808), cur.last_event_id) \
                 < (EXCLUDED.version, COALESCE(EXCLUDED.version_tiebreak, -9223372036854775808), EXCLUDED.last_event_id) \
             RETURNING tenant_id, entity_type, entity_id, version, deleted), \
         announced AS ( \
             INSERT INTO outbox (tenant_id, external_id, action, payload, idempotency_key) \
             SELECT a.tenant_id, $7, $8, jsonb_build_object('entity_type', a.entity_type, \
                    'entity_id', a.entity_id, 'version', a.version, 'deleted', a.deleted), $9 \
             FROM applied AS a \
             ON CONFLICT (tenant_id, external_id, action) DO NOTHING), \
         ambiguous AS ( \
             INSERT INTO ingest_anomalies (tenant_id, source_id, kind, external_id, payload_sha256, detail) \
             SELECT $1, $12, 'ambiguous_version', $7, $13, \
                 'events ' || least(b.last_event_id, $7) || ' and ' || greatest(b.last_event_id, $7) \
                 || ' change ' || $2 || ' ' || $3 || ' differently with the same version ' || $4 \
                 || ' and nothing orders them (no tiebreak tells them apart): the projection keeps ' \
                 || greatest(b.last_event_id, $7) || ', the greater event id' \
             FROM before AS b \
             WHERE b.version = $4 AND b.last_event_id <> $7 \
               AND (b.version_tiebreak IS NULL OR $11::bigint IS NULL OR b.version_tiebreak = $11) \
               AND (b.deleted <> $6 OR b.state <> $5::jsonb)) \
         SELECT EXISTS (SELECT 1 FROM applied) AS applied, \
             COALESCE(NOT EXISTS (SELECT 1 FROM applied) AND cur.last_event_id = $7, false) AS held_by_this_event, \
             COALESCE(cur.updated_at < $10, false) AS changed_before \
         FROM (SELECT 1) AS one \
         LEFT JOIN entities AS cur ON cur.tenant_id = $1 AND cur.entity_type = $2 AND cur.entity_id = $3";
    let applied: Applied = sqlx::query_as(SQL)
        .bind(c.tenant_id)
        .bind(c.entity_type)
        .bind(c.entity_id)
        .bind(c.version)
        .bind(c.state)
        .bind(c.deleted)
        .bind(c.external_id)
        .bind(c.outbox_action)
        .bind(c.outbox_key)
        .bind(since)
        .bind(c.version_tiebreak)
        .bind(c.source_id)
        .bind(c.payload_sha256)
        .fetch_one(executor)
        .await?;
    Ok(applied)
}

/// The announcement of an entity change the entity already holds, written if missing (the
/// reconciler's repair of a lost outbox row).
pub async fn ensure_announced(
    executor: impl PgExecutor<'_>,
    c: &EntityChange<'_>,
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
        .bind(c.outbox_action)
        .bind(c.outbox_key)
        .execute(executor)
        .await?;
    Ok(done.rows_affected() == 1)
}
