//! The `entities` table: the generic versioned projection.

use sqlx::PgExecutor;

use super::StoreError;

#[derive(Debug, Clone)]
pub struct EntityChange<'a> {
    pub tenant_id: &'a str,
    pub entity_type: &'a str,
    pub entity_id: &'a str,
    pub version: i64,
    pub state: &'a serde_json::Value,
    pub deleted: bool,
    pub external_id: &'a str,
    pub outbox_action: &'a str,
    pub outbox_key: &'a str,
}

/// Applies the change only when the stored version is lower, and in the same statement writes
/// the outbox row announcing it. A delete keeps the last state and sets `deleted`; a lower
/// version (a late update) changes nothing, so a deleted entity is never resurrected by one.
/// Returns whether the change was applied.
pub async fn apply_versioned(
    executor: impl PgExecutor<'_>,
    c: &EntityChange<'_>,
) -> Result<bool, StoreError> {
    const SQL: &str = "WITH applied AS ( \
             INSERT INTO entities AS cur (tenant_id, entity_type, entity_id, version, state, deleted, \
                 deleted_at, last_event_id) \
             VALUES ($1, $2, $3, $4, $5, $6, CASE WHEN $6 THEN now() END, $7) \
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
         SELECT count(*) FROM applied";
    let applied: i64 = sqlx::query_scalar(SQL)
        .bind(c.tenant_id)
        .bind(c.entity_type)
        .bind(c.entity_id)
        .bind(c.version)
        .bind(c.state)
        .bind(c.deleted)
        .bind(c.external_id)
        .bind(c.outbox_action)
        .bind(c.outbox_key)
        .fetch_one(executor)
        .await?;
    Ok(applied > 0)
}
