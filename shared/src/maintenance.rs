//! The frame every maintenance job (reconcile, backfill, retention, anomaly) runs in: for
//! reconcile and backfill a session advisory lock so one pass runs at a time, and a `maintenance_runs` row
//! that always ends `completed` or `failed` with the job's counts.
//!
//! A lock never outlives its pass. However the pass ends (an error, a panic, which the Lambda
//! runtime catches while the process lives on, or the pass's future being dropped), the lock is
//! released, or its connection is closed rather than returned to the pool still holding it.
//! A pass that panics is recorded `failed` before the panic continues.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

use sqlx::PgPool;
use sqlx::pool::PoolConnection;

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
    // From here the lock is held: if this future is dropped, the guard closes the connection.
    let mut held = HeldLock(Some(lock_conn));
    let result = CatchUnwind(Box::pin(recorded_catching(pool, job, trigger, work))).await;
    held.release(lock).await;
    let (run_id, counts) = match result {
        Ok(Ok(done)) => done?,
        // The run row is already `failed`; the lock is released; the panic goes on.
        Ok(Err(panic)) | Err(panic) => std::panic::resume_unwind(panic),
    };
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
    match recorded_catching(pool, job, trigger, work).await {
        Ok(done) => done,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

type Panic = Box<dyn Any + Send>;

/// [`recorded`], with a panic of `work` caught after its run row was finished `failed`, and
/// handed back for the caller to continue once it has released what it holds.
async fn recorded_catching<C, W, F>(
    pool: &PgPool,
    job: &str,
    trigger: &str,
    work: W,
) -> Result<Result<(i64, C), StoreError>, Panic>
where
    C: RunCounts,
    W: FnOnce(i64) -> F,
    F: Future<Output = (C, Result<(), StoreError>)>,
{
    let run_id = match maintenance_runs::start(pool, job, trigger).await {
        Ok(run_id) => run_id,
        Err(e) => return Ok(Err(e)),
    };
    let (counts, result) = match CatchUnwind(Box::pin(work(run_id))).await {
        Ok(done) => done,
        Err(panic) => {
            let error = format!("the pass panicked: {}", panic_message(panic.as_ref()));
            tracing::error!(job, run_id, %error, "maintenance pass panicked");
            let none = serde_json::json!({});
            if let Err(e) = maintenance_runs::finish(pool, run_id, &none, &none, Some(&error)).await
            {
                tracing::error!(job, run_id, error = %e, "could not record the panicked run");
            }
            return Err(panic);
        }
    };
    let error = result.as_ref().err().map(ToString::to_string);
    let finished = maintenance_runs::finish(
        pool,
        run_id,
        &counts.found(),
        &counts.repaired(),
        error.as_deref(),
    )
    .await;
    Ok(finished.and(result).map(|()| (run_id, counts)))
}

/// The connection holding a pass's session advisory lock. Released explicitly at the end of the
/// pass; dropped while still held (the pass's future was dropped, or the release failed), its
/// connection is detached from the pool and closed, which ends the session and its locks.
struct HeldLock(Option<PoolConnection<sqlx::Postgres>>);

impl HeldLock {
    async fn release(&mut self, lock: i64) {
        if let Some(mut conn) = self.0.take() {
            match advisory_locks::unlock(&mut conn, lock).await {
                // Back to the pool only when it certainly holds nothing.
                Ok(true) => drop(conn),
                _ => drop(conn.detach()),
            }
        }
    }
}

impl Drop for HeldLock {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            drop(conn.detach());
        }
    }
}

/// Polls `F`, turning a panic into an `Err` carrying it.
struct CatchUnwind<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, Panic>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.0.as_mut();
        match std::panic::catch_unwind(AssertUnwindSafe(move || inner.poll(cx))) {
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// Counts as a JSON document, for [`RunCounts`] implementations.
pub fn json(counts: &impl serde::Serialize) -> serde_json::Value {
    serde_json::to_value(counts).unwrap_or_default()
}
