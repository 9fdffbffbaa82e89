//! The sweep behind `pending_without_queue_row` and `processed_without_projection` (issue 26):
//! each anomaly run examines a bounded window of the last day's events instead of the whole
//! day, and keeps each event it finds faulty (`consistency_findings`) until a later run finds
//! it repaired or a day old; the two checks count what is kept.
//!
//! A cycle walks the day newest first: its first window is the newest events, each later one
//! the next older ones after where the previous run stopped (by `first_received_at`, then the
//! key), until a window reaches the day's oldest event and the next run starts again from the
//! newest. So a run reads at most `window_events` events, whatever the day's traffic, and while
//! a day holds fewer events than a window every run examines the whole day, as the checks did
//! before the sweep. Walking against the day's edge, a cycle of the default 50 000 events per
//! five-minute run takes about 86 400 / (50 000 / r + 300) runs at r events a second: 9 hours
//! at 100, 80 minutes at 10. Every event of the day is examined at least once before it leaves
//! the day while a cycle takes at most 12 hours: while the last 12 hours hold at most 144
//! windows (166 events a second on average over them, at the default); above that, part of
//! each day is examined by no cycle.
//!
//! Each run first checks again up to `window_events` kept findings, least recently checked
//! first, and drops those repaired or no longer of the last day, so what the checks count is
//! what was still faulty at most a rotation of the kept findings ago. Reconcile's scan of the
//! whole table is the other layer that sees the same faults (`orphaned_pending`,
//! `missing_effect`).

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};

use super::StoreError;

/// The anomaly checks counted from the sweep's findings.
pub const CHECKS: [&str; 2] = ["pending_without_queue_row", "processed_without_projection"];

/// The findings of the last day still faulty when last checked, for each check.
macro_rules! count_findings {
    ($check:literal) => {
        concat!(
            "SELECT count(*)::float8 FROM consistency_findings WHERE check_name = '",
            $check,
            "' AND first_received_at >= now() - interval '1 day'"
        )
    };
}
pub const COUNT_PENDING_WITHOUT_QUEUE_ROW: &str = count_findings!("pending_without_queue_row");
pub const COUNT_PROCESSED_WITHOUT_PROJECTION: &str =
    count_findings!("processed_without_projection");

/// Each check's fault, over the event row `e` (columns `tenant_id`, `external_id`, `status`,
/// `expects`, `event_type`, `entity_id`, `entity_version`): one text for the window and for
/// checking a finding again.
macro_rules! pending_without_queue_row {
    ($e:literal) => {
        concat!(
            $e,
            ".status = 'pending' AND NOT EXISTS (SELECT 1 FROM event_queue AS q \
             WHERE q.tenant_id = ",
            $e,
            ".tenant_id AND q.external_id = ",
            $e,
            ".external_id)"
        )
    };
}
macro_rules! processed_without_projection {
    ($e:literal) => {
        concat!(
            $e,
            ".status = 'processed' AND ",
            $e,
            ".expects = 'projection' AND NOT EXISTS (SELECT 1 FROM entities AS x \
             WHERE x.tenant_id = ",
            $e,
            ".tenant_id AND x.entity_id = ",
            $e,
            ".entity_id AND x.entity_type = regexp_replace(",
            $e,
            ".event_type, '[./][^./]*$', '') AND x.version >= ",
            $e,
            ".entity_version)"
        )
    };
}

/// What one run examined and found.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Swept {
    /// Kept findings checked again this run, and how many of them were dropped (repaired, or
    /// their event no longer of the last day).
    pub rechecked: i64,
    pub dropped: i64,
    /// Events the window examined.
    pub events: i64,
    /// The oldest and the newest examined event's `first_received_at`.
    pub from: Option<DateTime<Utc>>,
    pub through: Option<DateTime<Utc>>,
    /// This window started a cycle, from the newest event.
    pub new_cycle: bool,
    /// When the current cycle started.
    pub cycle_started_at: DateTime<Utc>,
    /// This window reached the day's oldest event: the next run starts a new cycle.
    pub cycle_ended: bool,
    /// Faulty events in this window (kept, with those found before).
    pub pending_without_queue_row: i64,
    pub processed_without_projection: i64,
}

