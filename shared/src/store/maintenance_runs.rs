//! The `maintenance_runs` table: one row per run of reconcile, backfill, retention or anomaly.

use chrono::{DateTime, Utc};
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

/// Ends a run with its counts. A count recorded while the run went on ([`record_repaired`]) and
/// absent from these stays: a pass that panicked (finished with `{}`) keeps what it had repaired.
pub async fn finish(
    executor: impl PgExecutor<'_>,
    run_id: i64,
    found: &serde_json::Value,
    repaired: &serde_json::Value,
    error: Option<&str>,
) -> Result<(), StoreError> {
    const SQL: &str = "UPDATE maintenance_runs SET status = CASE WHEN $4::text IS NULL THEN 'completed' ELSE 'failed' END, \
             finished_at = now(), found = found || $2, repaired = repaired || $3, error = $4 WHERE run_id = $1";
    sqlx::query(SQL)
        .bind(run_id)
        .bind(found)
        .bind(repaired)
        .bind(error)
        .execute(executor)
        .await?;
    Ok(())
}

/// Records what a running pass has repaired so far, before anything else it does can fail or
/// panic: a repair is a signal (the `reconcile_repairs_last_day` check reads it).
pub async fn record_repaired(
    executor: impl PgExecutor<'_>,
    run_id: i64,
    repaired: &serde_json::Value,
) -> Result<(), StoreError> {
    const SQL: &str = "UPDATE maintenance_runs SET repaired = repaired || $2 WHERE run_id = $1";
    sqlx::query(SQL)
        .bind(run_id)
        .bind(repaired)
        .execute(executor)
        .await?;
    Ok(())
}

/// The jobs that record runs.
pub const JOBS: &[&str] = &["reconcile", "backfill", "retention", "anomaly"];

/// A job's latest run, and when it last completed.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct LatestRun {
    pub job: String,
    pub run_id: Option<i64>,
    pub status: Option<String>,
    pub trigger: Option<String>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub error: Option<String>,
    pub last_completed_at: Option<DateTime<Utc>>,
    /// Seconds since it last completed, by the database's clock.
    pub completed_age_seconds: Option<f64>,
}

/// Each job's latest run, read off `maintenance_runs_by_job`.
pub async fn latest_by_job(executor: impl PgExecutor<'_>) -> Result<Vec<LatestRun>, StoreError> {
    const SQL: &str = "SELECT j.job, r.run_id, r.status, r.trigger, r.started_at, r.finished_at, r.error, \
                c.finished_at AS last_completed_at, \
                EXTRACT(EPOCH FROM now() - c.finished_at)::float8 AS completed_age_seconds \
         FROM unnest($1::text[]) WITH ORDINALITY AS j(job, n) \
         LEFT JOIN LATERAL (SELECT * FROM maintenance_runs AS m WHERE m.job = j.job \
                            ORDER BY m.started_at DESC LIMIT 1) AS r ON true \
         LEFT JOIN LATERAL (SELECT m.finished_at FROM maintenance_runs AS m \
                            WHERE m.job = j.job AND m.status = 'completed' \
                            ORDER BY m.started_at DESC LIMIT 1) AS c ON true \
         ORDER BY j.n";
    Ok(sqlx::query_as(SQL).bind(JOBS).fetch_all(executor).await?)
}

/// One recorded run, with what it found and repaired.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct RunRecord {
    pub run_id: i64,
    pub job: String,
    pub trigger: String,
    pub status: String,
    pub started_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub found: serde_json::Value,
    pub repaired: serde_json::Value,
    pub error: Option<String>,
}

/// The latest runs, newest first, optionally of one job.
pub async fn list(
    executor: impl PgExecutor<'_>,
    job: Option<&str>,
    limit: i64,
) -> Result<Vec<RunRecord>, StoreError> {
    const SQL: &str = "SELECT run_id, job, trigger, status, started_at, finished_at, found, repaired, error \
         FROM maintenance_runs WHERE ($1::text IS NULL OR job = $1) \
         ORDER BY started_at DESC, run_id DESC LIMIT $2";
    Ok(sqlx::query_as(SQL)
        .bind(job)
        .bind(limit.clamp(1, 10_000))
        .fetch_all(executor)
        .await?)
}
