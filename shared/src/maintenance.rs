//! The frame every maintenance job (reconcile, backfill, retention, anomaly) runs in: for
//! reconcile and backfill a session advisory lock so one pass runs at a time, and a `maintenance_runs` row
//! that always ends `completed` or `failed` with the job's counts. However the work ends, the
//! lock is released, or its connection is closed rather than returned to the pool holding it.

use std::future::Future;

use sqlx::PgPool;

use crate::store::{StoreError, advisory_locks, maintenance_runs};

/// A job's counts as its run row stores them.
pub trait RunCounts {
    /// What the pass found (`maintenance_runs.found`).
    fn found(&self) -> serde_json::Value;
    /// What it repaired or removed (`maintenance_runs.repaired`).
    fn repaired(&self) -> serde_json::Value;
}

/// How a run went when the bookkeeping itself succeeded.
#[derive(Debug)]
pub enum Run<C> {
    /// Another pass held the lock; a `skipped` row was recorded.
    Skipped {
        run_id: i64,
    },
    Completed {
        run_id: i64,
        counts: C,
    },
}

/// Runs `work` as one recorded run of `job` under the advisory lock `lock`: a pass that finds
/// the lock held records `skipped` and returns at once. `work` gets the run's id and returns
/// its counts beside its result, so a failed pass still records what it had done.
pub async fn locked<C, W, F>(
    pool: &PgPool,
    job: &str,
    trigger: &str,
    lock: i64,
    work: W,
) -> Result<Run<C>, StoreError>
where
    C: RunCounts,
    W: FnOnce(i64) -> F,
    F: Future<Output = (C, Result<(), StoreError>)>,
{
    let mut lock_conn = pool.acquire().await?;
    if !advisory_locks::try_lock(&mut lock_conn, lock).await? {
        let run_id = maintenance_runs::skipped(pool, job, trigger).await?;
        tracing::info!(job, run_id, "another pass holds the lock: skipped");
        return Ok(Run::Skipped { run_id });
    }
    let result = recorded(pool, job, trigger, work).await;
    if advisory_locks::unlock(&mut lock_conn, lock).await.is_err() {
        // Never return a connection that may still hold the lock to the pool.
        drop(lock_conn.detach());
    }
    let (run_id, counts) = result?;
    Ok(Run::Completed { run_id, counts })
}

/// Runs `work` as one recorded run of `job`, with no lock (for passes that may overlap), and
/// returns the run's id and counts.
pub async fn recorded<C, W, F>(
    pool: &PgPool,
    job: &str,
    trigger: &str,
    work: W,
) -> Result<(i64, C), StoreError>
where
    C: RunCounts,
    W: FnOnce(i64) -> F,
    F: Future<Output = (C, Result<(), StoreError>)>,
{
    let run_id = maintenance_runs::start(pool, job, trigger).await?;
    let (counts, result) = work(run_id).await;
    let error = result.as_ref().err().map(ToString::to_string);
    maintenance_runs::finish(
        pool,
        run_id,
        &counts.found(),
        &counts.repaired(),
        error.as_deref(),
    )
    .await?;
    result?;
    Ok((run_id, counts))
}

/// Counts as a JSON document, for [`RunCounts`] implementations.
pub fn json(counts: &impl serde::Serialize) -> serde_json::Value {
    serde_json::to_value(counts).unwrap_or_default()
}
