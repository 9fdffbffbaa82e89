//! The sweep behind `pending_without_queue_row` and `processed_without_projection` (issue 26):
//! each anomaly run examines a bounded window of the last day's events, the next ones after
//! where the previous run stopped (by `first_received_at`, then the key), instead of the whole
//! day. A window that reaches the newest event ends the sweep's cycle; the next run starts again
//! from a day ago. So a run reads at most `window_events` events, whatever the day's traffic,
//! and while a day holds fewer events than a window every run examines the whole day, as the
//! checks did before.
//!
//! The checks report what the latest window found. A cycle that falls more than a day behind
//! starts again from a day ago: at a rate above `window_events` per anomaly interval (50 000
//! per 5 minutes by default: 166 events a second) some events leave the day unexamined by this
//! sweep. Reconcile's scan of the whole table is the other layer that sees the same faults.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use super::StoreError;

/// The anomaly checks that read what the latest window found.
pub const CHECKS: [&str; 2] = ["pending_without_queue_row", "processed_without_projection"];

/// What one run's window examined and found.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Swept {
    /// Events examined.
    pub events: i64,
    /// The first and last examined event's `first_received_at`.
    pub from: Option<DateTime<Utc>>,
    pub through: Option<DateTime<Utc>>,
    /// This window started a cycle, from a day ago.
    pub new_cycle: bool,
    /// When the current cycle started.
    pub cycle_started_at: DateTime<Utc>,
    /// This window reached the newest event: the next run starts a new cycle.
    pub reached_present: bool,
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
    through_at: Option<DateTime<Utc>>,
    through_tenant_id: Option<String>,
    through_external_id: Option<String>,
    pending_without_queue_row: i64,
    processed_without_projection: i64,
}

/// Examines the next window of at most `window_events` events and records where the sweep
/// stands and what the window found (`consistency_sweep`, which the two checks read).
pub async fn sweep(pool: &PgPool, window_events: i64) -> Result<Swept, StoreError> {
    // The clock, and where the sweep stands (none before its first run).
    let state: State = sqlx::query_as(
        "SELECT s.through_at, s.through_tenant_id, s.through_external_id, s.cycle_started_at, \
                s.reached_present, now() - interval '1 day' AS day_ago, now() AS now \
         FROM (SELECT 1) AS one LEFT JOIN consistency_sweep AS s ON true",
    )
    .fetch_one(pool)
    .await?;
    let (day_ago, now) = (state.day_ago, state.now);
    // Where this window starts: after the last examined event, or a day ago for a new cycle.
    let (after_at, after_tenant, after_id, cycle_started_at, new_cycle) = match state {
        State {
            through_at: Some(at),
            through_tenant_id: Some(tenant),
            through_external_id: Some(id),
            cycle_started_at: Some(started),
            reached_present: Some(false),
            ..
        } if at >= day_ago => (at, tenant, id, started, false),
        _ => (day_ago, String::new(), String::new(), now, true),
    };
    // Each check as the whole-day statement had it, over the window's events. The window is
    // a range of the time index (ties ordered by the key, an incremental sort of each instant).
    let window: Window = sqlx::query_as(
        "WITH w AS MATERIALIZED ( \
             SELECT e.tenant_id, e.external_id, e.first_received_at, e.status, e.expects, e.event_type, \
                    e.entity_id, e.entity_version \
             FROM webhook_events AS e \
             WHERE e.first_received_at >= $1 \
               AND (e.first_received_at > $1 OR (e.tenant_id, e.external_id) > ($2, $3)) \
             ORDER BY e.first_received_at, e.tenant_id, e.external_id \
             LIMIT $4), \
         last AS ( \
             SELECT first_received_at, tenant_id, external_id FROM w \
             ORDER BY first_received_at DESC, tenant_id DESC, external_id DESC LIMIT 1) \
         SELECT (SELECT count(*) FROM w) AS events, \
                (SELECT min(first_received_at) FROM w) AS window_from, \
                last.first_received_at AS through_at, last.tenant_id AS through_tenant_id, \
                last.external_id AS through_external_id, \
                (SELECT count(*) FROM w WHERE w.status = 'pending' AND NOT EXISTS \
                    (SELECT 1 FROM event_queue AS q WHERE q.tenant_id = w.tenant_id AND q.external_id = w.external_id) \
                ) AS pending_without_queue_row, \
                (SELECT count(*) FROM w WHERE w.status = 'processed' AND w.expects = 'projection' AND NOT EXISTS \
                    (SELECT 1 FROM entities AS x WHERE x.tenant_id = w.tenant_id AND x.entity_id = w.entity_id \
                       AND x.entity_type = regexp_replace(w.event_type, '[./][^./]*$', '') \
                       AND x.version >= w.entity_version) \
                ) AS processed_without_projection \
         FROM (SELECT 1) AS one LEFT JOIN last ON true",
    )
    .bind(after_at)
    .bind(&after_tenant)
    .bind(&after_id)
    .bind(window_events)
    .fetch_one(pool)
    .await?;
    let reached_present = window.events < window_events;
    // An empty window leaves the cursor where it was.
    let through = (
        window.through_at.unwrap_or(after_at),
        window.through_tenant_id.clone().unwrap_or(after_tenant),
        window.through_external_id.clone().unwrap_or(after_id),
    );
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
    .bind(reached_present)
    .bind(window.pending_without_queue_row)
    .bind(window.processed_without_projection)
    .execute(pool)
    .await?;
    Ok(Swept {
        events: window.events,
        from: window.window_from,
        through: window.through_at,
        new_cycle,
        cycle_started_at,
        reached_present,
        pending_without_queue_row: window.pending_without_queue_row,
        processed_without_projection: window.processed_without_projection,
    })
}