#[derive(sqlx::FromRow)]
struct State {
    through_at: Option<DateTime<Utc>>,
    through_tenant_id: Option<String>,
    through_external_id: Option<String>,
    cycle_started_at: Option<DateTime<Utc>>,
    reached_present: Option<bool>,
    day_ago: DateTime<Utc>,
    now: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
struct Window {
    events: i64,
    window_from: Option<DateTime<Utc>>,
    window_through: Option<DateTime<Utc>>,
    last_tenant_id: Option<String>,
    last_external_id: Option<String>,
    pending_without_queue_row: i64,
    processed_without_projection: i64,
}

/// Checks up to `window_events` kept findings again, then examines the next window of at most
/// `window_events` events, keeps what it finds faulty, and records where the sweep stands
/// (`consistency_sweep`), in one transaction.
///
/// JIT is off for it: the planner prices the per-event checks of a window (each a subplan)
/// past the JIT's thresholds, and compiling them took 590 ms of a 730 ms window of 44 000
/// events at the 1 M fill, where the statement itself needs about 110 ms.
pub async fn sweep(pool: &PgPool, window_events: i64) -> Result<Swept, StoreError> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL jit = off").execute(&mut *tx).await?;
    let swept = sweep_in(&mut tx, window_events).await?;
    tx.commit().await?;
    Ok(swept)
}

async fn sweep_in(conn: &mut PgConnection, window_events: i64) -> Result<Swept, StoreError> {
    let (rechecked, dropped) = recheck(&mut *conn, window_events).await?;
    // The clock, and where the sweep stands (none before its first run).
    let state: State = sqlx::query_as(
        "SELECT s.through_at, s.through_tenant_id, s.through_external_id, s.cycle_started_at, \
                s.reached_present, now() - interval '1 day' AS day_ago, now() AS now \
         FROM (SELECT 1) AS one LEFT JOIN consistency_sweep AS s ON true",
    )
    .fetch_one(&mut *conn)
    .await?;
    let (day_ago, now) = (state.day_ago, state.now);
    // Where this window starts: before the last examined event, or at the newest for a new
    // cycle (when the last ended, or its cursor left the day).
    let (before_at, before_tenant, before_id, cycle_started_at, new_cycle) = match state {
        State {
            through_at: Some(at),
            through_tenant_id: Some(tenant),
            through_external_id: Some(id),
            cycle_started_at: Some(started),
            reached_present: Some(false),
            ..
        } if at > day_ago => (at, tenant, id, started, false),
        _ => (now, String::new(), String::new(), now, true),
    };
    // The window is a backward range of the time index, ties ordered by the key (an
    // incremental sort of each instant); a new cycle takes every event up to its start.
    const SQL: &str = concat!(
        "WITH w AS MATERIALIZED ( \
             SELECT e.tenant_id, e.external_id, e.first_received_at, \
                    (",
        pending_without_queue_row!("e"),
        ") AS pending_without_queue_row, \
                    (",
        processed_without_projection!("e"),
        ") AS processed_without_projection \
             FROM webhook_events AS e \
             WHERE e.first_received_at <= $1 AND e.first_received_at >= $5 \
               AND ($6 OR e.first_received_at < $1 OR (e.tenant_id, e.external_id) < ($2, $3)) \
             ORDER BY e.first_received_at DESC, e.tenant_id DESC, e.external_id DESC \
             LIMIT $4), \
         found AS ( \
             SELECT 'pending_without_queue_row' AS check_name, tenant_id, external_id, first_received_at \
             FROM w WHERE pending_without_queue_row \
             UNION ALL \
             SELECT 'processed_without_projection', tenant_id, external_id, first_received_at \
             FROM w WHERE processed_without_projection), \
         kept AS ( \
             INSERT INTO consistency_findings (check_name, tenant_id, external_id, first_received_at, found_at, checked_at) \
             SELECT check_name, tenant_id, external_id, first_received_at, now(), now() FROM found \
             ON CONFLICT (check_name, tenant_id, external_id) DO UPDATE SET checked_at = EXCLUDED.checked_at), \
         last AS ( \
             SELECT tenant_id, external_id FROM w \
             ORDER BY first_received_at, tenant_id, external_id LIMIT 1) \
         SELECT (SELECT count(*) FROM w) AS events, \
                (SELECT min(first_received_at) FROM w) AS window_from, \
                (SELECT max(first_received_at) FROM w) AS window_through, \
                last.tenant_id AS last_tenant_id, last.external_id AS last_external_id, \
                (SELECT count(*) FROM w WHERE pending_without_queue_row) AS pending_without_queue_row, \
                (SELECT count(*) FROM w WHERE processed_without_projection) AS processed_without_projection \
         FROM (SELECT 1) AS one LEFT JOIN last ON true"
    );
    let window: Window = sqlx::query_as(SQL)
        .bind(before_at)
        .bind(&before_tenant)
        .bind(&before_id)
        .bind(window_events)
        .bind(day_ago)
        .bind(new_cycle)
        .fetch_one(&mut *conn)
        .await?;
    let cycle_ended = window.events < window_events;
    // An empty window leaves the cursor where it was.
    let through = match (
        window.window_from,
        window.last_tenant_id,
        window.last_external_id,
    ) {
        (Some(at), Some(tenant), Some(id)) => (at, tenant, id),
        _ => (before_at, before_tenant, before_id),
    };
    // The row a previous build reads too: its checks read the window's finds.
    sqlx::query(
        "INSERT INTO consistency_sweep (through_at, through_tenant_id, through_external_id, cycle_started_at, \
             swept_at, window_events, window_from, reached_present, pending_without_queue_row, \
             processed_without_projection) \
         VALUES ($1, $2, $3, $4, now(), $5, $6, $7, $8, $9) \
         ON CONFLICT (singleton) DO UPDATE SET through_at = EXCLUDED.through_at, \
             through_tenant_id = EXCLUDED.through_tenant_id, through_external_id = EXCLUDED.through_external_id, \
             cycle_started_at = EXCLUDED.cycle_started_at, swept_at = EXCLUDED.swept_at, \
             window_events = EXCLUDED.window_events, window_from = EXCLUDED.window_from, \
             reached_present = EXCLUDED.reached_present, \
             pending_without_queue_row = EXCLUDED.pending_without_queue_row, \
             processed_without_projection = EXCLUDED.processed_without_projection",
    )
    .bind(through.0)
    .bind(&through.1)
    .bind(&through.2)
    .bind(cycle_started_at)
    .bind(window.events)
    .bind(window.window_from)
    .bind(cycle_ended)
    .bind(window.pending_without_queue_row)
    .bind(window.processed_without_projection)
    .execute(&mut *conn)
    .await?;
    Ok(Swept {
        rechecked,
        dropped,
        events: window.events,
        from: window.window_from,
        through: window.window_through,
        new_cycle,
        cycle_started_at,
        cycle_ended,
        pending_without_queue_row: window.pending_without_queue_row,
        processed_without_projection: window.processed_without_projection,
    })
}

