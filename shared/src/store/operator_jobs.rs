//! The `operator_jobs` table: an operator's action over a whole filter of dead letters (replay
//! or discard them all), run in steps that resume at a cursor, with its estimate, progress and
//! an abort seen between steps.

use sqlx::PgExecutor;

use super::StoreError;

/// A job as stored.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct Job {
    pub job_id: i64,
    /// `replay_dead_letters` or `discard_dead_letters`.
    pub kind: String,
    pub filter: serde_json::Value,
    pub actor: String,
    pub reason: String,
    pub action_id: i64,
    /// Open letters matching the filter when it started.
    pub estimate: i64,
    pub done: i64,
    pub failed: i64,
    pub skipped: i64,
    /// Letters up to this id were taken.
    pub after_id: i64,
    /// `running`, `finished` or `aborted`.
    pub status: String,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub updated_at: chrono::DateTime<chrono::Utc>,
    pub finished_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// A job's columns, as [`Job`] reads them.
macro_rules! job_columns {
    () => {
        "job_id, kind, filter, actor, reason, action_id, estimate, done, failed, skipped, \
         after_id, status, created_at, updated_at, finished_at"
    };
}

/// A new running job.
pub struct NewJob<'a> {
    pub kind: &'a str,
    pub filter: &'a serde_json::Value,
    pub actor: &'a str,
    pub reason: &'a str,
    pub action_id: i64,
    pub estimate: i64,
}

pub async fn create(executor: impl PgExecutor<'_>, job: &NewJob<'_>) -> Result<Job, StoreError> {
    const SQL: &str = concat!(
        "INSERT INTO operator_jobs (kind, filter, actor, reason, action_id, estimate) \
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING ",
        job_columns!()
    );
    Ok(sqlx::query_as(SQL)
        .bind(job.kind)
        .bind(job.filter)
        .bind(job.actor)
        .bind(job.reason)
        .bind(job.action_id)
        .bind(job.estimate)
        .fetch_one(executor)
        .await?)
}

pub async fn get(executor: impl PgExecutor<'_>, job_id: i64) -> Result<Option<Job>, StoreError> {
    const SQL: &str = concat!(
        "SELECT ",
        job_columns!(),
        " FROM operator_jobs WHERE job_id = $1"
    );
    Ok(sqlx::query_as(SQL)
        .bind(job_id)
        .fetch_optional(executor)
        .await?)
}

/// The newest jobs first.
pub async fn list(executor: impl PgExecutor<'_>, limit: i64) -> Result<Vec<Job>, StoreError> {
    const SQL: &str = concat!(
        "SELECT ",
        job_columns!(),
        " FROM operator_jobs ORDER BY job_id DESC LIMIT $1"
    );
    Ok(sqlx::query_as(SQL).bind(limit).fetch_all(executor).await?)
}

/// Adds one step's counts and moves the cursor (also of a job aborted during the step: the
/// step's letters were acted on); the job as it stands after.
pub async fn advance(
    executor: impl PgExecutor<'_>,
    job_id: i64,
    done: i64,
    failed: i64,
    skipped: i64,
    after_id: i64,
) -> Result<Option<Job>, StoreError> {
    const SQL: &str = concat!(
        "UPDATE operator_jobs SET done = done + $2, failed = failed + $3, skipped = skipped + $4, \
             after_id = greatest(after_id, $5), updated_at = now() \
         WHERE job_id = $1 RETURNING ",
        job_columns!()
    );
    Ok(sqlx::query_as(SQL)
        .bind(job_id)
        .bind(done)
        .bind(failed)
        .bind(skipped)
        .bind(after_id)
        .fetch_optional(executor)
        .await?)
}

/// Ends a running job as `finished` or `aborted`; `None` when it was not running.
pub async fn end(
    executor: impl PgExecutor<'_>,
    job_id: i64,
    status: &str,
) -> Result<Option<Job>, StoreError> {
    const SQL: &str = concat!(
        "UPDATE operator_jobs SET status = $2, finished_at = now(), updated_at = now() \
         WHERE job_id = $1 AND status = 'running' RETURNING ",
        job_columns!()
    );
    Ok(sqlx::query_as(SQL)
        .bind(job_id)
        .bind(status)
        .fetch_optional(executor)
        .await?)
}
