//! The `maintenance_runs` table: one row per run of reconcile, backfill or retention.

use sqlx::PgExecutor;

use super::StoreError;

pub async fn start(
    executor: impl PgExecutor<'_>,
    job: &str,
    trigger: &str,
) -> Result<i64, StoreError> {
    const SQL: &str = "INSERT INTO maintenance_runs (job, trigger, status) VALUES ($1, $2, 'running') RETURNING run_id";
    Ok(sqlx::query_scalar(SQL)
        .bind(job)
        .bind(trigger)
        .fetch_one(executor)
        .await?)
}

/// A trigger that found the job already running: recorded, then it returns at once.
pub async fn skipped(
    executor: impl PgExecutor<'_>,
    job: &str,
    trigger: &str,
) -> Result<i64, StoreError> {
    const SQL: &str = "INSERT INTO maintenance_runs (job, trigger, status, finished_at) VALUES ($1, $2, 'skipped', now()) RETURNING run_id";
    Ok(sqlx::query_scalar(SQL)
        .bind(job)
        .bind(trigger)
        .fetch_one(executor)
        .await?)
}

pub async fn finish(
    executor: impl PgExecutor<'_>,
    run_id: i64,
    found: &serde_json::Value,
    repaired: &serde_json::Value,
    error: Option<&str>,
) -> Result<(), StoreError> {
    const SQL: &str = "UPDATE maintenance_runs SET status = CASE WHEN $4::text IS NULL THEN 'completed' ELSE 'failed' END, \
             finished_at = now(), found = $2, repaired = $3, error = $4 WHERE run_id = $1";
    sqlx::query(SQL)
        .bind(run_id)
        .bind(found)
        .bind(repaired)
        .bind(error)
        .execute(executor)
        .await?;
    Ok(())
}
