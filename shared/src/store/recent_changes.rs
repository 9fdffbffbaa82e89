//! The changes of the last day's events, behind `semantic_duplicates_last_day` (issue 26): for
//! each event of the last day that names an entity version, its change (tenant, source, event
//! type, entity, version and tie-break, the key the check groups by, as one row value in
//! text), when it was first received, and when the latest and the one before the latest
//! earlier event of the same change were. Kept by the anomaly pass in the rollup's transaction
//! (`delivery_hours::roll`, which calls this module), so the check counts from a few rows instead of grouping a
//! day of `webhook_events` on every run.
//!
//! A change has two or more events first received in the last day exactly when one of them has
//! its previous event in the day and the one before that outside it (or none): the second of
//! the change's events in the day. So the check counts such rows, from the partial index of
//! the rows that have a previous event at all.
//!
//! A run reads again the events first received since the rollup's margin (15 minutes) before its
//! last run, and their previous events: an event's previous ones are earlier, so reading again
//! from an instant on is complete. It reads from an earlier hour when a writer
//! marked that hour with `rereads_changes`: the buffer's consumer filing an event late, or
//! ingest giving a pending event received over five minutes before another entity version (a
//! conflicting delivery that took the newer payload). It reads the whole day when its last
//! read was not the last anomaly run (its first run, or a previous build ran since).
//!
//! An event's previous events are looked up among the rows kept, which reach a day and the
//! margin back: one received earlier is outside the day for every later run, as if it had none.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::StoreError;

/// Reads the changes of the events first received since `since` again (`None`: since a day and
/// `margin_seconds` ago, as the oldest kept), with their previous events, and forgets the rows
/// older than the day and the margin. Returns the events read. Call it in the rollup's
/// transaction, with the rollup's margin for new events.
pub async fn reread(
    conn: &mut PgConnection,
    since: Option<DateTime<Utc>>,
    margin_seconds: i64,
) -> Result<u64, StoreError> {
    // The oldest instant kept, and where this run reads from (GREATEST ignores a NULL `since`).
    let (kept_from, from): (DateTime<Utc>, DateTime<Utc>) = sqlx::query_as(
        "SELECT k, GREATEST($2::timestamptz, k) \
         FROM (SELECT now() - interval '1 day' - make_interval(secs => $1::int) AS k) AS kept",
    )
    .bind(margin_seconds)
    .bind(since)
    .fetch_one(&mut *conn)
    .await?;
    // The planner cannot see how few rows these ranges hold (the table turns over a day's
    // events a day, its statistics lag): with both ranges in one statement it scanned the
    // table whole (37 ms of 170 000 rows at the 5 M fill, for 70 rows), and its estimates put
    // the statements past the JIT's threshold. Each range is a statement of its own, JIT off
    // for the rest of the rollup's transaction (this runs last in it).
    sqlx::query("SET LOCAL jit = off")
        .execute(&mut *conn)
        .await?;
    for (sql, at) in [
        (
            "DELETE FROM recent_changes WHERE first_received_at < $1",
            kept_from,
        ),
        (
            "DELETE FROM recent_changes WHERE first_received_at >= $1",
            from,
        ),
    ] {
        sqlx::query(sql).bind(at).execute(&mut *conn).await?;
    }
    let read = sqlx::query(
        "INSERT INTO recent_changes (tenant_id, external_id, change, first_received_at) \
         SELECT e.tenant_id, e.external_id, \
                ROW(e.tenant_id, e.source_id, e.event_type, e.entity_id, e.entity_version, e.version_tiebreak)::text, \
                e.first_received_at \
         FROM webhook_events AS e \
         WHERE e.first_received_at >= $1 AND e.entity_id IS NOT NULL AND e.entity_version IS NOT NULL \
         ON CONFLICT (tenant_id, external_id) DO UPDATE \
         SET change = EXCLUDED.change, first_received_at = EXCLUDED.first_received_at, \
             previous_at = NULL, before_previous_at = NULL",
    )
    .bind(from)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    // Each event's two previous ones, by (first receipt, external id), from the change's index.
    sqlx::query(
        "UPDATE recent_changes AS r SET (previous_at, before_previous_at) = ( \
             SELECT p.at[1], p.at[2] FROM ( \
                 SELECT array_agg(m.first_received_at ORDER BY m.first_received_at DESC, m.external_id DESC) AS at \
                 FROM (SELECT m.first_received_at, m.external_id FROM recent_changes AS m \
                       WHERE m.change = r.change AND m.first_received_at <= r.first_received_at \
                         AND (m.first_received_at, m.external_id) < (r.first_received_at, r.external_id) \
                       ORDER BY m.first_received_at DESC, m.external_id DESC LIMIT 2) AS m) AS p) \
         WHERE r.first_received_at >= $1",
    )
    .bind(from)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO recent_changes_state (singleton, read_at) VALUES (true, now()) \
         ON CONFLICT (singleton) DO UPDATE SET read_at = EXCLUDED.read_at",
    )
    .execute(&mut *conn)
    .await?;
    Ok(read)
}

/// When to read the changes again from, on this run: `margin_seconds` before the
/// last read, if it was the last run of the anomaly pass of any build (whose every run records
/// its refresh of `delivery_hourly`, the rollup's under that name; else `None`: the whole day),
/// or the earliest hour marked `rereads_changes` if earlier.
pub async fn since(
    conn: &mut PgConnection,
    earliest_mark: Option<DateTime<Utc>>,
    margin_seconds: i64,
) -> Result<Option<DateTime<Utc>>, StoreError> {
    let last: Option<DateTime<Utc>> = sqlx::query_scalar(
        "SELECT r.read_at - make_interval(secs => $1::int) FROM recent_changes_state AS r \
         WHERE r.read_at = (SELECT refreshed_at FROM view_refreshes WHERE view_name = 'delivery_hourly')",
    )
    .bind(margin_seconds)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(last.map(|last| earliest_mark.map_or(last, |mark| mark.min(last))))
}
