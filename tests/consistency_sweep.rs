//! `pending_without_queue_row` and `processed_without_projection` counted by a sweep of the
//! last day's events, a bounded window per anomaly run (`shared::store::consistency_sweep`,
//! issue 26), instead of over the whole day on every run: a cycle of windows examines each
//! event of the day once, ties of one instant included, and finds what the whole-day
//! statements found; a window as large as the day finds it in one run, as before; the checks
//! say what their window covered; a sweep that fell a day behind starts again from a day ago.

use pipeline_tests::drain::*;
use pipeline_tests::*;
use shared::anomaly::{self, AnomalySettings};
use shared::store::consistency_sweep::{self, Swept};
use sqlx::PgPool;

/// What the two checks counted before issue 26, over the whole last day.
const WHOLE_DAY: &str = "SELECT \
     (SELECT count(*) FROM webhook_events AS e WHERE e.first_received_at > now() - interval '1 day' \
        AND e.status = 'pending' AND NOT EXISTS \
        (SELECT 1 FROM event_queue AS q WHERE q.tenant_id = e.tenant_id AND q.external_id = e.external_id)), \
     (SELECT count(*) FROM webhook_events AS e WHERE e.first_received_at > now() - interval '1 day' \
        AND e.status = 'processed' AND e.expects = 'projection' AND NOT EXISTS \
        (SELECT 1 FROM entities AS x WHERE x.tenant_id = e.tenant_id AND x.entity_id = e.entity_id \
           AND x.entity_type = regexp_replace(e.event_type, '[./][^./]*$', '') AND x.version >= e.entity_version))";

