//! `processing_completions`: the received → processed seconds of the events each completing
//! statement marked processed, one row per statement, behind the anomaly pass's
//! `processing_latency` view (issue 26). Written by the drain's completion
//! ([`super::event_queue::complete`]) and a dead letter's replay
//! ([`super::dead_letters::mark_replayed`]) through [`record_latencies`], forgotten after
//! [`KEPT_SECONDS`] by the anomaly run and by retention ([`forget_old`]).

use sqlx::PgExecutor;

use super::StoreError;

/// The CTE body that records the latencies of `$processed`, a CTE of the same statement
/// returning each processed event's `first_received_at` and `seconds`: one row, for the events
/// first received in the last day (a replay of an older dead letter is not pipeline latency;
/// the view never counted it). One text for both writers.
macro_rules! record_latencies {
    ($processed:literal) => {
        concat!(
            "INSERT INTO processing_completions (completed_at, seconds) \
             SELECT statement_timestamp(), array_agg(seconds) FROM ",
            $processed,
            " WHERE first_received_at >= statement_timestamp() - interval '1 day' HAVING count(*) > 0"
        )
    };
}
pub(crate) use record_latencies;

/// How long the recorded latencies are kept: the view reads the last hour's, and a second hour
/// leaves the rows a late refresh may still need.
pub const KEPT_SECONDS: f64 = 2.0 * 3600.0;

/// The most rows the anomaly pass forgets in one run: an hour of batches at 10 000 events/s,
/// so that a pass after days without one does not spend its run here (retention forgets the
/// rest, [`forget_old`] in its own batches).
pub const ANOMALY_RUN_FORGETS_AT_MOST: i64 = 360_000;

/// Deletes at most `limit` of the rows older than [`KEPT_SECONDS`], the oldest first, a range
/// of the time index; returns how many. Both the anomaly pass (before its refresh) and
/// retention (so that the table's size does not depend on the anomaly schedule) call it.
pub async fn forget_old(executor: impl PgExecutor<'_>, limit: i64) -> Result<u64, StoreError> {
    Ok(sqlx::query(
        "DELETE FROM processing_completions WHERE ctid = ANY(ARRAY( \
             SELECT ctid FROM processing_completions \
             WHERE completed_at < now() - make_interval(secs => $1) \
             ORDER BY completed_at LIMIT $2))",
    )
    .bind(KEPT_SECONDS)
    .bind(limit)
    .execute(executor)
    .await?
    .rows_affected())
}
