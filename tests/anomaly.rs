//! The anomaly checks against a real PostgreSQL: a healthy pipeline breaches nothing; planted
//! faults breach the checks that watch for them; per-source flow is judged by its own history.

use std::time::Duration;

use pipeline_tests::drain::*;
use pipeline_tests::*;
use shared::anomaly::{self, AnomalySettings};
use sqlx::PgPool;

async fn healthy(pool: &PgPool) -> TestApp {
    let app = app(pool.clone()).await;
    for i in 0..5 {
        let d = entity_event(
            &format!("ok-{i}"),
            &format!("thing-{i}"),
            1,
            "thing.updated",
        );
        app.post(ENTITIES, d.headers, &d.body).await;
    }
    let drainer = standard_drainer(pool);
    drain_all(&drainer, pool, Duration::from_secs(10)).await;
    shared::reconcile::run_once(pool, &drainer, &Default::default(), "test")
        .await
        .unwrap();
    shared::retention::run_once(pool, &Default::default(), "test")
        .await
        .unwrap();
    app
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_healthy_pipeline_runs_every_check_and_breaches_none(pool: PgPool) {
    healthy(&pool).await;
    let sources = scalar(&pool, "SELECT count(*) FROM sources").await as usize;

    let first = anomaly::run_once(&pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();
    let second = anomaly::run_once(&pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();

    assert!(anomaly::global_check_count() >= 30);
    assert_eq!(first.checks, anomaly::global_check_count() + 2 * sources);
    assert_eq!(
        (first.breaches.clone(), second.breaches.clone()),
        (vec![], vec![]),
        "{first:?} {second:?}"
    );
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM anomaly_results WHERE run_id = $1")
        .bind(second.run_id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(stored as usize, second.checks);
    let measured: Vec<(String, Option<f64>)> = sqlx::query_as(
        "SELECT check_name, value FROM anomaly_results WHERE run_id = $1 AND check_name IN \
         ('backlog_events', 'processing_p50_seconds', 'views_refresh_age_seconds', 'last_reconcile_age_seconds') ORDER BY 1",
    )
    .bind(second.run_id)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(
        measured.iter().all(|(_, v)| v.is_some()),
        "these are measurable now: {measured:?}"
    );
    let families: i64 = sqlx::query_scalar("SELECT count(DISTINCT family) FROM anomaly_results")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(families, 5);
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn planted_faults_breach_the_checks_that_watch_for_them(pool: PgPool) {
    let app = healthy(&pool).await;
    // A semantic duplicate: the same entity version under two event ids.
    for id in ["dup-a", "dup-b"] {
        let d = entity_event(id, "cust-x", 3, "customer.updated");
        app.post(ENTITIES, d.headers, &d.body).await;
    }
    // A digest conflict.
    let d = entity_event("ok-0", "thing-0", 9, "thing.updated");
    app.post(ENTITIES, d.headers, &d.body).await;
    // An amount mismatch.
    create_order(&pool, "ord-1", "REF-1", 500, "eur").await;
    let d = payment("evt_short", "ord-1", "REF-1", 499, "eur");
    app.post("stripe", d.headers, &d.body).await;
    let drainer = standard_drainer(&pool);
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    // A stuck event, and an outbox row whose event is gone.
    let d = entity_event("stuck", "thing-s", 1, "thing.updated");
    app.post(ENTITIES, d.headers, &d.body).await;
    sqlx::query("UPDATE event_queue SET enqueued_at = now() - interval '2 hours'")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO outbox (tenant_id, external_id, action, payload, idempotency_key) VALUES ($1, 'ghost', 'entity.changed', '{}', 'k-ghost')")
        .bind(TENANT)
        .execute(&pool)
        .await
        .unwrap();
    // A queue row left for an event already processed (not a repair).
    sqlx::query("INSERT INTO event_queue (tenant_id, external_id, ready_at, enqueued_at) VALUES ($1, 'dup-a', now(), now())")
        .bind(TENANT)
        .execute(&pool)
        .await
        .unwrap();
    // A transaction left open elsewhere (a long-held snapshot slows every queue).
    let mut idle = pool.begin().await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *idle).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mut settings = AnomalySettings::default();
    settings
        .ranges
        .insert("longest_open_transaction_seconds", (Some(0.0), Some(1.0)));

    let report = anomaly::run_once(&pool, &settings, "test").await.unwrap();
    idle.rollback().await.unwrap();

    for expected in [
        "semantic_duplicates_last_day",
        "digest_conflicts_last_hour",
        "amount_mismatches_last_day",
        "oldest_pending_age_seconds",
        "pending_outbox_without_event",
        "queued_but_not_pending",
        "longest_open_transaction_seconds",
    ] {
        assert!(
            report.breaches.iter().any(|b| b == expected),
            "{expected} not breached: {:?}",
            report.breaches
        );
    }
    let (value, high): (f64, f64) = sqlx::query_as(
        "SELECT value, expected_high FROM anomaly_results WHERE run_id = $1 AND check_name = 'oldest_pending_age_seconds'",
    )
    .bind(report.run_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(value > 7000.0 && high == 900.0, "{value} {high}");
}

/// Retention falling behind shows: events the identity purge may delete that are hours past the
/// horizon the latest retention run purged to breach `identity_purge_lag_seconds`; an older
/// event retention keeps (its dead letter is open) is not counted; a run that catches up
/// clears it.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn identities_left_past_their_horizon_breach_the_purge_lag(pool: PgPool) {
    healthy(&pool).await;
    let lag = |run_id: i64| {
        let pool = pool.clone();
        async move {
            sqlx::query_as::<_, (Option<f64>, bool)>(
                "SELECT value, breached FROM anomaly_results WHERE run_id = $1 \
                 AND check_name = 'identity_purge_lag_seconds'",
            )
            .bind(run_id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let settings = AnomalySettings::default();
    let caught_up = anomaly::run_once(&pool, &settings, "test").await.unwrap();
    assert_eq!(lag(caught_up.run_id).await, (Some(0.0), false));

    // Three events 5 hours past the 30-day horizon, their effects delivered; one 60 days old
    // whose dead letter is open.
    sqlx::query("UPDATE outbox SET status = 'delivered', delivered_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE webhook_events SET first_received_at = now() - interval '30 days 5 hours', \
             last_seen_at = now() - interval '30 days 5 hours' WHERE external_id IN ('ok-0', 'ok-1', 'ok-2')",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "WITH e AS (UPDATE webhook_events SET status = 'dead_lettered', \
                 first_received_at = now() - interval '60 days', last_seen_at = now() - interval '60 days' \
             WHERE external_id = 'ok-3' RETURNING tenant_id, external_id, source_id, event_type, payload, headers, attempts) \
         INSERT INTO dead_letters (tenant_id, external_id, source_id, event_type, payload, headers, error, reason, attempts) \
         SELECT tenant_id, external_id, source_id, event_type, payload, headers, 'refused', 'fatal', attempts FROM e",
    )
    .execute(&pool)
    .await
    .unwrap();

    let behind = anomaly::run_once(&pool, &settings, "test").await.unwrap();
    let (value, breached) = lag(behind.run_id).await;
    let value = value.unwrap();
    assert!(
        breached && (5.0 * 3600.0 - 60.0..5.0 * 3600.0 + 60.0).contains(&value),
        "five hours behind, the dead-lettered event not counted: {value} {breached}"
    );
    assert!(
        behind
            .breaches
            .contains(&"identity_purge_lag_seconds".to_owned())
    );

    let purged = shared::retention::run_once(&pool, &Default::default(), "test")
        .await
        .unwrap();
    assert_eq!(purged.identities_purged, 3, "{purged:?}");
    let again = anomaly::run_once(&pool, &settings, "test").await.unwrap();
    assert_eq!(lag(again.run_id).await, (Some(0.0), false));
}

/// 20 processed events for each of `sources` in the last complete hour's hour of the week, in
/// each of the three weeks before.
async fn steady_history(pool: &PgPool, sources: &[&str]) {
    sqlx::query(
        "INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, payload_sha256, verified_with, \
             received_at, first_received_at, last_seen_at, status, processed_at) \
         SELECT $1, src || '-w' || w || '-' || n, src, 'ping', sha256(convert_to(src || w || n, 'UTF8')), 'current', t, t, t, 'processed', t \
         FROM unnest($2::text[]) AS src, generate_series(1, 3) AS w, generate_series(1, 20) AS n, \
              LATERAL (SELECT date_trunc('hour', now()) - interval '1 hour' - make_interval(weeks => w) + interval '10 minutes' AS t) AS at",
    )
    .bind(TENANT)
    .bind(sources)
    .execute(pool)
    .await
    .unwrap();
}

/// Silence and spikes per source, each against the same hour of the week in its own history.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn silence_and_spikes_are_judged_against_each_source_own_history(pool: PgPool) {
    let _app = app(pool.clone()).await;
    sqlx::query("UPDATE sources SET created_at = now() - interval '22 days'")
        .execute(&pool)
        .await
        .unwrap();
    // Created 22 days ago: three weeks of history count. At this hour of the week: 20 events
    // for github and for shopify each week.
    // Last hour: github silent, shopify 200 events.
    steady_history(&pool, &["github", "shopify"]).await;
    sqlx::query(
        "INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, payload_sha256, verified_with, \
             received_at, first_received_at, last_seen_at, status, processed_at) \
         SELECT $1, 'shopify-now-' || n, 'shopify', 'ping', sha256(convert_to('now' || n, 'UTF8')), 'current', t, t, t, 'processed', t \
         FROM generate_series(1, 200) AS n, LATERAL (SELECT date_trunc('hour', now()) - interval '50 minutes' AS t) AS at",
    )
    .bind(TENANT)
    .execute(&pool)
    .await
    .unwrap();

    let report = anomaly::run_once(&pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();

    assert!(
        report
            .breaches
            .contains(&"source_silence:github".to_owned()),
        "{:?}",
        report.breaches
    );
    assert!(
        report.breaches.contains(&"source_spike:shopify".to_owned()),
        "{:?}",
        report.breaches
    );
    for quiet in [
        "source_silence:stripe",
        "source_spike:github",
        "source_silence:shopify",
    ] {
        assert!(
            !report.breaches.contains(&quiet.to_owned()),
            "{quiet}: {:?}",
            report.breaches
        );
    }
    let detail: String = sqlx::query_scalar(
        "SELECT detail FROM anomaly_results WHERE run_id = $1 AND check_name = 'source_silence' AND subject = 'github'",
    )
    .bind(report.run_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(detail, "last hour 0 vs 20.0 ± 0.0 over 3 weeks");
}

/// A run whose results cannot be stored ends `failed` on its run row, never stuck `running`.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_run_that_cannot_store_its_results_is_recorded_as_failed(pool: PgPool) {
    healthy(&pool).await;
    sqlx::query("ALTER TABLE anomaly_results ADD CONSTRAINT refuse_rows CHECK (false) NOT VALID")
        .execute(&pool)
        .await
        .unwrap();

    let run = anomaly::run_once(&pool, &AnomalySettings::default(), "test").await;

    assert!(run.is_err(), "{run:?}");
    let rows: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT status, error FROM maintenance_runs WHERE job = 'anomaly'")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].0, "failed", "{rows:?}");
    assert!(
        rows[0]
            .1
            .as_deref()
            .is_some_and(|e| e.contains("refuse_rows")),
        "{rows:?}"
    );
}

/// A sequence source's watermark that stands still while newer events keep arriving (a gap that
/// never resolves, a stalled detector) breaches `stalled_gap_watermarks`; a watermark that
/// waits out a gap's grace period does not.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_watermark_standing_still_while_newer_events_arrive_breaches(pool: PgPool) {
    use pipeline_tests::gaps;
    let provider = gaps::provider(30, vec![]);
    let base = std::sync::Arc::clone(&provider).serve().await;
    let app = gaps::app(
        pool.clone(),
        &[gaps::provider_source(
            "seq",
            gaps::sequence_strategy(),
            &base,
            Duration::from_secs(600),
        )],
    )
    .await;
    let (deliveries, _) = provider.deliveries(simulator::DeliveryPlan {
        duplicate_rate: 0.0,
        drop_rate: 0.0,
        reorder_window: 0,
        seed: 1,
        signed_at: now(),
    });
    let (early, late): (Vec<_>, Vec<_>) = deliveries
        .into_iter()
        .filter(|d| d.id != "evt_10")
        .partition(|d| d.id.trim_start_matches("evt_").parse::<u64>().unwrap() < 10);
    gaps::deliver_all(&app, "seq", early).await;
    gaps::backfiller(&pool).run_once("test").await.unwrap();
    gaps::deliver_all(&app, "seq", late).await;
    gaps::backfiller(&pool).run_once("test").await.unwrap();
    assert_eq!(
        scalar(&pool, "SELECT contiguous_through FROM gap_watermarks").await,
        9
    );
    let waiting = anomaly::run_once(&pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();
    assert!(
        !waiting
            .breaches
            .iter()
            .any(|b| b == "stalled_gap_watermarks"),
        "{:?}",
        waiting.breaches
    );

    // Three hours on, the watermark has not moved and newer events kept arriving.
    sqlx::query("UPDATE gap_watermarks SET advanced_at = advanced_at - interval '3 hours'")
        .execute(&pool)
        .await
        .unwrap();
    let stalled = anomaly::run_once(&pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();
    assert!(
        stalled
            .breaches
            .iter()
            .any(|b| b == "stalled_gap_watermarks"),
        "{:?}",
        stalled.breaches
    );
    let value: f64 = sqlx::query_scalar(
        "SELECT value FROM anomaly_results WHERE run_id = $1 AND check_name = 'stalled_gap_watermarks'",
    )
    .bind(stalled.run_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(value, 1.0);
}

/// A buffered event is not missing: while the SQS buffer holds deliveries (any source's: SQS
/// cannot say whose), or cannot be counted, no source is judged silent; its dead-letter queue is
/// a check of its own.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn no_source_is_silent_while_the_buffer_holds_deliveries(pool: PgPool) {
    let _app = app(pool.clone()).await;
    sqlx::query("UPDATE sources SET created_at = now() - interval '22 days'")
        .execute(&pool)
        .await
        .unwrap();
    // Three weeks of 20 github events at this hour of the week; none in the last hour.
    steady_history(&pool, &["github"]).await;
    let queue = pipeline_tests::buffer::new_buffer_queue(5, 30).await;
    let settings = AnomalySettings::default();
    let run = |queue| {
        let (pool, settings) = (pool.clone(), settings.clone());
        async move {
            anomaly::run_once_with_buffer(&pool, &settings, "test", Some(queue))
                .await
                .unwrap()
        }
    };
    let result = |run_id: i64, check: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_as::<_, (Option<f64>, bool, String)>(
                "SELECT value, breached, detail FROM anomaly_results \
                 WHERE run_id = $1 AND check_name = $2 AND subject IN ('', 'github')",
            )
            .bind(run_id)
            .bind(check)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };

    // The buffer empty: github is silent, and the buffer's dead letters are counted (none).
    let empty = run(&queue).await;
    assert!(
        empty.breaches.contains(&"source_silence:github".to_owned()),
        "{:?}",
        empty.breaches
    );
    assert_eq!(
        result(empty.run_id, "buffer_dead_letters").await,
        (Some(0.0), false, String::new())
    );

    // One delivery waits in the buffer: github's hour may be in it.
    let waiting = shared::buffer::BufferedDelivery {
        envelope: shared::buffer::Envelope {
            v: shared::buffer::ENVELOPE_VERSION,
            delivery_id: "d-waiting".into(),
            verified_layout: None,
            source_id: "github".into(),
            received_at_micros: now() * 1_000_000,
            verified_with: "current".into(),
            headers: Default::default(),
            signed_headers: vec![],
            signed_digest: None,
            element_digests: Vec::new(),
        },
        body: b"{}".to_vec(),
    };
    queue.send(waiting.clone()).await.unwrap();
    let holding = run(&queue).await;
    assert!(
        !holding
            .breaches
            .iter()
            .any(|b| b.starts_with("source_silence")),
        "{:?}",
        holding.breaches
    );
    let (value, breached, detail) = result(holding.run_id, "source_silence").await;
    assert_eq!((value, breached), (Some(0.0), false));
    assert!(
        detail.contains("the SQS buffer holds 1 deliveries not filed yet"),
        "{detail}"
    );

    // One the consumer gave up on: a breach, whatever else the buffer holds.
    queue
        .send_to(queue.dead_letter_queue_url().unwrap(), waiting)
        .await
        .unwrap();
    let dead = run(&queue).await;
    assert!(
        dead.breaches.contains(&"buffer_dead_letters".to_owned()),
        "{:?}",
        dead.breaches
    );
    assert_eq!(
        result(dead.run_id, "buffer_dead_letters").await.0,
        Some(1.0)
    );

    // A buffer that cannot be counted holds silence too, and says why.
    let unreachable = shared::buffer::BufferQueue::connect(&shared::buffer::QueueSettings {
        queue_url: "http://127.0.0.1:9/000000000000/nowhere".into(),
        dead_letter_queue_url: Some("http://127.0.0.1:9/000000000000/nowhere-dlq".into()),
        endpoint: shared::aws::AwsEndpoint {
            endpoint_url: Some("http://127.0.0.1:9".into()),
            region: Some("us-east-1".into()),
        },
        metrics_endpoint_url: None,
    })
    .await;
    let blind = run(&unreachable).await;
    assert!(
        !blind
            .breaches
            .iter()
            .any(|b| b.starts_with("source_silence")),
        "{:?}",
        blind.breaches
    );
    let (value, breached, detail) = result(blind.run_id, "buffer_dead_letters").await;
    assert_eq!((value, breached), (None, false));
    assert!(
        detail.starts_with("the buffer could not be counted"),
        "{detail}"
    );
    assert!(
        result(blind.run_id, "source_silence")
            .await
            .2
            .contains("could not be counted")
    );
}

/// Issue 23: a repair is a signal too. Reconcile re-queues the events of a lost projection row
/// and records them by kind; the repairs check breaches for a day, then is quiet.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_repair_breaches_the_repairs_check_for_a_day(pool: PgPool) {
    healthy(&pool).await;
    let quiet = anomaly::run_once(&pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();
    assert_eq!(quiet.breaches, Vec::<String>::new());

    sqlx::query("DELETE FROM entities WHERE entity_id = 'thing-1'")
        .execute(&pool)
        .await
        .unwrap();
    let drainer = standard_drainer(&pool);
    let outcome = shared::reconcile::run_once(&pool, &drainer, &Default::default(), "test")
        .await
        .unwrap();
    let shared::reconcile::ReconcileOutcome::Completed { repaired, .. } = outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(repaired.requeued, 1);
    assert_eq!(
        repaired.requeued_by_kind,
        shared::reconcile::RepairsByKind {
            missing_effects: 1,
            ..Default::default()
        }
    );
    let recorded: serde_json::Value = sqlx::query_scalar(
        "SELECT repaired FROM maintenance_runs WHERE job = 'reconcile' ORDER BY run_id DESC LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(recorded["requeued"], 1, "{recorded}");
    assert_eq!(
        recorded["requeued_by_kind"],
        serde_json::json!({"orphaned_pending": 0, "missing_effects": 1, "missing_outbox": 0})
    );

    let report = anomaly::run_once(&pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();
    assert_eq!(report.breaches, vec!["reconcile_repairs_last_day"]);
    let value: f64 = sqlx::query_scalar(
        "SELECT value FROM anomaly_results WHERE run_id = $1 AND check_name = 'reconcile_repairs_last_day'",
    )
    .bind(report.run_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(value, 1.0);

    // A day later (and a quiet pass since), nothing breaches.
    sqlx::query("UPDATE maintenance_runs SET started_at = started_at - interval '25 hours', finished_at = finished_at - interval '25 hours' WHERE job = 'reconcile'")
        .execute(&pool)
        .await
        .unwrap();
    shared::reconcile::run_once(&pool, &drainer, &Default::default(), "test")
        .await
        .unwrap();
    let later = anomaly::run_once(&pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();
    assert_eq!(later.breaches, Vec::<String>::new());
}

/// Issue 23: delivery trouble seen before it is final. One failed try is no breach; a second,
/// and a message undelivered for over four outbox runs, are, long before the 10 tries run out.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_target_that_keeps_failing_breaches_the_outbox_checks_before_any_message_fails(
    pool: PgPool,
) {
    healthy(&pool).await;
    let pending = scalar(
        &pool,
        "SELECT count(*) FROM outbox WHERE status = 'pending'",
    )
    .await;
    assert!(pending > 0, "the healthy pipeline announced its changes");
    // Nothing listens there: every try fails at once.
    let sender = shared::outbox::OutboxSender::new(
        pool.clone(),
        shared::outbox::OutboxSettings {
            backoff_base: Duration::from_millis(1),
            backoff_cap: Duration::from_millis(1),
            ..shared::outbox::OutboxSettings::new("http://127.0.0.1:1/hook")
        },
    )
    .unwrap();
    let breaches = |report: anomaly::AnomalyReport| -> Vec<String> {
        report
            .breaches
            .into_iter()
            .filter(|b| b.starts_with("outbox_"))
            .collect()
    };
    let age = |minutes: i32| {
        let pool = pool.clone();
        async move {
            sqlx::query("UPDATE outbox SET created_at = created_at - make_interval(mins => $1)")
                .bind(minutes)
                .execute(&pool)
                .await
                .unwrap();
        }
    };
    let try_all = || async {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let sent = sender
            .send_until(std::time::Instant::now() + Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!((sent.retried, sent.failed), (pending as u64, 0), "{sent:?}");
    };

    // The first run after the target went down: one failed try each.
    try_all().await;
    let first = anomaly::run_once(&pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();
    assert_eq!(breaches(first), Vec::<String>::new());

    // Five minutes on, the second (and later) tries failed too.
    age(5).await;
    try_all().await;
    let second = anomaly::run_once(&pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();
    assert_eq!(
        breaches(second),
        [
            "outbox_retrying_messages",
            "outbox_oldest_undelivered_seconds"
        ]
    );
    // Nothing has failed for good: every message has tries left.
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM outbox WHERE status = 'failed'").await,
        0
    );
    assert_eq!(
        scalar(&pool, "SELECT max(attempts)::int8 FROM outbox").await,
        2
    );
}
