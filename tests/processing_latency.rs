//! `processing_latency` from the latencies the drain records as it completes events
//! (`processing_completions`, issue 26), not from a day of `webhook_events` on every anomaly
//! run: the percentiles are the ones the view computed over the events themselves, a dead
//! letter's replay counts like a drain's completion, and the records are forgotten after two
//! hours, so the table holds two hours of batches on day 60.

use std::time::Duration;

use http::StatusCode;
use pipeline_tests::drain::*;
use pipeline_tests::*;
use shared::anomaly::{self, AnomalySettings};
use shared::store::dead_letters::ReplayFilter;
use sqlx::PgPool;

/// What `processing_latency` computed before issue 26: the last hour's processed events of the
/// last day, from `webhook_events`.
const FROM_THE_EVENTS: &str = "SELECT count(*), \
       percentile_cont(0.50) WITHIN GROUP (ORDER BY extract(epoch FROM processed_at - received_at))::float8, \
       percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM processed_at - received_at))::float8, \
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM processed_at - received_at))::float8 \
     FROM webhook_events WHERE first_received_at >= now() - interval '1 day' \
       AND status = 'processed' AND processed_at >= now() - interval '1 hour'";

type Percentiles = (i64, Option<f64>, Option<f64>, Option<f64>);

/// One anomaly run: the view's figures, and the three checks' values as stored.
async fn measured(pool: &PgPool) -> (Percentiles, Vec<Option<f64>>) {
    let report = anomaly::run_once(pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();
    let view: Percentiles = sqlx::query_as(
        "SELECT events, p50_seconds::float8, p95_seconds::float8, p99_seconds::float8 FROM processing_latency",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let checks: Vec<Option<f64>> = sqlx::query_scalar(
        "SELECT value FROM anomaly_results WHERE run_id = $1 AND check_name IN \
         ('processing_p50_seconds', 'processing_p95_seconds', 'processing_p99_seconds') ORDER BY check_name",
    )
    .bind(report.run_id)
    .fetch_all(pool)
    .await
    .unwrap();
    (view, checks)
}

fn close(a: Option<f64>, b: Option<f64>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => (a - b).abs() < 1e-6,
        (None, None) => true,
        _ => false,
    }
}

async fn deliver(app: &TestApp, id: &str, entity: &str) {
    let d = entity_event(id, entity, 1, "thing.updated");
    let reply = app.post(ENTITIES, d.headers, &d.body).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json);
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_latency_percentiles_are_the_events_own_and_two_hours_of_records_are_kept(
    pool: PgPool,
) {
    let app = app(pool.clone()).await;
    create_application_log(&pool).await;
    let (handler, registry, drainer) = poisoned_drain(&pool, "flaky");

    // 30 events received 0 to 29 minutes ago (as if each had waited that long), and one that
    // fails into a dead letter; drained in batches of the drain's size.
    for n in 0..30 {
        deliver(&app, &format!("l-{n}"), &format!("entity-{n}")).await;
    }
    deliver(&app, "l-flaky", "flaky").await;
    sqlx::query(
        "UPDATE webhook_events SET received_at = received_at - make_interval(mins => \
         substr(external_id, 3)::int) WHERE external_id <> 'l-flaky'",
    )
    .execute(&pool)
    .await
    .unwrap();
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM dead_letters").await,
        1,
        "the poisoned event is a dead letter"
    );

    let (view, checks) = measured(&pool).await;
    let expected: Percentiles = sqlx::query_as(FROM_THE_EVENTS)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(view.0, 30, "the drain's completions: {view:?}");
    assert_eq!(view.0, expected.0);
    for (got, want) in [
        (view.1, expected.1),
        (view.2, expected.2),
        (view.3, expected.3),
    ] {
        assert!(close(got, want), "{view:?} beside {expected:?}");
    }
    assert!(
        view.1.is_some_and(|p50| p50 > 14.0 * 60.0),
        "the waits count: {view:?}"
    );
    assert!(close(checks[0], view.1) && close(checks[1], view.2) && close(checks[2], view.3));

    // A replay processes the dead letter: its latency counts like a drain's completion.
    handler
        .broken
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let filter = ReplayFilter {
        error_contains: Some("POISON".into()),
        ..ReplayFilter::default()
    };
    let replayed = shared::drain::replay(&pool, &registry, &filter)
        .await
        .unwrap();
    assert_eq!(replayed.replayed, 1);
    let (view, _) = measured(&pool).await;
    let expected: Percentiles = sqlx::query_as(FROM_THE_EVENTS)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!((view.0, expected.0), (31, 31), "the replay's event counts");
    for (got, want) in [
        (view.1, expected.1),
        (view.2, expected.2),
        (view.3, expected.3),
    ] {
        assert!(close(got, want), "{view:?} beside {expected:?}");
    }
    let records = scalar(&pool, "SELECT count(*) FROM processing_completions").await;
    assert!(
        (2..=4).contains(&records),
        "one record per completing statement, not per event: {records}"
    );

    // Ninety minutes on: nothing processed in the last hour, the records still kept.
    age(&pool, "90 minutes").await;
    let (view, checks) = measured(&pool).await;
    assert_eq!((view.0, view.1), (0, None), "{view:?}");
    assert_eq!(checks, [None, None, None], "nothing to measure");
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processing_completions").await,
        records
    );

    // Past two hours the run forgets them; new completions count from then on.
    age(&pool, "31 minutes").await;
    deliver(&app, "l-new", "entity-new").await;
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    let (view, _) = measured(&pool).await;
    assert_eq!(view.0, 1, "{view:?}");
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processing_completions").await,
        1,
        "only the new completion's record is kept"
    );
}
