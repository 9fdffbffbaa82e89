//! `pending_without_queue_row` and `processed_without_projection` counted by a sweep of the
//! last day's events, a bounded window per anomaly run (`shared::store::consistency_sweep`,
//! issue 26), instead of over the whole day on every run: a cycle of windows examines each
//! event of the day once, newest first, ties of one instant included, and finds what the
//! whole-day statements found; a window as large as the day finds it in one run, as before;
//! what it finds stays counted until it is repaired or a day old; the checks say what the run
//! examined; a cursor that left the day starts a new cycle from the newest event.

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

/// The faulty events the sweep keeps, by check and event id.
async fn findings(pool: &PgPool) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT check_name, external_id FROM consistency_findings ORDER BY check_name, external_id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_cycle_of_windows_examines_each_event_of_the_day_once_newest_first_and_keeps_its_faults(
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
    let (oldest_in_day, newest): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as(
            "SELECT min(first_received_at), max(first_received_at) FROM webhook_events \
             WHERE first_received_at > now() - interval '1 day'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();

    // Windows of 5: the 7 events of the newest instant in a window of 5 and the next, then
    // the 25 distinct instants before it, the last window of 2 reaching the day's oldest.
    let mut windows: Vec<Swept> = Vec::new();
    loop {
        let swept = consistency_sweep::sweep(&pool, 5).await.unwrap();
        assert!(swept.events <= 5, "{swept:?}");
        let done = swept.cycle_ended;
        windows.push(swept);
        if done || windows.len() > 20 {
            break;
        }
    }
    let sizes: Vec<i64> = windows.iter().map(|w| w.events).collect();
    assert_eq!(sizes, [5, 5, 5, 5, 5, 5, 2], "{windows:#?}");
    assert!(windows[0].new_cycle && windows[1..].iter().all(|w| !w.new_cycle));
    assert_eq!(windows[0].through, Some(newest), "{:?}", windows[0]);
    assert_eq!(windows[6].from, Some(oldest_in_day), "{:?}", windows[6]);
    assert!(
        windows
            .windows(2)
            .all(|p| p[1].through <= p[0].from && p[0].cycle_started_at == p[1].cycle_started_at),
        "each window older than the last: {windows:#?}"
    );
    let found = windows.iter().fold((0, 0), |(p, x), w| {
        (
            p + w.pending_without_queue_row,
            x + w.processed_without_projection,
        )
    });
    assert_eq!(found, (3, 2), "the cycle found what the whole day held");
    let kept = |check: &str, ids: &[&str]| -> Vec<(String, String)> {
        ids.iter()
            .map(|id| (check.to_owned(), (*id).to_owned()))
            .collect()
    };
    let mut expected = kept(
        "pending_without_queue_row",
        &["bulk-20", "bulk-3", "bulk-30"],
    );
    expected.extend(kept(
        "processed_without_projection",
        &["bulk-10", "bulk-25"],
    ));
    assert_eq!(
        findings(&pool).await,
        expected,
        "the faults of the day, none outside it"
    );

    // The next run checks the five again, keeps them, and starts a new cycle from the newest.
    let next = consistency_sweep::sweep(&pool, 5).await.unwrap();
    assert!(next.new_cycle && next.events == 5, "{next:?}");
    assert_eq!((next.rechecked, next.dropped), (5, 0), "{next:?}");
    assert_eq!(next.through, Some(newest));
    assert!(next.cycle_started_at > windows[0].cycle_started_at);
    assert_eq!(findings(&pool).await, expected);

    // A cursor that left the day (the anomaly pass stopped for a day) starts a new cycle too:
    // nothing older than the day is examined.
    sqlx::query("UPDATE consistency_sweep SET through_at = now() - interval '25 hours'")
        .execute(&pool)
        .await
        .unwrap();
    let behind = consistency_sweep::sweep(&pool, 5).await.unwrap();
    assert!(behind.new_cycle, "{behind:?}");
    assert_eq!(behind.through, Some(newest));
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_checks_say_what_the_run_examined_and_a_window_as_large_as_the_day_finds_it_all_in_one_run(
    pool: PgPool,
) {
    a_day_with_faults(&pool).await;

    // The default window holds the day: one run finds both faults, as the whole-day
    // statements did, and says so.
    let report = anomaly::run_once(&pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();
    for check in ["pending_without_queue_row", "processed_without_projection"] {
        assert!(report.breaches.iter().any(|b| b == check), "{report:?}");
    }
    let (pending, detail) = check_value(&pool, report.run_id, "pending_without_queue_row").await;
    assert_eq!(pending, Some(3.0));
    assert!(
        detail.contains("examined the 32 events first received from ")
            && detail.contains("reached the day's oldest event"),
        "{detail}"
    );
    assert_eq!(
        check_value(&pool, report.run_id, "processed_without_projection")
            .await
            .0,
        Some(2.0)
    );

    // Windows of 5: each run says which events it examined and that the cycle goes on, until
    // the seventh reaches the day's oldest; the five found before are checked again each run.
    let small = AnomalySettings {
        sweep_window_events: 5,
        ..AnomalySettings::default()
    };
    let mut runs = 0;
    loop {
        let report = anomaly::run_once(&pool, &small, "test").await.unwrap();
        runs += 1;
        let (pending, detail) =
            check_value(&pool, report.run_id, "pending_without_queue_row").await;
        assert_eq!(pending, Some(3.0), "{detail}");
        assert!(
            detail.contains("checked 5 of them again (0 repaired or a day old)"),
            "{detail}"
        );
        if detail.contains("reached the day's oldest event") || runs > 20 {
            break;
        }
        assert!(
            detail.contains("examined the 5 events") && detail.contains("goes on from here"),
            "{detail}"
        );
    }
    assert_eq!(runs, 7);
}

/// The check's value and detail in a run's results.
async fn check_value(pool: &PgPool, run_id: i64, check: &str) -> (Option<f64>, String) {
    sqlx::query_as(
        "SELECT value, detail FROM anomaly_results WHERE run_id = $1 AND check_name = $2",
    )
    .bind(run_id)
    .bind(check)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Both checks' values in one run with `settings`.
async fn both_checks(pool: &PgPool, settings: &AnomalySettings) -> (f64, f64) {
    let report = anomaly::run_once(pool, settings, "test").await.unwrap();
    let pending = check_value(pool, report.run_id, "pending_without_queue_row").await;
    let unprojected = check_value(pool, report.run_id, "processed_without_projection").await;
    (pending.0.unwrap(), unprojected.0.unwrap())
}

/// A fault the sweep found stays counted, run after run, until it is repaired or its event
/// leaves the day, as the whole-day statements counted it on every run: a check that breaches
/// once and reads 0 at the next run, with nothing repaired, tells on-call (and the alarm) that
/// all is well again.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_fault_the_sweep_found_stays_counted_until_it_is_repaired_or_a_day_old(pool: PgPool) {
    a_day_with_faults(&pool).await;
    let small = AnomalySettings {
        sweep_window_events: 5,
        ..AnomalySettings::default()
    };
    // Windows of 5: a cycle is seven runs. Over more than two cycles, nothing repaired, the
    // counts never fall, and from the end of the first cycle on they are the whole day's.
    let mut seen = Vec::new();
    for _ in 0..16 {
        seen.push(both_checks(&pool, &small).await);
    }
    assert!(
        seen.windows(2)
            .all(|p| p[1].0 >= p[0].0 && p[1].1 >= p[0].1),
        "{seen:?}"
    );
    assert!(seen[6..].iter().all(|&s| s == (3.0, 2.0)), "{seen:?}");

    // bulk-3's queue row is back and bulk-10's projection written: the next run counts the
    // rest, whichever window it examines.
    for sql in [
        "INSERT INTO event_queue (tenant_id, external_id, ready_at, enqueued_at) \
         SELECT tenant_id, external_id, now(), now() FROM webhook_events WHERE external_id = 'bulk-3'",
        "INSERT INTO entities (tenant_id, entity_type, entity_id, version, state, last_event_id) \
         SELECT tenant_id, 'item', entity_id, entity_version, '{}'::jsonb, external_id \
         FROM webhook_events WHERE external_id = 'bulk-10'",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    assert_eq!(whole_day(&pool).await, (2, 1));
    assert_eq!(both_checks(&pool, &small).await, (2.0, 1.0));

    // A day later every event has left the day: nothing is counted.
    sqlx::query(
        "UPDATE webhook_events SET first_received_at = first_received_at - interval '1 day'",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(whole_day(&pool).await, (0, 0));
    assert_eq!(both_checks(&pool, &small).await, (0.0, 0.0));
    assert_eq!(
        findings(&pool).await,
        Vec::<(String, String)>::new(),
        "the findings a day old are dropped, not only left uncounted"
    );
}