/// Checks up to `limit` kept findings again, least recently checked first: drops those whose
/// event is repaired, gone or no longer of the last day, and marks the rest checked. Returns
/// (checked, dropped).
async fn recheck(conn: &mut PgConnection, limit: i64) -> Result<(i64, i64), StoreError> {
    const SQL: &str = concat!(
        "WITH batch AS ( \
             SELECT check_name, tenant_id, external_id FROM consistency_findings \
             ORDER BY checked_at LIMIT $1 FOR UPDATE SKIP LOCKED), \
         judged AS ( \
             SELECT b.check_name, b.tenant_id, b.external_id, EXISTS ( \
                 SELECT 1 FROM webhook_events AS e \
                 WHERE e.tenant_id = b.tenant_id AND e.external_id = b.external_id \
                   AND e.first_received_at >= now() - interval '1 day' \
                   AND CASE b.check_name \
                       WHEN 'pending_without_queue_row' THEN ",
        pending_without_queue_row!("e"),
        " \
                       WHEN 'processed_without_projection' THEN ",
        processed_without_projection!("e"),
        " \
                       ELSE false END) AS faulty \
             FROM batch AS b), \
         dropped AS ( \
             DELETE FROM consistency_findings AS f USING judged AS j \
             WHERE f.check_name = j.check_name AND f.tenant_id = j.tenant_id \
               AND f.external_id = j.external_id AND NOT j.faulty RETURNING 1), \
         still AS ( \
             UPDATE consistency_findings AS f SET checked_at = now() FROM judged AS j \
             WHERE f.check_name = j.check_name AND f.tenant_id = j.tenant_id \
               AND f.external_id = j.external_id AND j.faulty RETURNING 1) \
         SELECT (SELECT count(*) FROM judged), (SELECT count(*) FROM dropped)"
    );
    Ok(sqlx::query_as(SQL).bind(limit).fetch_one(conn).await?)
}
