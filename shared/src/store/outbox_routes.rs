//! The `outbox_routes` table: where each outbox action of a tenant (or of one of its sources)
//! is delivered. `crate::outbox::routes` turns rows into routes and back.

use sqlx::PgExecutor;

use super::StoreError;

/// An `outbox_routes` row, column for column.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct RouteRow {
    pub tenant_id: String,
    pub source_id: Option<String>,
    pub action: String,
    pub kind: String,
    pub target: String,
    pub event_source: Option<String>,
    #[serde(default)]
    pub signing_secret_ref: Option<String>,
}

/// Every route, tenant by tenant.
pub async fn list(executor: impl PgExecutor<'_>) -> Result<Vec<RouteRow>, StoreError> {
    const SQL: &str = "SELECT tenant_id, source_id, action, kind, target, event_source, signing_secret_ref \
         FROM outbox_routes ORDER BY tenant_id, action, source_id NULLS FIRST";
    Ok(sqlx::query_as(SQL).fetch_all(executor).await?)
}

/// Removes every route (the apply writes the new set in the same transaction).
pub async fn delete_all(executor: impl PgExecutor<'_>) -> Result<u64, StoreError> {
    const SQL: &str = "DELETE FROM outbox_routes";
    Ok(sqlx::query(SQL).execute(executor).await?.rows_affected())
}

/// Writes one route.
pub async fn insert(executor: impl PgExecutor<'_>, row: &RouteRow) -> Result<(), StoreError> {
    const SQL: &str = "INSERT INTO outbox_routes (tenant_id, source_id, action, kind, target, event_source, signing_secret_ref) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)";
    sqlx::query(SQL)
        .bind(&row.tenant_id)
        .bind(&row.source_id)
        .bind(&row.action)
        .bind(&row.kind)
        .bind(&row.target)
        .bind(&row.event_source)
        .bind(&row.signing_secret_ref)
        .execute(executor)
        .await?;
    Ok(())
}

/// Serialises route applies: the second waits for the first to commit.
pub async fn lock_for_apply(executor: impl PgExecutor<'_>) -> Result<(), StoreError> {
    const SQL: &str = "LOCK TABLE outbox_routes IN SHARE ROW EXCLUSIVE MODE";
    sqlx::query(SQL).execute(executor).await?;
    Ok(())
}

/// The (tenant, source) pairs named by routes or subscriptions that no stored source has.
pub async fn unknown_sources(
    executor: impl PgExecutor<'_>,
) -> Result<Vec<(String, String)>, StoreError> {
    const SQL: &str = "SELECT r.tenant_id, r.source_id FROM ( \
             SELECT tenant_id, source_id FROM outbox_routes \
             UNION SELECT tenant_id, source_id FROM outbox_subscriptions) AS r \
         WHERE r.source_id IS NOT NULL AND NOT EXISTS ( \
             SELECT 1 FROM sources AS s WHERE s.source_id = r.source_id AND s.tenant_id = r.tenant_id) \
         ORDER BY 1, 2";
    Ok(sqlx::query_as(SQL).fetch_all(executor).await?)
}
