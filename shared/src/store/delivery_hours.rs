//! The hourly delivery figures behind the anomaly checks (issue 26), per source and hour of
//! first receipt: events, redeliveries, conflicts, backfilled, retried and provider retries,
//! the figures the materialized view `delivery_hourly` has. Kept by the anomaly pass
//! ([`roll`]) instead of re-aggregating 29 days on every run: each run computes again only the
//! hours whose figures changed since it computed them, so a run reads what changed since the
//! last one, not a day of traffic and not the history kept.
//!
//! An hour is computed again when, and only when:
//!
//! - it has events received since [`NEW_EVENTS_MARGIN_SECONDS`] before its last computation (new
//!   events, found on the `first_received_at` index). The margin covers a delivery whose
//!   statement began before the computation and committed after it: its receipt time is its
//!   statement's `now()`, before the computation, yet the computation did not see it.
//! - a writer marked it in `delivery_hours_dirty`, in the transaction of its change: a change
//!   to an event received more than [`MARK_AFTER_SECONDS`] before the writer's statement (earlier ones
//!   are within the margin above). Who marks:
//!   - ingest's statement (both paths), when a delivery repeats a stored event (`delivery_count`,
//!     `conflict_count`, `provider_retries`, and when it takes the payload `verified_with`);
//!   - the buffer's consumer, when it files a delivery with its received time ([`mark_late`]);
//!   - the drain's retries and dead-lettering, and a dead letter's replay, when they take an
//!     event's `attempts` to 2 (the rollup counts `attempts > 1` as retried);
//!   - retention, when it deletes events the rollup still keeps.
//! - an event of that hour waits in the queue to be tried again (the queue row's `ready_at`
//!   was moved past its `enqueued_at` by a retry): its completion will take `attempts` to 2 in
//!   the drain's `complete`, which does not mark. Each run marks the hours of such events for
//!   the next run, so their completion is counted at the latest one run after it.
//! - it was never computed: after deploy, a rollback to a previous build (below), or a run
//!   missed for over 29 days.
//!
//! So [`MARK_AFTER_SECONDS`] plus the longest a writer's transaction runs must stay under
//! [`NEW_EVENTS_MARGIN_SECONDS`]: the functions' statement and idle-in-transaction timeouts keep a
//! transaction to minutes.
//!
//! The first runs after deploy find the rollup empty. Each run computes the hours the checks
//! read this run (the last day, and the four past weeks' same hours that source flow compares
//! with), so every check reads complete figures from the first run; the other hours of the 29
//! days are filled [`FILL_HOURS_PER_RUN`] a run, newest first. A previous build rolled back to
//! refreshes `delivery_hourly` and neither marks nor keeps the rollup: the run after it sees
//! the refresh time it did not write and forgets every hour, which are filled again the same
//! way. Hours older than 29 days are deleted.

use sqlx::{PgExecutor, PgPool};

use super::StoreError;

/// The rollup keeps this many days, as `delivery_hourly` did.
pub const DAYS: i64 = 29;
/// Hours of the 29 days that are neither of the last day nor compared with this run computed
/// per run while they are missing (after deploy, a rollback or an outage): a day a run.
pub const FILL_HOURS_PER_RUN: i64 = 24;
/// An hour is computed again when it has events received since this long before its last
/// computation (in seconds): a delivery whose statement began up to this long before a
/// computation and committed after it is still counted.
pub const NEW_EVENTS_MARGIN_SECONDS: i64 = 15 * 60;
/// A writer that changes an event received more than this long before its statement (in
/// seconds) marks the event's hour; a change to a younger event is found by
/// [`NEW_EVENTS_MARGIN_SECONDS`]. Written into ingest's statements as `interval '5 minutes'`
/// (`tests/delivery_hours.rs` holds the two together).
pub const MARK_AFTER_SECONDS: i64 = 5 * 60;
/// Transaction-level advisory lock: one run at a time changes the rollup.
const LOCK_KEY: i64 = 2_646_413_290_551_842_119;