/// Forty events 5 to 30 hours old, 45 minutes apart (`bulk-7` the newest), but the seven
/// newest received at one instant (`bulk-1` to `bulk-7`): 32 in the last day, the nearest
/// outside it and the furthest inside 22 minutes from its edge. Faults in and out of the day:
/// `bulk-3`, `bulk-20`, `bulk-30` and `bulk-35` pending without their queue rows; `bulk-10`,
/// `bulk-25` and `bulk-38` processed without their projections; `bulk-12` processed with its
/// own.
async fn a_day_with_faults(pool: &PgPool) {
    let _app = app(pool.clone()).await;
    bulk_events(pool, 40).await;
    for sql in [
        "UPDATE webhook_events SET first_received_at = now() - make_interval(mins => \
             45 * GREATEST(substr(external_id, 6)::int, 7) - 22)",
        "DELETE FROM event_queue WHERE external_id IN ('bulk-3', 'bulk-20', 'bulk-30', 'bulk-35')",
        "WITH p AS (UPDATE webhook_events SET status = 'processed', processed_at = now(), expects = 'projection' \
             WHERE external_id IN ('bulk-10', 'bulk-25', 'bulk-38', 'bulk-12') RETURNING tenant_id, external_id) \
         DELETE FROM event_queue AS q USING p WHERE q.tenant_id = p.tenant_id AND q.external_id = p.external_id",
        "INSERT INTO entities (tenant_id, entity_type, entity_id, version, state, last_event_id) \
         VALUES ('acme', 'item', 'item-12', 1, '{}'::jsonb, 'bulk-12')",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
}

async fn whole_day(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as(WHOLE_DAY).fetch_one(pool).await.unwrap()
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_cycle_of_windows_examines_each_event_of_the_day_once_and_finds_what_the_day_held(
    pool: PgPool,
) {
    a_day_with_faults(&pool).await;
    assert_eq!(TENANT, "acme", "the fixture's entity is the tenant's");
    let in_day = scalar(
        &pool,
        "SELECT count(*) FROM webhook_events WHERE first_received_at > now() - interval '1 day'",
    )
    .await;
    assert_eq!(in_day, 32);
    assert_eq!(whole_day(&pool).await, (3, 2));

    // Windows of 5: the 25 distinct instants in 5 windows, then the 7 events of one instant
    // in a window of 5 and one of 2, which reaches the newest event.
    let mut windows: Vec<Swept> = Vec::new();
    loop {
        let swept = consistency_sweep::sweep(&pool, 5).await.unwrap();
        assert!(swept.events <= 5, "{swept:?}");
        let done = swept.reached_present;
        windows.push(swept);
        if done || windows.len() > 20 {
            break;
        }
    }
    let sizes: Vec<i64> = windows.iter().map(|w| w.events).collect();
    assert_eq!(sizes, [5, 5, 5, 5, 5, 5, 2], "{windows:#?}");
    assert!(windows[0].new_cycle && windows[1..].iter().all(|w| !w.new_cycle));
    assert!(
        windows
            .windows(2)
            .all(|p| p[0].through <= p[1].from && p[0].cycle_started_at == p[1].cycle_started_at),
        "each window after the last: {windows:#?}"
    );
    let found = windows.iter().fold((0, 0), |(p, x), w| {
        (
            p + w.pending_without_queue_row,
            x + w.processed_without_projection,
        )
    });
    assert_eq!(found, (3, 2), "the cycle found what the whole day held");

    // The next run starts a new cycle from a day ago.
    let next = consistency_sweep::sweep(&pool, 5).await.unwrap();
    assert!(next.new_cycle && next.events == 5, "{next:?}");
    assert!(next.cycle_started_at > windows[0].cycle_started_at);

    // A sweep that fell more than a day behind starts again from a day ago too: nothing
    // older than the day is examined.
    sqlx::query("UPDATE consistency_sweep SET through_at = now() - interval '25 hours'")
        .execute(&pool)
        .await
        .unwrap();
    let behind = consistency_sweep::sweep(&pool, 5).await.unwrap();
    assert!(behind.new_cycle, "{behind:?}");
    let oldest_in_day: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "SELECT min(first_received_at) FROM webhook_events WHERE first_received_at > now() - interval '1 day'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(behind.from, Some(oldest_in_day));
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_checks_report_their_window_and_a_window_as_large_as_the_day_finds_it_all_in_one_run(
    pool: PgPool,
) {
    a_day_with_faults(&pool).await;
    let value = |run_id: i64, check: &'static str| {
        let pool = pool.clone();
        async move {
            let row: (Option<f64>, String) = sqlx::query_as(
                "SELECT value, detail FROM anomaly_results WHERE run_id = $1 AND check_name = $2",
            )
            .bind(run_id)
            .bind(check)
            .fetch_one(&pool)
            .await
            .unwrap();
            row
        }
    };

    // The default window holds the day: one run finds both faults, as the whole-day
    // statements did, and says so.
    let report = anomaly::run_once(&pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();
    for check in ["pending_without_queue_row", "processed_without_projection"] {
        assert!(report.breaches.iter().any(|b| b == check), "{report:?}");
    }
    let (pending, detail) = value(report.run_id, "pending_without_queue_row").await;
    assert_eq!(pending, Some(3.0));
    assert!(
        detail.starts_with("of the 32 events first received from ")
            && detail.contains("reached the newest event"),
        "{detail}"
    );
    assert_eq!(
        value(report.run_id, "processed_without_projection").await.0,
        Some(2.0)
    );

    // Windows of 5: each run reports its own window's; the runs of a cycle add up to the day.
    let small = AnomalySettings {
        sweep_window_events: 5,
        ..AnomalySettings::default()
    };
    let mut found = (0.0, 0.0);
    let mut runs = 0;
    loop {
        let report = anomaly::run_once(&pool, &small, "test").await.unwrap();
        runs += 1;
        let (pending, detail) = value(report.run_id, "pending_without_queue_row").await;
        let (unprojected, _) = value(report.run_id, "processed_without_projection").await;
        found.0 += pending.unwrap();
        found.1 += unprojected.unwrap();
        if detail.contains("reached the newest event") || runs > 20 {
            break;
        }
        assert!(
            detail.starts_with("of the 5 events") && detail.contains("continues from here"),
            "{detail}"
        );
    }
    assert_eq!((runs, found), (7, (3.0, 2.0)));
}
