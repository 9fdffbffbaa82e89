//! The `entities` table: the generic versioned projection.

use sqlx::PgExecutor;

use super::StoreError;

#[derive(Debug, Clone)]
pub struct EntityChange<'a> {
    pub tenant_id: &'a str,
    pub entity_type: &'a str,
    pub entity_id: &'a str,
    pub version: i64,
    /// The entity's state: JSON text (PostgreSQL parses it; invalid JSON fails the statement).
    pub state: &'a str,
    pub deleted: bool,
    pub external_id: &'a str,
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

/// Applies the change only when the stored version is lower, and in the same statement writes
/// the outbox row announcing it. A delete keeps the last state and sets `deleted`; a lower
/// version (a late update) changes nothing, so a deleted entity is never resurrected by one.
pub async fn apply_versioned(
    executor: impl PgExecutor<'_>,
    c: &EntityChange<'_>,
    since: chrono::DateTime<chrono::Utc>,
) -> Result<Applied, StoreError> {
    const SQL: &str = "WITH applied AS ( \
             INSERT INTO entities AS cur (tenant_id, entity_type, entity_id, version, state, deleted, \
                 deleted_at, last_event_id) \
             VALUES ($1, $2, $3, $4, $5::jsonb, $6, CASE WHEN $6 THEN now() END, $7) \
             ON CONFLICT (tenant_id, entity_type, entity_id) DO UPDATE SET \
                 version = EXCLUDED.version, \
                 state = CASE WHEN EXCLUDED.deleted THEN cur.state ELSE EXCLUDED.state END, \
                 deleted = EXCLUDED.deleted, \
                 deleted_at = CASE WHEN EXCLUDED.deleted THEN now() END, \
                 last_event_id = EXCLUDED.last_event_id, \
                 updated_at = now() \
             WHERE cur.version < EXCLUDED.version \
             RETURNING tenant_id, entity_type, entity_id, version, deleted), \
         announced AS ( \
             INSERT INTO outbox (tenant_id, external_id, action, payload, idempotency_key) \
             SELECT a.tenant_id, $7, $8, jsonb_build_object('entity_type', a.entity_type, \
                    'entity_id', a.entity_id, 'version', a.version, 'deleted', a.deleted), $9 \
             FROM applied AS a \
             ON CONFLICT (tenant_id, external_id, action) DO NOTHING) \
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