/// What one run did to the rollup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Rolled {
    /// Hours computed from `webhook_events`: those with new events, marked, or never computed.
    pub hours: u64,
    /// Marks taken (repeated or late deliveries, retries, purged events, events waiting for a
    /// retry), each making its hour computed again.
    pub marks: u64,
    /// Hours forgotten because a previous build ran since this one last did.
    pub forgotten: u64,
    /// Hours still missing from the 29 days after this run.
    pub missing: u64,
    /// Events whose change was read again for `semantic_duplicates_last_day`
    /// ([`super::recent_changes`]): those received since the last run, or since a marked hour.
    pub changes: u64,
}

/// Brings the rollup up to date, and with it the last day's changes
/// ([`super::recent_changes`]), in one transaction (readers see the previous state until it
/// commits), and records it as `delivery_hourly`'s refresh in `view_refreshes`.
pub async fn roll(pool: &PgPool) -> Result<Rolled, StoreError> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(LOCK_KEY)
        .execute(&mut *tx)
        .await?;

    // A previous build refreshed delivery_hourly since this build's last run (or this is the
    // first run after deploy): its writers changed hours without marking them.
    let forgotten = sqlx::query(
        "DELETE FROM delivery_hours_computed \
         WHERE (SELECT rolled_at FROM delivery_hours_state) IS DISTINCT FROM \
               (SELECT refreshed_at FROM view_refreshes WHERE view_name = 'delivery_hourly')",
    )
    .execute(&mut *tx)
    .await?
    .rows_affected();

    let (marks, rereads_from): (i64, Option<chrono::DateTime<chrono::Utc>>) = sqlx::query_as(
        "WITH taken AS (DELETE FROM delivery_hours_dirty RETURNING hour, rereads_changes), \
              unfinal AS (DELETE FROM delivery_hours_computed AS c \
                          USING (SELECT DISTINCT hour FROM taken) AS t WHERE c.hour = t.hour) \
         SELECT count(*), min(hour) FILTER (WHERE rereads_changes) FROM taken",
    )
    .fetch_one(&mut *tx)
    .await?;
    let changes_since =
        super::recent_changes::since(&mut tx, rereads_from, NEW_EVENTS_MARGIN_SECONDS).await?;

    // Events waiting to be tried again: their completion takes `attempts` to 2 without a mark,
    // so their hours are marked for the next run, as long as they wait. The queue row of an
    // event a retry moved has `ready_at` past `enqueued_at` (ingest and reconcile enqueue with
    // both at `now()`); each such row's event is looked up by its key.
    sqlx::query(
        "INSERT INTO delivery_hours_dirty (source_id, hour) \
         SELECT DISTINCT e.source_id, date_trunc('hour', e.first_received_at) \
         FROM event_queue AS q \
         CROSS JOIN LATERAL (SELECT e.source_id, e.first_received_at FROM webhook_events AS e \
             WHERE e.tenant_id = q.tenant_id AND e.external_id = q.external_id LIMIT 1) AS e \
         WHERE q.ready_at > q.enqueued_at \
           AND e.first_received_at >= date_trunc('hour', now() - make_interval(days => $1::int))",
    )
    .bind(DAYS)
    .execute(&mut *tx)
    .await?;

    for sql in [
        "DELETE FROM delivery_hours WHERE hour < date_trunc('hour', now() - make_interval(days => $1::int))",
        "DELETE FROM delivery_hours_computed WHERE hour < date_trunc('hour', now() - make_interval(days => $1::int))",
    ] {
        sqlx::query(sql).bind(DAYS).execute(&mut *tx).await?;
    }

    // Hours never computed (or forgotten) that the checks read this run: the last day's, and
    // the hours source flow compares the last complete one with (and the next ones, should the
    // hour turn before it reads them); every hour with events received since the margin
    // before its computation; and up to FILL_HOURS_PER_RUN other hours never computed, newest
    // first. Marked hours were forgotten above. An hour computed long enough after it ended
    // has no such events: its range of the index is empty, and not read.
    let (hours, missing): (Vec<chrono::DateTime<chrono::Utc>>, i64) = sqlx::query_as(
        "WITH hours AS ( \
             SELECT h, c.computed_at IS NOT NULL AS computed, \
                    h >= date_trunc('hour', now() - interval '1 day') \
                    OR h IN (SELECT date_trunc('hour', now()) - make_interval(hours => k) - make_interval(weeks => w) \
                             FROM generate_series(1, 4) AS w, generate_series(0, 1) AS k) AS read_now, \
                    CASE WHEN c.computed_at - make_interval(secs => $3::int) < h + interval '1 hour' \
                         THEN EXISTS (SELECT 1 FROM webhook_events AS e \
                                      WHERE e.first_received_at >= greatest(h, c.computed_at - make_interval(secs => $3::int)) \
                                        AND e.first_received_at < h + interval '1 hour') \
                         ELSE false END AS new_events \
             FROM generate_series(date_trunc('hour', now() - make_interval(days => $1::int)), \
                                  date_trunc('hour', now()), interval '1 hour') AS h \
             LEFT JOIN delivery_hours_computed AS c ON c.hour = h), \
         chosen AS ( \
             SELECT h FROM hours WHERE (NOT computed AND read_now) OR new_events \
             UNION ALL \
             (SELECT h FROM hours WHERE NOT computed AND NOT read_now ORDER BY h DESC LIMIT $2)) \
         SELECT COALESCE((SELECT array_agg(h ORDER BY h) FROM chosen), '{}'), \
                (SELECT count(*) FROM hours WHERE NOT computed AND h NOT IN (SELECT h FROM chosen))",
    )
    .bind(DAYS)
    .bind(FILL_HOURS_PER_RUN)
    .bind(NEW_EVENTS_MARGIN_SECONDS)
    .fetch_one(&mut *tx)
    .await?;

    // Whatever lies within the hours computed goes: rows off the hour too (a clock moved by
    // part of an hour, as the drill's does, moves them there), which would be counted twice.
    for sql in [
        "DELETE FROM delivery_hours AS d USING unnest($1::timestamptz[]) AS h(hour) \
         WHERE d.hour >= h.hour AND d.hour < h.hour + interval '1 hour'",
        "DELETE FROM delivery_hours_computed AS d USING unnest($1::timestamptz[]) AS h(hour) \
         WHERE d.hour >= h.hour AND d.hour < h.hour + interval '1 hour'",
    ] {
        sqlx::query(sql).bind(&hours).execute(&mut *tx).await?;
    }
    // One range of the first_received_at index per hour, each aggregated on its own (LATERAL):
    // as a plain join, the planner costed a table larger than effective_cache_size (20 M rows,
    // 23 GB) as cheaper to scan whole than to read an hour's range per element of the array,
    // whose length it cannot see (tests/scale_plans.rs). Each hour is recorded computed at this
    // statement's start, in the same statement: `hookctl status` counts an hour's events from
    // that instant on from webhook_events ([`super::webhook_events::activity_by_source`]), and
    // every event received before it and committed by then is in the figures.
    sqlx::query(
        "WITH figures AS ( \
             INSERT INTO delivery_hours (source_id, hour, events, redeliveries, conflicts, backfilled, \
                 retried, provider_retries) \
             SELECT a.source_id, h.hour, a.events, a.redeliveries, a.conflicts, a.backfilled, \
                    a.retried, a.provider_retries \
             FROM unnest($1::timestamptz[]) AS h(hour) \
             CROSS JOIN LATERAL ( \
                 SELECT e.source_id, count(*) AS events, sum(e.delivery_count - 1) AS redeliveries, \
                        sum(e.conflict_count) AS conflicts, \
                        count(*) FILTER (WHERE e.verified_with = 'provider_api') AS backfilled, \
                        count(*) FILTER (WHERE e.attempts > 1) AS retried, \
                        sum(e.provider_retries) AS provider_retries \
                 FROM webhook_events AS e \
                 WHERE e.first_received_at >= h.hour AND e.first_received_at < h.hour + interval '1 hour' \
                 GROUP BY e.source_id) AS a \
             RETURNING 1) \
         INSERT INTO delivery_hours_computed (hour, computed_at) \
         SELECT h, statement_timestamp() FROM unnest($1::timestamptz[]) AS h",
    )
    .bind(&hours)
    .execute(&mut *tx)
    .await?;

    // The same instant in both: a refresh time that differs is a previous build's.
    sqlx::query(
        "INSERT INTO view_refreshes (view_name, refreshed_at) VALUES ('delivery_hourly', now()) \
         ON CONFLICT (view_name) DO UPDATE SET refreshed_at = EXCLUDED.refreshed_at",
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO delivery_hours_state (singleton, rolled_at) VALUES (true, now()) \
         ON CONFLICT (singleton) DO UPDATE SET rolled_at = EXCLUDED.rolled_at",
    )
    .execute(&mut *tx)
    .await?;
    let changes =
        super::recent_changes::reread(&mut tx, changes_since, NEW_EVENTS_MARGIN_SECONDS).await?;
    tx.commit().await?;
    Ok(Rolled {
        hours: hours.len() as u64,
        marks: marks as u64,
        forgotten,
        missing: missing as u64,
        changes,
    })
}

/// Marks the hours of deliveries stored late: received (`received_at`) more than
/// [`MARK_AFTER_SECONDS`] before this statement, when their hour may already be computed for
/// good. Call it in the transaction that stores them, so the mark is seen exactly when the
/// events are. Younger deliveries, and those older than the rollup's days, mark nothing.
pub async fn mark_late(
    executor: impl PgExecutor<'_>,
    deliveries: &[(&str, chrono::DateTime<chrono::Utc>)],
) -> Result<u64, StoreError> {
    let (sources, received): (Vec<&str>, Vec<chrono::DateTime<chrono::Utc>>) =
        deliveries.iter().copied().unzip();
    Ok(sqlx::query(
        "INSERT INTO delivery_hours_dirty (source_id, hour, rereads_changes) \
         SELECT h.source_id, h.hour, true FROM ( \
             SELECT DISTINCT m.source_id, date_trunc('hour', m.received_at) AS hour \
             FROM unnest($1::text[], $2::timestamptz[]) AS m(source_id, received_at) \
             WHERE m.received_at < now() - make_interval(secs => $4::int) \
               AND m.received_at >= date_trunc('hour', now() - make_interval(days => $3::int))) AS h \
         WHERE NOT EXISTS (SELECT 1 FROM delivery_hours_dirty AS d \
                           WHERE d.source_id = h.source_id AND d.hour = h.hour AND d.rereads_changes)",
    )
    .bind(sources)
    .bind(received)
    .bind(DAYS)
    .bind(MARK_AFTER_SECONDS)
    .execute(executor)
    .await?
    .rows_affected())
}

/// Whether [`mark_late`] can mark anything for a delivery received at `received_at`, judged by
/// this process's clock with a margin of half [`MARK_AFTER_SECONDS`] (the statement judges by
/// the database's).
pub fn may_be_late(received_at: chrono::DateTime<chrono::Utc>) -> bool {
    received_at < chrono::Utc::now() - chrono::TimeDelta::seconds(MARK_AFTER_SECONDS / 2)
}

/// One source's events first received in one hour, and the mean of the same hour one to four
/// weeks before (the hours the rollup holds of them; `None` when it holds none).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct SourceHour {
    pub source_id: String,
    pub hour: chrono::DateTime<chrono::Utc>,
    pub events: i64,
    pub usual: Option<f64>,
}

/// Every source's last `hours` hours (the current one included) against the same hours of the
/// four weeks before, as the rollup holds them: figures as fresh as the last anomaly run. Reads
/// by the rollup's key, five hours a source and hour.
pub async fn recent_against_past_weeks(
    executor: impl PgExecutor<'_>,
    hours: i64,
) -> Result<Vec<SourceHour>, StoreError> {
    const SQL: &str = "WITH hours AS (SELECT generate_series(date_trunc('hour', now()) - make_interval(hours => $1 - 1), \
                 date_trunc('hour', now()), interval '1 hour') AS hour) \
         SELECT s.source_id, h.hour, \
             coalesce((SELECT d.events FROM delivery_hours AS d \
                       WHERE d.source_id = s.source_id AND d.hour = h.hour), 0)::bigint AS events, \
             (SELECT avg(d.events)::float8 FROM delivery_hours AS d \
              WHERE d.source_id = s.source_id AND d.hour = ANY(ARRAY[h.hour - interval '7 days', \
                  h.hour - interval '14 days', h.hour - interval '21 days', h.hour - interval '28 days'])) AS usual \
         FROM sources AS s CROSS JOIN hours AS h \
         ORDER BY s.source_id, h.hour";
    Ok(sqlx::query_as(SQL)
        .bind(hours.clamp(1, 24 * 7) as i32)
        .fetch_all(executor)
        .await?)
}
