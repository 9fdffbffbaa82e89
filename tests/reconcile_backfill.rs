//! Reconciliation, gap detection and backfill against a real PostgreSQL and the provider
//! simulator: drops found and fetched, missing IDs tombstoned once, late events left to their
//! grace, one reconcile pass at a time, lost effects repaired, retention without second effects.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use pipeline_tests::drain::{create_order, drain_all, payment, scalar, standard_drainer};
use pipeline_tests::gaps::*;
use pipeline_tests::*;
use shared::backfill::BackfillRun;
use shared::drain::Drainer;
use shared::effects::EffectRegistry;
use shared::reconcile::{self, ReconcileOutcome, ReconcileSettings};
use shared::sources::GapStrategy;
use simulator::DeliveryPlan;
use sqlx::PgPool;

fn plan(drop_rate: f64, seed: u64) -> DeliveryPlan {
    DeliveryPlan {
        duplicate_rate: 0.1,
        drop_rate,
        reorder_window: 25,
        seed,
        signed_at: now(),
    }
}

/// Runs one scheduled reconcile pass with default settings; it must complete.
async fn reconciled(pool: &PgPool, drainer: &Drainer) -> (reconcile::Found, reconcile::Repaired) {
    match reconcile::run_once(pool, drainer, &ReconcileSettings::default(), "schedule")
        .await
        .unwrap()
    {
        ReconcileOutcome::Completed {
            found, repaired, ..
        } => (found, repaired),
        other => panic!("expected a completed reconcile pass, got {other:?}"),
    }
}

/// The receiver's projection, as the provider's truth is shaped: entity → (version, event id).
async fn projection(pool: &PgPool) -> BTreeMap<String, (i64, String)> {
    let rows: Vec<(String, i64, String)> =
        sqlx::query_as("SELECT entity_id, version, last_event_id FROM entities")
            .fetch_all(pool)
            .await
            .unwrap();
    rows.into_iter().map(|(e, v, id)| (e, (v, id))).collect()
}

/// (a) 5% of 2,000 deliveries dropped (with duplicates and reorders besides): one backfill pass
/// later every event is stored exactly once and the drained state matches the provider's.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn dropped_deliveries_are_backfilled_and_the_state_matches_the_provider(pool: PgPool) {
    for (source_id, strategy, seed) in [
        ("by-sequence", sequence_strategy(), 11),
        ("by-listing", GapStrategy::ListApi, 12),
    ] {
        sqlx::query(
            "TRUNCATE event_queue, outbox, entities, gap_candidates, webhook_events CASCADE",
        )
        .execute(&pool)
        .await
        .unwrap();
        let provider = provider(2000, vec![]);
        let base = Arc::clone(&provider).serve().await;
        let app = app(
            pool.clone(),
            &[provider_source(source_id, strategy, &base, Duration::ZERO)],
        )
        .await;
        let (deliveries, report) = provider.deliveries(plan(0.05, seed));
        // A numbered provider shows a gap only below a number that did arrive.
        assert!(
            !report.dropped.contains(&"evt_2000".to_owned()),
            "seed {seed} drops the newest event"
        );
        assert!(
            (60..=140).contains(&report.dropped.len())
                && report.duplicates > 100
                && report.reordered > 100,
            "{report:?}"
        );

        deliver_all(&app, source_id, deliveries).await;
        let outcome = backfill_pass(&backfiller(&pool)).await;
        drain_all(&standard_drainer(&pool), &pool, Duration::from_secs(60)).await;

        assert_eq!(
            outcome.new_candidates as usize,
            report.dropped.len(),
            "{source_id}: {outcome:?}"
        );
        assert_eq!(
            (
                outcome.backfilled as usize,
                outcome.tombstoned,
                outcome.errors
            ),
            (report.dropped.len(), 0, 0),
            "{source_id}"
        );
        assert_eq!(
            scalar(&pool, "SELECT count(*) FROM webhook_events").await,
            2000,
            "{source_id}"
        );
        assert_eq!(
            scalar(
                &pool,
                "SELECT count(*) FROM webhook_events WHERE status = 'processed'"
            )
            .await,
            2000
        );
        let backfilled: Vec<String> =
            sqlx::query_scalar("SELECT external_id FROM webhook_events WHERE verified_with = 'provider_api' ORDER BY external_id")
                .fetch_all(&pool)
                .await
                .unwrap();
        let mut dropped = report.dropped.clone();
        dropped.sort();
        assert_eq!(
            backfilled, dropped,
            "{source_id}: exactly the dropped events came from the API"
        );
        assert_eq!(
            projection(&pool).await,
            provider.final_state(),
            "{source_id}: drained state matches the provider"
        );
        let fetched = provider.fetched();
        assert_eq!(
            fetched.len(),
            report.dropped.len(),
            "{source_id}: nothing fetched that had arrived"
        );
    }
}

/// (b) An ID that never existed is tombstoned once and never flagged again.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_legitimately_missing_id_is_tombstoned_once_and_never_reflagged(pool: PgPool) {
    let provider = provider(300, vec![150]);
    let base = Arc::clone(&provider).serve().await;
    let app = sequence_app(&pool, &base, Duration::ZERO).await;
    let (deliveries, _) = provider.deliveries(plan(0.0, 3));
    deliver_all(&app, "seq", deliveries).await;

    let first = backfill_pass(&backfiller(&pool)).await;
    let second = backfill_pass(&backfiller(&pool)).await;
    let third = backfill_pass(&backfiller(&pool)).await;

    assert_eq!(
        (first.new_candidates, first.fetched, first.tombstoned),
        (1, 1, 1)
    );
    assert_eq!(
        (
            second.new_candidates,
            second.fetched,
            third.new_candidates,
            third.fetched
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(provider.fetched(), ["evt_150"], "fetched once, never again");
    let (reason, by, sequence): (String, String, Option<i64>) =
        sqlx::query_as("SELECT reason, created_by, sequence FROM tombstones")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(reason.contains("404"), "{reason}");
    assert_eq!((by.as_str(), sequence), ("backfill", Some(150)));
    assert_eq!(
        scalar(&pool, "SELECT contiguous_through FROM gap_watermarks").await,
        300,
        "the watermark passed the tombstone"
    );
}

/// (c) A late event inside the grace period is not fetched; when it arrives, its candidate
/// closes as `arrived`.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_late_event_inside_the_grace_period_is_not_fetched(pool: PgPool) {
    let provider = provider(100, vec![]);
    let base = Arc::clone(&provider).serve().await;
    let app = sequence_app(&pool, &base, Duration::from_secs(3600)).await;
    let (deliveries, _) = provider.deliveries(plan(0.0, 4));
    let (late, on_time): (Vec<_>, Vec<_>) = deliveries.into_iter().partition(|d| d.id == "evt_40");
    deliver_all(&app, "seq", on_time).await;

    let before = backfill_pass(&backfiller(&pool)).await;
    assert_eq!(
        (before.new_candidates, before.waiting_grace, before.fetched),
        (1, 1, 0)
    );
    deliver_all(&app, "seq", late).await;
    let after = backfill_pass(&backfiller(&pool)).await;

    assert_eq!((after.arrived_late, after.fetched), (1, 0));
    assert!(provider.fetched().is_empty());
    let status: String = sqlx::query_scalar("SELECT status FROM gap_candidates")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(status, "arrived");
}

/// "Backfill now": a gap still inside a long grace period, asked for by an operator (recorded
/// with who and why), is fetched by the next pass and stored; asking for a gap that is not open
/// is refused with the reason.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_gap_an_operator_asks_for_is_fetched_by_the_next_pass_despite_its_grace(pool: PgPool) {
    let provider = provider(100, vec![]);
    let base = Arc::clone(&provider).serve().await;
    let app = sequence_app(&pool, &base, Duration::from_secs(3600)).await;
    let (deliveries, _) = provider.deliveries(plan(0.0, 4));
    deliver_all(
        &app,
        "seq",
        deliveries
            .into_iter()
            .filter(|d| d.id != "evt_40")
            .collect(),
    )
    .await;
    let found = backfill_pass(&backfiller(&pool)).await;
    assert_eq!((found.waiting_grace, found.fetched), (1, 0));

    let registry = shared::effects::EffectRegistry::standard();
    let ask = |request: serde_json::Value| {
        let (pool, registry) = (&pool, &registry);
        async move {
            let request = shared::operator::parse(request).unwrap();
            shared::operator::handle(pool, registry, request)
                .await
                .map(|answer| serde_json::to_value(answer).unwrap())
        }
    };
    let asked = ask(serde_json::json!({
        "action": "backfill_gap", "tenant_id": TENANT, "source_id": "seq", "external_id": "evt_40",
        "actor": "carol", "reason": "the customer is waiting"}))
    .await
    .unwrap();
    assert_eq!(asked["next_pass_within_seconds"], 300, "{asked}");

    let next = backfill_pass(&backfiller(&pool)).await;
    assert_eq!(
        (next.fetched, next.backfilled, next.waiting_grace),
        (1, 1, 0)
    );
    assert_eq!(provider.fetched(), ["evt_40"]);
    let stored: String =
        sqlx::query_scalar("SELECT verified_with FROM webhook_events WHERE external_id = 'evt_40'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(stored, "provider_api");
    let (actor, reason): (String, String) =
        sqlx::query_as("SELECT actor, reason FROM operator_actions WHERE action = 'backfill_gap'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (actor.as_str(), reason.as_str()),
        ("carol", "the customer is waiting")
    );

    let refused = ask(serde_json::json!({
        "action": "backfill_gap", "tenant_id": TENANT, "source_id": "seq", "external_id": "evt_40",
        "actor": "carol", "reason": "again"}))
    .await
    .unwrap_err();
    assert!(
        refused.to_string().contains("no open gap evt_40"),
        "{refused}"
    );
}

/// An operator tombstone stops a gap from being flagged.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_operator_tombstone_is_never_flagged(pool: PgPool) {
    let provider = provider(50, vec![]);
    let base = Arc::clone(&provider).serve().await;
    let app = sequence_app(&pool, &base, Duration::ZERO).await;
    let (deliveries, _) = provider.deliveries(plan(0.0, 5));
    deliver_all(
        &app,
        "seq",
        deliveries
            .into_iter()
            .filter(|d| d.id != "evt_20")
            .collect(),
    )
    .await;
    let request = shared::operator::parse(serde_json::json!({
        "action": "tombstone", "tenant_id": TENANT, "source_id": "seq", "external_id": "evt_20", "sequence": 20,
        "reason": "refunded test charge, deleted at the provider", "operator": "alice"
    }))
    .unwrap();
    shared::operator::handle(&pool, &EffectRegistry::standard(), request)
        .await
        .unwrap();

    let outcome = backfill_pass(&backfiller(&pool)).await;

    assert_eq!((outcome.new_candidates, outcome.fetched), (0, 0));
    let by: String = sqlx::query_scalar("SELECT created_by FROM tombstones")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(by, "operator:alice");
}

/// (d) Two concurrent reconcile triggers: one pass, one `skipped`.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn two_concurrent_reconcile_triggers_run_one_pass(pool: PgPool) {
    // Enough consistent history that a pass takes a while to scan.
    shared::sources::apply(&pool, &[pipeline_tests::drain::entity_source()])
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, payload_sha256, verified_with, \
             received_at, first_received_at, last_seen_at, status, processed_at) \
         SELECT $1, 'hist-' || g, 'entities', 'ping', sha256(convert_to(g::text, 'UTF8')), 'current', now(), now(), now(), 'processed', now() \
         FROM generate_series(1, 60000) AS g",
    )
    .bind(TENANT)
    .execute(&pool)
    .await
    .unwrap();
    let settings = ReconcileSettings {
        chunk_size: 500,
        max_chunks: 1000,
        ..ReconcileSettings::default()
    };
    let (d1, d2) = (standard_drainer(&pool), standard_drainer(&pool));

    let (a, b) = tokio::join!(
        reconcile::run_once(&pool, &d1, &settings, "schedule"),
        reconcile::run_once(&pool, &d2, &settings, "alarm:BacklogAge"),
    );

    let outcomes = [a.unwrap(), b.unwrap()];
    let completed = outcomes
        .iter()
        .filter(|o| matches!(o, ReconcileOutcome::Completed { .. }))
        .count();
    let skipped = outcomes
        .iter()
        .filter(|o| matches!(o, ReconcileOutcome::Skipped { .. }))
        .count();
    assert_eq!((completed, skipped), (1, 1), "{outcomes:?}");
    let runs: Vec<(String, String)> = sqlx::query_as(
        "SELECT status, trigger FROM maintenance_runs WHERE job = 'reconcile' ORDER BY status",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(
        (runs[0].0.as_str(), runs[1].0.as_str()),
        ("completed", "skipped")
    );
    // The lock was released: the next trigger runs.
    let next = reconcile::run_once(&pool, &d1, &settings, "schedule")
        .await
        .unwrap();
    assert!(matches!(next, ReconcileOutcome::Completed { .. }));
}

/// (e) A processed event whose effect row was deleted, and one whose outbox row was lost, are
/// repaired by the next pass through the normal path.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_pass_repairs_lost_effects_and_outbox_rows(pool: PgPool) {
    let app = pipeline_tests::drain::app(pool.clone()).await;
    for (id, entity) in [("e-1", "cust-1"), ("e-2", "cust-2"), ("e-3", "cust-3")] {
        let d = pipeline_tests::drain::entity_event(id, entity, 1, "customer.updated");
        app.post(pipeline_tests::drain::ENTITIES, d.headers, &d.body)
            .await;
    }
    create_order(&pool, "ord-1", "REF-1", 700, "eur").await;
    let d = payment("evt_pay", "ord-1", "REF-1", 700, "eur");
    app.post("stripe", d.headers, &d.body).await;
    let drainer = standard_drainer(&pool);
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    let fulfil_key: String =
        sqlx::query_scalar("SELECT idempotency_key FROM outbox WHERE action = 'fulfil_order'")
            .fetch_one(&pool)
            .await
            .unwrap();
    sqlx::query("DELETE FROM entities WHERE entity_id = 'cust-2'")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM outbox WHERE external_id IN ('e-3', 'evt_pay')")
        .execute(&pool)
        .await
        .unwrap();

    let (found, repaired) = reconciled(&pool, &drainer).await;
    assert_eq!(
        (
            found.missing_effects,
            found.missing_outbox,
            found.orphaned_pending
        ),
        (1, 2, 0),
        "{found:?}"
    );
    assert_eq!(
        (repaired.requeued, repaired.drained.processed),
        (3, 3),
        "{repaired:?}"
    );
    assert_eq!(scalar(&pool, "SELECT count(*) FROM entities").await, 3);
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE action = 'entity.changed'"
        )
        .await,
        3
    );
    let key: String =
        sqlx::query_scalar("SELECT idempotency_key FROM outbox WHERE action = 'fulfil_order'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        key, fulfil_key,
        "the repaired row carries the same idempotency key"
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM orders WHERE state = 'paid'").await,
        1
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM payment_exceptions").await,
        0,
        "no second payment seen"
    );

    let (found, _) = reconciled(&pool, &drainer).await;
    assert_eq!(
        (found.missing_effects, found.missing_outbox),
        (0, 0),
        "the next pass finds nothing"
    );
    let (run_found, run_repaired): (serde_json::Value, serde_json::Value) =
        sqlx::query_as("SELECT found, repaired FROM maintenance_runs WHERE job = 'reconcile' ORDER BY run_id LIMIT 1").fetch_one(&pool).await.unwrap();
    assert_eq!(
        (
            run_found["missing_effects"].as_i64(),
            run_repaired["requeued"].as_i64()
        ),
        (Some(1), Some(3))
    );
}

/// Orphaned pending events (queue row lost) and overdue outbox rows are found and repaired.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_pass_requeues_orphans_and_hurries_overdue_outbox_rows(pool: PgPool) {
    let app = pipeline_tests::drain::app(pool.clone()).await;
    let d = pipeline_tests::drain::entity_event("o-1", "x-1", 1, "thing.updated");
    app.post(pipeline_tests::drain::ENTITIES, d.headers, &d.body)
        .await;
    sqlx::query("DELETE FROM event_queue")
        .execute(&pool)
        .await
        .unwrap();
    let d = pipeline_tests::drain::entity_event("o-2", "x-2", 1, "thing.updated");
    app.post(pipeline_tests::drain::ENTITIES, d.headers, &d.body)
        .await;
    let drainer = standard_drainer(&pool);
    drainer
        .drain_until(std::time::Instant::now() + Duration::from_secs(5))
        .await
        .unwrap();
    sqlx::query("UPDATE outbox SET created_at = now() - interval '2 hours', next_attempt_at = now() + interval '1 hour'").execute(&pool).await.unwrap();
    sqlx::query("UPDATE webhook_events SET status = 'pending' WHERE external_id = 'o-1'")
        .execute(&pool)
        .await
        .unwrap();

    let (found, repaired) = reconciled(&pool, &drainer).await;
    assert_eq!(
        (found.orphaned_pending, found.outbox_undelivered_past_window),
        (1, 1),
        "{found:?}"
    );
    assert_eq!((repaired.requeued, repaired.outbox_made_due), (1, 1));
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM webhook_events WHERE status = 'processed'"
        )
        .await,
        2
    );
}

/// Retention purges payloads, then identities past the horizon (keeping dead-lettered ones);
/// a delivery arriving after its identity was purged makes no second effect and is recorded.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn retention_purges_in_order_and_a_late_redelivery_has_no_second_effect(pool: PgPool) {
    let app = pipeline_tests::drain::app(pool.clone()).await;
    create_order(&pool, "ord-9", "REF-9", 900, "usd").await;
    let pay = payment("evt_old_pay", "ord-9", "REF-9", 900, "usd");
    let entity =
        pipeline_tests::drain::entity_event("old-entity", "cust-old", 4, "customer.updated");
    let fresh = pipeline_tests::drain::entity_event("fresh", "cust-new", 1, "customer.updated");
    for (source, d) in [
        ("stripe", &pay),
        (pipeline_tests::drain::ENTITIES, &entity),
        (pipeline_tests::drain::ENTITIES, &fresh),
    ] {
        app.post(source, d.headers.clone(), &d.body).await;
    }
    let drainer = standard_drainer(&pool);
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    sqlx::query("UPDATE webhook_events SET first_received_at = now() - interval '10 days', last_seen_at = now() - interval '10 days' WHERE external_id <> 'fresh'")
        .execute(&pool)
        .await
        .unwrap();

    let settings = shared::retention::RetentionSettings {
        payload_after: Duration::from_secs(24 * 3600),
        identity_after: Duration::from_secs(30 * 24 * 3600),
        ..Default::default()
    };
    let first = shared::retention::run_once(&pool, &settings, "test")
        .await
        .unwrap();
    assert_eq!((first.payloads_purged, first.identities_purged), (2, 0));
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM webhook_events WHERE payload IS NULL"
        )
        .await,
        2
    );

    sqlx::query("UPDATE webhook_events SET first_received_at = now() - interval '40 days', last_seen_at = now() - interval '40 days' WHERE external_id <> 'fresh'")
        .execute(&pool)
        .await
        .unwrap();
    let held = shared::retention::run_once(&pool, &settings, "test")
        .await
        .unwrap();
    assert_eq!(
        held.identities_purged, 0,
        "undelivered outbox rows hold their events"
    );
    sqlx::query("UPDATE outbox SET status = 'delivered', delivered_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    let second = shared::retention::run_once(&pool, &settings, "test")
        .await
        .unwrap();
    assert_eq!(second.identities_purged, 2);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM webhook_events").await,
        1
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM outbox").await,
        1,
        "the purged events' outbox rows went with them"
    );

    // The provider delivers both again, long after.
    for (source, d) in [("stripe", &pay), (pipeline_tests::drain::ENTITIES, &entity)] {
        assert_eq!(
            app.post(source, d.headers.clone(), &d.body).await.outcome(),
            "accepted"
        );
    }
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;

    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM outbox").await,
        1,
        "no second fulfilment, no second announcement"
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM payment_exceptions").await,
        0
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM orders WHERE state = 'paid'").await,
        1
    );
    let anomalies: Vec<String> =
        sqlx::query_scalar("SELECT external_id FROM ingest_anomalies WHERE kind = 'redelivered_after_purge' ORDER BY external_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(anomalies, ["evt_old_pay", "old-entity"]);
}

/// A pass that fails after taking its lock (here: its run row cannot be finished) still
/// releases the lock: the next pass, from another environment's pool, runs.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_failed_backfill_pass_releases_its_lock(
    pool_options: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let first = pool_options
        .clone()
        .connect_with(connect.clone())
        .await
        .unwrap();
    let second = pool_options.connect_with(connect).await.unwrap();
    sqlx::query(
        "ALTER TABLE maintenance_runs ADD CONSTRAINT refuse_backfill \
         CHECK (job <> 'backfill' OR status <> 'completed') NOT VALID",
    )
    .execute(&first)
    .await
    .unwrap();
    let failed = backfiller(&first).run_once("test").await;
    assert!(failed.is_err(), "{failed:?}");

    sqlx::query("ALTER TABLE maintenance_runs DROP CONSTRAINT refuse_backfill")
        .execute(&second)
        .await
        .unwrap();
    let next = backfiller(&second).run_once("test").await.unwrap();
    assert!(matches!(next, BackfillRun::Completed { .. }), "{next:?}");
}

/// A handler with a bug that panics. The Lambda runtime catches a panic and the process lives
/// on, so whatever the pass held must not outlive it.
struct Panics;

impl shared::effects::EffectHandler for Panics {
    fn name(&self) -> &'static str {
        "panics"
    }

    fn apply<'a>(
        &'a self,
        _conn: &'a mut sqlx::PgConnection,
        event: &'a shared::store::event_queue::ClaimedEvent,
    ) -> shared::effects::EffectFuture<'a> {
        Box::pin(async move {
            if !event.external_id.is_empty() {
                panic!("a bug in a handler, on {}", event.external_id);
            }
            Ok(shared::effects::Effect::Skipped)
        })
    }
}

/// A pass that panics (here: reconcile drains a stuck event through a handler that panics)
/// releases its advisory lock and records its run as failed: the next trigger, from another
/// execution environment, runs instead of recording `skipped`.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_pass_that_panics_releases_its_lock(
    pool_options: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let first = pool_options
        .clone()
        .connect_with(connect.clone())
        .await
        .unwrap();
    let second = pool_options.connect_with(connect).await.unwrap();
    let app = pipeline_tests::drain::app(first.clone()).await;
    let d = pipeline_tests::drain::entity_event("stuck-1", "thing-1", 1, "thing.updated");
    app.post(pipeline_tests::drain::ENTITIES, d.headers, &d.body)
        .await;
    sqlx::query("UPDATE event_queue SET enqueued_at = now() - interval '1 hour'")
        .execute(&first)
        .await
        .unwrap();
    let buggy = Drainer::new(
        first.clone(),
        Arc::new(EffectRegistry::new(Arc::new(Panics))),
        pipeline_tests::drain::fast_settings(),
    );

    let pool = first.clone();
    let panicked = tokio::spawn(async move {
        reconcile::run_once(&pool, &buggy, &ReconcileSettings::default(), "schedule").await
    })
    .await;
    assert!(
        panicked.as_ref().is_err_and(|e| e.is_panic()),
        "{panicked:?}"
    );

    // The environment that panicked lives on (its pool stays open); another one triggers.
    let next = reconcile::run_once(
        &second,
        &standard_drainer(&second),
        &ReconcileSettings::default(),
        "alarm:oldest-pending-age",
    )
    .await
    .unwrap();
    assert!(
        matches!(next, ReconcileOutcome::Completed { .. }),
        "the lock outlived the pass that panicked: {next:?}"
    );
    let runs: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT trigger, status, error FROM maintenance_runs WHERE job = 'reconcile' ORDER BY run_id",
    )
    .fetch_all(&second)
    .await
    .unwrap();
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert_eq!(
        (runs[0].1.as_str(), runs[1].1.as_str()),
        ("failed", "completed"),
        "{runs:?}"
    );
    assert!(
        runs[0].2.as_deref().is_some_and(|e| e.contains("panicked")),
        "{runs:?}"
    );
    assert_eq!(
        event(&second, TENANT, "stuck-1").await.unwrap().status,
        "processed",
        "the next pass drained the stuck event"
    );
    first.close().await;
}

/// A processed row is never rewritten, including while reconcile has it re-queued for a repair:
/// a conflicting delivery arriving meanwhile is recorded as a conflict and changes nothing, and
/// the repair re-applies the payload that was processed.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_processed_event_requeued_by_reconcile_is_never_rewritten(pool: PgPool) {
    let app = pipeline_tests::drain::app(pool.clone()).await;
    let original = pipeline_tests::drain::entity_event("rq-1", "cust-1", 1, "customer.updated");
    let body = original.body.clone();
    app.post(
        pipeline_tests::drain::ENTITIES,
        original.headers,
        &original.body,
    )
    .await;
    let drainer = standard_drainer(&pool);
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    let before = event(&pool, TENANT, "rq-1").await.unwrap();
    sqlx::query("DELETE FROM entities")
        .execute(&pool)
        .await
        .unwrap();
    // A pass that re-queues the lost effect but has no time left to drain it.
    let settings = ReconcileSettings {
        drain_for: Duration::ZERO,
        ..ReconcileSettings::default()
    };
    let ReconcileOutcome::Completed { repaired, .. } =
        reconcile::run_once(&pool, &drainer, &settings, "schedule")
            .await
            .unwrap()
    else {
        panic!("the pass was skipped");
    };
    assert_eq!(repaired.requeued, 1);

    let changed = pipeline_tests::drain::entity_event("rq-1", "cust-1", 2, "customer.updated");
    let reply = app
        .post(
            pipeline_tests::drain::ENTITIES,
            changed.headers,
            &changed.body,
        )
        .await;
    assert_eq!(reply.outcome(), "conflict");
    let during = event(&pool, TENANT, "rq-1").await.unwrap();
    assert_eq!(
        (during.payload.as_deref(), during.status.as_str()),
        (Some(&body[..]), "processed"),
        "the processed row was rewritten while re-queued"
    );
    assert_eq!(during.payload_sha256, before.payload_sha256);

    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    let (version, last_event): (i64, String) =
        sqlx::query_as("SELECT version, last_event_id FROM entities WHERE entity_id = 'cust-1'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((version, last_event.as_str()), (1, "rq-1"));
    let after = event(&pool, TENANT, "rq-1").await.unwrap();
    assert_eq!(
        (after.payload.as_deref(), after.status.as_str()),
        (Some(&body[..]), "processed")
    );
}

/// Shifts every time of the events, their outbox rows and the orders `days` into the past.
async fn age_days(pool: &PgPool, days: i32) {
    for sql in [
        "UPDATE webhook_events SET received_at = received_at - make_interval(days => $1), \
             first_received_at = first_received_at - make_interval(days => $1), \
             last_seen_at = last_seen_at - make_interval(days => $1), \
             processed_at = processed_at - make_interval(days => $1)",
        "UPDATE outbox SET created_at = created_at - make_interval(days => $1)",
        "UPDATE orders SET paid_at = paid_at - make_interval(days => $1), updated_at = updated_at - make_interval(days => $1)",
        "UPDATE entities SET updated_at = updated_at - make_interval(days => $1)",
    ] {
        sqlx::query(sql).bind(days).execute(pool).await.unwrap();
    }
}

/// A payment event on a Stripe source that reads entity versions (as the example source of
/// docs/configuration.md does): the payments handler writes no projection row.
fn versioned_payment(id: &str, order_id: &str, reference: &str, amount: i64) -> Delivery {
    let body = serde_json::json!({
        "id": id, "object": "event", "type": "payment_intent.succeeded",
        "data": {"object": {"id": format!("pi_{order_id}"), "object": "payment_intent", "version": 1,
            "amount": amount, "amount_received": amount, "currency": "eur",
            "metadata": {"order_id": order_id, "merchant_reference": reference}}}
    });
    resign(
        shared::domain::Scheme::Stripe,
        &secret_of(shared::domain::Scheme::Stripe),
        id,
        now(),
        http::HeaderMap::new(),
        serde_json::to_vec(&body).unwrap(),
    )
}

/// Reconcile expects of an event what that event's handler writes, so it converges: a payment
/// (no projection row, whatever the source reads) and deliveries after the identity purge (no
/// outbox row, by design) are never re-queued. Pass after pass finds and repairs nothing,
/// records no further anomaly, bumps no attempt, and once their payloads are purged nothing
/// becomes a dead letter.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn reconcile_converges_over_payments_and_redeliveries_after_the_identity_purge(pool: PgPool) {
    let app = pipeline_tests::drain::app(pool.clone()).await;
    let mut stripe = source(
        "stripe",
        TENANT,
        shared::domain::Scheme::Stripe,
        "secret/stripe",
    );
    stripe.fields.entity_version = Some(shared::domain::FieldLocator::json("/data/object/version"));
    shared::sources::apply(&pool, &[stripe]).await.unwrap();
    create_order(&pool, "ord-1", "REF-1", 700, "eur").await;
    let pay = versioned_payment("evt_pay", "ord-1", "REF-1", 700);
    let entity =
        pipeline_tests::drain::entity_event("old-entity", "cust-old", 4, "customer.updated");
    for (source, d) in [("stripe", &pay), (pipeline_tests::drain::ENTITIES, &entity)] {
        let reply = app.post(source, d.headers.clone(), &d.body).await;
        assert_eq!(reply.outcome(), "accepted", "{:?}", reply.json);
    }
    let drainer = standard_drainer(&pool);
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM orders WHERE state = 'paid'").await,
        1
    );

    let mut passes = Vec::new();
    passes.push(reconciled(&pool, &drainer).await);

    // Forty days on: the outbox delivered, retention purged both identities, and the provider
    // delivers both events again.
    age_days(&pool, 40).await;
    sqlx::query("UPDATE outbox SET status = 'delivered', delivered_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    let retention = shared::retention::RetentionSettings::default();
    let purged = shared::retention::run_once(&pool, &retention, "schedule")
        .await
        .unwrap();
    assert_eq!(purged.identities_purged, 2, "{purged:?}");
    for (source, d) in [("stripe", &pay), (pipeline_tests::drain::ENTITIES, &entity)] {
        let reply = app.post(source, d.headers.clone(), &d.body).await;
        assert_eq!(reply.outcome(), "accepted", "{:?}", reply.json);
    }
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    passes.push(reconciled(&pool, &drainer).await);
    passes.push(reconciled(&pool, &drainer).await);

    // A week later still: their payloads are purged too.
    age_days(&pool, 8).await;
    shared::retention::run_once(&pool, &retention, "schedule")
        .await
        .unwrap();
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM webhook_events WHERE payload IS NOT NULL"
        )
        .await,
        0
    );
    passes.push(reconciled(&pool, &drainer).await);
    passes.push(reconciled(&pool, &drainer).await);

    for (i, (found, repaired)) in passes.iter().enumerate() {
        assert_eq!(
            (
                found.missing_effects,
                found.missing_outbox,
                found.orphaned_pending,
                repaired.requeued
            ),
            (0, 0, 0, 0),
            "pass {i} found or repaired something in a consistent database: {found:?} {repaired:?}"
        );
    }
    let anomalies: Vec<String> = sqlx::query_scalar(
        "SELECT external_id FROM ingest_anomalies WHERE kind = 'redelivered_after_purge' ORDER BY external_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(anomalies, ["evt_pay", "old-entity"], "recorded once each");
    let rows: Vec<(String, String, i32)> = sqlx::query_as(
        "SELECT external_id, status, attempts FROM webhook_events ORDER BY external_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        [
            ("evt_pay".into(), "processed".into(), 1),
            ("old-entity".into(), "processed".into(), 1)
        ]
    );
    assert_eq!(scalar(&pool, "SELECT count(*) FROM dead_letters").await, 0);
    assert_eq!(scalar(&pool, "SELECT count(*) FROM outbox").await, 0);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM payment_exceptions").await,
        0
    );
    // The referential checks expect the same as reconcile: only the redelivery is news.
    let report = shared::anomaly::run_once(&pool, &Default::default(), "test")
        .await
        .unwrap();
    for check in [
        "processed_without_projection",
        "paid_orders_without_fulfilment",
    ] {
        assert!(
            !report.breaches.iter().any(|b| b == check),
            "{check}: {:?}",
            report.breaches
        );
    }
}

/// A processed event whose effect went missing after retention purged its payload cannot be
/// re-run: reconcile reports it, and neither re-queues it pass after pass nor turns it into a
/// dead letter.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_lost_effect_whose_payload_was_purged_is_reported_not_requeued(pool: PgPool) {
    let app = pipeline_tests::drain::app(pool.clone()).await;
    let d = pipeline_tests::drain::entity_event("gone-1", "cust-9", 2, "customer.updated");
    app.post(pipeline_tests::drain::ENTITIES, d.headers, &d.body)
        .await;
    let drainer = standard_drainer(&pool);
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    age_days(&pool, 8).await;
    shared::retention::run_once(&pool, &Default::default(), "schedule")
        .await
        .unwrap();
    sqlx::query("DELETE FROM entities")
        .execute(&pool)
        .await
        .unwrap();

    let (first, first_repaired) = reconciled(&pool, &drainer).await;
    let (second, second_repaired) = reconciled(&pool, &drainer).await;

    for (found, repaired) in [(&first, &first_repaired), (&second, &second_repaired)] {
        assert_eq!(
            (found.missing_effects, found.unrepairable, repaired.requeued),
            (1, 1, 0),
            "{found:?} {repaired:?}"
        );
    }
    let row = event(&pool, TENANT, "gone-1").await.unwrap();
    assert_eq!(row.status, "processed");
    assert_eq!(scalar(&pool, "SELECT count(*) FROM dead_letters").await, 0);
}

/// The app with one sequence source, `seq`, over the simulated provider at `base`.
async fn sequence_app(pool: &PgPool, base: &str, grace: Duration) -> TestApp {
    app(
        pool.clone(),
        &[provider_source("seq", sequence_strategy(), base, grace)],
    )
    .await
}

/// A sequence source for the simulated provider examining `window` numbers at a time.
fn windowed_source(base: &str, window: i64, grace: Duration) -> shared::sources::Source {
    let mut s = provider_source("seq", sequence_strategy(), base, grace);
    if let Some(gaps) = s.gaps.as_mut() {
        gaps.window = window;
    }
    s
}

async fn watermark(pool: &PgPool) -> i64 {
    scalar(pool, "SELECT contiguous_through FROM gap_watermarks").await
}

/// An operator tombstone as docs/operating.md writes it (no sequence): its sequence is resolved from
/// the source's id template, so its number is never flagged and the watermark passes it.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_operator_tombstone_without_a_sequence_lets_the_watermark_pass(pool: PgPool) {
    let provider = provider(50, vec![20]);
    let base = Arc::clone(&provider).serve().await;
    let app = app(
        pool.clone(),
        &[windowed_source(&base, 100_000, Duration::from_secs(3600))],
    )
    .await;
    let (deliveries, _) = provider.deliveries(plan(0.0, 7));
    deliver_all(&app, "seq", deliveries).await;
    let request = shared::operator::parse(serde_json::json!({
        "action": "tombstone", "tenant_id": TENANT, "source_id": "seq", "external_id": "evt_20",
        "reason": "deleted test event", "operator": "alice"
    }))
    .unwrap();
    shared::operator::handle(&pool, &EffectRegistry::standard(), request)
        .await
        .unwrap();

    let first = backfill_pass(&backfiller(&pool)).await;
    let second = backfill_pass(&backfiller(&pool)).await;

    assert_eq!(
        (
            first.new_candidates,
            second.new_candidates,
            first.waiting_grace
        ),
        (0, 0, 0),
        "{first:?} {second:?}"
    );
    assert_eq!(
        watermark(&pool).await,
        50,
        "the watermark passed the tombstone"
    );
    let sequence: Option<i64> = sqlx::query_scalar("SELECT sequence FROM tombstones")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(sequence, Some(20));
    assert!(provider.fetched().is_empty());

    // An ID that does not follow the source's template cannot be placed: refused.
    let stray = shared::operator::parse(serde_json::json!({
        "action": "tombstone", "tenant_id": TENANT, "source_id": "seq", "external_id": "charge_7",
        "reason": "typo", "operator": "alice"
    }))
    .unwrap();
    let refused = shared::operator::handle(&pool, &EffectRegistry::standard(), stray).await;
    assert!(
        matches!(refused, Err(shared::operator::OperatorError::BadRequest(ref why)) if why.contains("evt_{seq}")),
        "{refused:?}"
    );
}

/// A window with no rows below newer events is all gap: it is flagged and backfilled, and the
/// watermark moves past it instead of standing still.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_window_without_rows_does_not_stall_the_watermark(pool: PgPool) {
    let provider = provider(40, vec![]);
    let base = Arc::clone(&provider).serve().await;
    let app = app(pool.clone(), &[windowed_source(&base, 10, Duration::ZERO)]).await;
    let (deliveries, _) = provider.deliveries(plan(0.0, 8));
    let arrived: Vec<_> = deliveries
        .into_iter()
        .filter(|d| {
            let n: u64 = d.id.trim_start_matches("evt_").parse().unwrap();
            !(6..=25).contains(&n)
        })
        .collect();
    deliver_all(&app, "seq", arrived).await;

    for _ in 0..5 {
        backfill_pass(&backfiller(&pool)).await;
    }
    drain_all(&standard_drainer(&pool), &pool, Duration::from_secs(30)).await;

    assert_eq!(watermark(&pool).await, 40);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM webhook_events").await,
        40
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM webhook_events WHERE verified_with = 'provider_api'"
        )
        .await,
        20
    );
    assert_eq!(projection(&pool).await, provider.final_state());
}

/// While a gap waits out its grace period the watermark stands below it, but detection goes on
/// above `watermark + window`: later gaps are flagged (and start their own grace) meanwhile.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn gaps_beyond_the_window_are_found_while_the_watermark_waits(pool: PgPool) {
    let provider = provider(40, vec![]);
    let base = Arc::clone(&provider).serve().await;
    let app = app(
        pool.clone(),
        &[windowed_source(&base, 10, Duration::from_secs(3600))],
    )
    .await;
    let (deliveries, _) = provider.deliveries(plan(0.0, 9));
    deliver_all(
        &app,
        "seq",
        deliveries
            .into_iter()
            .filter(|d| d.id != "evt_3" && d.id != "evt_25")
            .collect(),
    )
    .await;

    let first = backfill_pass(&backfiller(&pool)).await;
    let candidates: Vec<String> =
        sqlx::query_scalar("SELECT external_id FROM gap_candidates ORDER BY sequence")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(candidates, ["evt_3", "evt_25"], "{first:?}");
    assert_eq!(watermark(&pool).await, 2);

    // An hour later both are past their grace: fetched, and the watermark reaches the top.
    sqlx::query("UPDATE gap_candidates SET first_seen_at = first_seen_at - interval '2 hours'")
        .execute(&pool)
        .await
        .unwrap();
    let later = backfill_pass(&backfiller(&pool)).await;
    assert_eq!((later.backfilled, later.errors), (2, 0), "{later:?}");
    assert_eq!(watermark(&pool).await, 40);
}

/// A drain batch's transaction may begin before a delivery commits and still process what it
/// brought: a conflicting delivery that replaces a pending event's payload (its `received_at`
/// moves on) between the batch's start and its claim. What the batch writes carries the time it
/// was written, never the transaction's start: no effect and no `processed_at` older than the
/// payload it came from. An event first received after the batch began is not claimed by it
/// (its queue row is ready from its receipt): the next batch takes it. Then the outbox rows
/// are lost, and reconcile restores them without reading either event as a redelivery after
/// the identity purge. The batch runs on one connection, open across the deliveries on others.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn effects_of_a_batch_begun_before_a_delivery_carry_their_own_time(pool: PgPool) {
    let app = pipeline_tests::drain::app(pool.clone()).await;
    let first = pipeline_tests::drain::entity_event("early-1", "cust-1", 1, "customer.updated");
    let reply = app
        .post(pipeline_tests::drain::ENTITIES, first.headers, &first.body)
        .await;
    assert_eq!(reply.outcome(), "accepted", "{:?}", reply.json);

    let mut batch = pool.begin().await.unwrap();
    let started: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *batch)
        .await
        .unwrap();
    let replaced = pipeline_tests::drain::entity_event("early-1", "cust-1", 2, "customer.updated");
    let reply = app
        .post(
            pipeline_tests::drain::ENTITIES,
            replaced.headers,
            &replaced.body,
        )
        .await;
    assert_eq!(reply.outcome(), "conflict", "{:?}", reply.json);
    let late = pipeline_tests::drain::entity_event("late-1", "cust-2", 1, "customer.updated");
    let reply = app
        .post(pipeline_tests::drain::ENTITIES, late.headers, &late.body)
        .await;
    assert_eq!(reply.outcome(), "accepted", "{:?}", reply.json);
    let received_after_start: i64 =
        sqlx::query_scalar("SELECT count(*) FROM webhook_events WHERE received_at > $1")
            .bind(started)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        received_after_start, 2,
        "both deliveries came after the batch began"
    );

    // The batch, as the drain runs it: claim, apply, complete, commit.
    let registry = EffectRegistry::standard();
    let claimed = shared::store::event_queue::claim(&mut batch, 10)
        .await
        .unwrap();
    let claimed_ids: Vec<&str> = claimed.iter().map(|e| e.external_id.as_str()).collect();
    assert_eq!(
        claimed_ids,
        ["early-1"],
        "an event received after the batch began waits"
    );
    let (mut tenants, mut ids, mut expects) = (Vec::new(), Vec::new(), Vec::new());
    for event in &claimed {
        let handler = registry.handler_for(event);
        let effects = handler.apply_all(&mut batch, &[event]).await.unwrap();
        assert_eq!(effects, [shared::effects::Effect::Applied]);
        tenants.push(event.tenant_id.clone());
        ids.push(event.external_id.clone());
        expects.push(handler.expects(event).as_str());
    }
    shared::store::event_queue::complete(&mut *batch, &tenants, &ids, &expects)
        .await
        .unwrap();
    batch.commit().await.unwrap();

    let (version, processed_in_time, changed_in_time): (i64, bool, bool) = sqlx::query_as(
        "SELECT x.version, e.processed_at >= e.received_at, x.updated_at >= e.received_at \
         FROM webhook_events AS e JOIN entities AS x ON x.last_event_id = e.external_id \
         WHERE e.external_id = 'early-1'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (version, processed_in_time, changed_in_time),
        (2, true, true),
        "processed, and the entity changed, after the payload they used arrived"
    );

    let drainer = standard_drainer(&pool);
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    sqlx::query("DELETE FROM outbox")
        .execute(&pool)
        .await
        .unwrap();
    let (found, repaired) = reconciled(&pool, &drainer).await;
    assert_eq!(
        (
            found.missing_outbox,
            repaired.requeued,
            repaired.drained.repairs
        ),
        (2, 2, 2),
        "the lost outbox rows are found and repaired: {found:?} {repaired:?}"
    );
    let restored: Vec<(String, String)> =
        sqlx::query_as("SELECT external_id, action FROM outbox ORDER BY external_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        restored,
        [
            ("early-1".to_owned(), "entity.changed".to_owned()),
            ("late-1".to_owned(), "entity.changed".to_owned())
        ]
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM ingest_anomalies WHERE kind = 'redelivered_after_purge'"
        )
        .await,
        0,
        "nothing was redelivered"
    );
}

/// The verdict's findings as (kind, count), as `hookctl status --json` shows them.
async fn verdict(pool: &PgPool) -> (String, Vec<(String, i64)>) {
    let report = shared::status::report(pool, &Default::default())
        .await
        .unwrap();
    let json = serde_json::to_value(&report).unwrap();
    let findings = json["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["kind"].as_str().unwrap().to_owned(),
                f["count"].as_i64().unwrap(),
            )
        })
        .collect();
    (json["verdict"].as_str().unwrap().to_owned(), findings)
}

/// A two-day-old processed event whose entity row was deleted and whose payload was purged is
/// a loss nothing can repair: reconcile finds it, and `status` must not read "every event
/// accounted for" (the one-day anomaly check no longer sees it). Once a newer change restores
/// the entity, the next pass finds the event consistent and the verdict clears.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_unrepairable_loss_keeps_the_verdict_from_accounted_for(pool: PgPool) {
    let app = pipeline_tests::drain::app(pool.clone()).await;
    let d = pipeline_tests::drain::entity_event("lost-1", "cust-9", 2, "customer.updated");
    app.post(pipeline_tests::drain::ENTITIES, d.headers, &d.body)
        .await;
    let drainer = standard_drainer(&pool);
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    sqlx::query("UPDATE outbox SET status = 'delivered', delivered_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    age_days(&pool, 2).await;
    let retention = shared::retention::RetentionSettings {
        payload_after: Duration::from_secs(24 * 3600),
        ..Default::default()
    };
    let purged = shared::retention::run_once(&pool, &retention, "schedule")
        .await
        .unwrap();
    assert_eq!(purged.payloads_purged, 1, "{purged:?}");
    sqlx::query("DELETE FROM entities")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        verdict(&pool).await.0,
        "accounted_for",
        "nothing checked yet"
    );

    let (found, _) = reconciled(&pool, &drainer).await;
    assert_eq!(
        (found.missing_effects, found.unrepairable),
        (1, 1),
        "{found:?}"
    );
    shared::anomaly::run_once(&pool, &Default::default(), "test")
        .await
        .unwrap();

    assert_eq!(
        verdict(&pool).await,
        (
            "needs_attention".to_owned(),
            vec![("unrepaired_losses".to_owned(), 1)]
        )
    );
    reconciled(&pool, &drainer).await;
    assert_eq!(
        verdict(&pool).await.1,
        [("unrepaired_losses".to_owned(), 1)],
        "the next pass finds it again: counted once"
    );

    let newer = pipeline_tests::drain::entity_event("lost-2", "cust-9", 3, "customer.updated");
    app.post(pipeline_tests::drain::ENTITIES, newer.headers, &newer.body)
        .await;
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    reconciled(&pool, &drainer).await;
    assert_eq!(
        verdict(&pool).await,
        ("accounted_for".to_owned(), vec![]),
        "the entity holds a newer version: nothing is lost any more"
    );
}

/// A repair that fails (the stored payload no longer reads) leaves the event as it was: the
/// verdict names it until a later repair succeeds.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_failed_repair_keeps_the_verdict_from_accounted_for(pool: PgPool) {
    let app = pipeline_tests::drain::app(pool.clone()).await;
    let d = pipeline_tests::drain::entity_event("bad-1", "cust-7", 1, "customer.updated");
    app.post(pipeline_tests::drain::ENTITIES, d.headers, &d.body)
        .await;
    let drainer = standard_drainer(&pool);
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    sqlx::query("UPDATE outbox SET status = 'delivered', delivered_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM entities")
        .execute(&pool)
        .await
        .unwrap();
    let original: Vec<u8> = sqlx::query_scalar("SELECT payload FROM webhook_events")
        .fetch_one(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE webhook_events SET payload = '\\xff'::bytea")
        .execute(&pool)
        .await
        .unwrap();

    let (found, repaired) = reconciled(&pool, &drainer).await;
    assert_eq!(
        (
            found.missing_effects,
            repaired.requeued,
            repaired.drained.repairs_failed
        ),
        (1, 1, 1),
        "{found:?} {repaired:?}"
    );
    assert_eq!(
        verdict(&pool).await,
        (
            "needs_attention".to_owned(),
            vec![("unrepaired_losses".to_owned(), 1)]
        )
    );

    sqlx::query("UPDATE webhook_events SET payload = $1")
        .bind(&original)
        .execute(&pool)
        .await
        .unwrap();
    let (_, repaired) = reconciled(&pool, &drainer).await;
    assert_eq!(repaired.drained.repairs, 1, "{repaired:?}");
    assert_eq!(verdict(&pool).await, ("accounted_for".to_owned(), vec![]));
}

async fn payload_of(pool: &PgPool, external_id: &str) -> Option<Vec<u8>> {
    sqlx::query_scalar("SELECT payload FROM webhook_events WHERE external_id = $1")
        .bind(external_id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// An event still pending when a payload pass walks past it (its drain retrying with backoff,
/// or an operator's replay) loses its payload on a later pass once it is processed: after the
/// payload horizon, not at the identity purge three weeks later.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_event_pending_during_a_payload_pass_has_its_payload_purged_once_processed(
    pool: PgPool,
) {
    use pipeline_tests::drain::{Instrumented, create_application_log, registry_with};
    let app = pipeline_tests::drain::app(pool.clone()).await;
    create_application_log(&pool).await;
    let mut handler = Instrumented::new(Arc::new(shared::effects::entity::EntityProjection));
    handler.poison = vec!["cust-late".into()];
    let handler = Arc::new(handler);
    let drainer = Drainer::new(
        pool.clone(),
        registry_with(handler.clone()),
        shared::drain::DrainSettings {
            backoff_base: Duration::from_secs(3600),
            backoff_cap: Duration::from_secs(3600),
            ..pipeline_tests::drain::fast_settings()
        },
    );
    let mut bodies = BTreeMap::new();
    for (id, entity) in [
        ("early", "cust-early"),
        ("late", "cust-late"),
        ("after", "cust-after"),
    ] {
        let d = pipeline_tests::drain::entity_event(id, entity, 1, "customer.updated");
        let reply = app
            .post(pipeline_tests::drain::ENTITIES, d.headers, &d.body)
            .await;
        assert_eq!(reply.outcome(), "accepted");
        bodies.insert(id, d.body);
    }
    // "late" fails and waits out an hour's backoff; the others are processed.
    drainer
        .drain_until(std::time::Instant::now() + Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(
        event(&pool, TENANT, "late").await.unwrap().status,
        "pending"
    );
    // Ten days on, "late" still waits in the queue when retention runs.
    sqlx::query("UPDATE webhook_events SET received_at = received_at - interval '10 days', first_received_at = first_received_at - interval '10 days', last_seen_at = last_seen_at - interval '10 days'")
        .execute(&pool)
        .await
        .unwrap();
    let settings = shared::retention::RetentionSettings::default();
    let first = shared::retention::run_once(&pool, &settings, "schedule")
        .await
        .unwrap();
    assert_eq!(first.payloads_purged, 2, "{first:?}");
    assert_eq!(payload_of(&pool, "early").await, None);
    assert_eq!(payload_of(&pool, "after").await, None);
    assert_eq!(
        payload_of(&pool, "late").await.as_deref(),
        Some(&bodies["late"][..]),
        "a pending event keeps its payload: the drain needs it"
    );

    // The handler is fixed and the retry comes due: the drain processes it, and the next
    // pass purges its payload.
    handler
        .broken
        .store(false, std::sync::atomic::Ordering::SeqCst);
    sqlx::query("UPDATE event_queue SET ready_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    assert_eq!(
        event(&pool, TENANT, "late").await.unwrap().status,
        "processed"
    );
    let second = shared::retention::run_once(&pool, &settings, "schedule")
        .await
        .unwrap();
    assert_eq!(
        payload_of(&pool, "late").await,
        None,
        "a processed event past the payload horizon kept its payload: {second:?}"
    );
    assert_eq!(second.payloads_purged, 1, "{second:?}");
    let third = shared::retention::run_once(&pool, &settings, "schedule")
        .await
        .unwrap();
    assert_eq!(third, shared::retention::RetentionOutcome::default());
}

/// A dead letter holds its event only while it is open: once replayed or discarded, the event
/// ages out at the identity horizon like any other, and its closed letter with it; an open
/// letter keeps its event however old.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn closed_dead_letters_let_their_events_age_out_and_an_open_one_keeps_its_event(
    pool: PgPool,
) {
    use pipeline_tests::drain::{Instrumented, create_application_log, registry_with};
    let app = pipeline_tests::drain::app(pool.clone()).await;
    create_application_log(&pool).await;
    let mut handler = Instrumented::new(Arc::new(shared::effects::entity::EntityProjection));
    handler.poison = vec!["p-open".into(), "p-replayed".into(), "p-discarded".into()];
    handler.fatal = true;
    let handler = Arc::new(handler);
    let registry = registry_with(handler.clone());
    let drainer = pipeline_tests::drain::drainer(&pool, registry.clone());
    for (id, entity) in [
        ("dl-open", "p-open"),
        ("dl-replayed", "p-replayed"),
        ("dl-discarded", "p-discarded"),
    ] {
        let d = pipeline_tests::drain::entity_event(id, entity, 1, "thing.updated");
        let reply = app
            .post(pipeline_tests::drain::ENTITIES, d.headers, &d.body)
            .await;
        assert_eq!(reply.outcome(), "accepted");
    }
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    let letter = |external_id: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT dead_letter_id FROM dead_letters WHERE external_id = $1",
            )
            .bind(external_id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert!(
        shared::store::dead_letters::set_status(&pool, letter("dl-discarded").await, "discarded")
            .await
            .unwrap()
    );
    handler
        .broken
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let replayed = shared::drain::replay(
        &pool,
        &registry,
        &shared::store::dead_letters::ReplayFilter {
            ids: vec![letter("dl-replayed").await],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(replayed.replayed, 1, "{replayed:?}");

    // Forty days on, with the outbox delivered.
    for sql in [
        "UPDATE webhook_events SET received_at = received_at - interval '40 days', first_received_at = first_received_at - interval '40 days', last_seen_at = last_seen_at - interval '40 days'",
        "UPDATE dead_letters SET created_at = created_at - interval '40 days', updated_at = updated_at - interval '40 days', replayed_at = replayed_at - interval '40 days'",
        "UPDATE outbox SET status = 'delivered', delivered_at = now()",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    let purged = shared::retention::run_once(&pool, &Default::default(), "schedule")
        .await
        .unwrap();
    assert_eq!(purged.identities_purged, 2, "{purged:?}");
    let events: Vec<String> =
        sqlx::query_scalar("SELECT external_id FROM webhook_events ORDER BY external_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(events, ["dl-open"], "only the open letter's event is kept");
    let letters: Vec<(String, String)> =
        sqlx::query_as("SELECT external_id, status FROM dead_letters ORDER BY external_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(letters, [("dl-open".to_owned(), "new".to_owned())]);
    assert_eq!(purged.closed_dead_letters_purged, 2, "{purged:?}");
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_gap_waits_while_the_buffer_holds_deliveries(pool: PgPool) {
    let provider = provider(20, vec![]);
    let base = Arc::clone(&provider).serve().await;
    let app = app(
        pool.clone(),
        &[provider_source(
            "by-sequence",
            sequence_strategy(),
            &base,
            Duration::ZERO,
        )],
    )
    .await;
    let (deliveries, _) = provider.deliveries(plan(0.0, 3));
    // evt_7 is still in the buffer: the consumer has not filed it yet.
    let deliveries: Vec<_> = deliveries.into_iter().filter(|d| d.id != "evt_7").collect();
    deliver_all(&app, "by-sequence", deliveries).await;
    let buffer = pipeline_tests::buffer::new_buffer_queue(5, 30).await;
    let held = shared::buffer::BufferedDelivery {
        envelope: shared::buffer::Envelope {
            v: shared::buffer::ENVELOPE_VERSION,
            delivery_id: "d-evt-7".into(),
            verified_layout: None,
            source_id: "by-sequence".into(),
            received_at_micros: now() * 1_000_000,
            verified_with: "current".into(),
            headers: Default::default(),
            signed_headers: vec![],
            signed_digest: None,
            element_digests: Vec::new(),
        },
        body: b"{}".to_vec(),
    };
    buffer.send(held).await.unwrap();

    let holding = backfiller(&pool).with_buffer(buffer.clone());
    let outcome = backfill_pass(&holding).await;
    assert_eq!(outcome.buffered_deliveries, 1);
    assert_eq!(outcome.new_candidates, 1, "the gap is seen: {outcome:?}");
    assert_eq!(
        (outcome.fetched, outcome.backfilled, outcome.tombstoned),
        (0, 0, 0),
        "but not judged while the buffer may hold it"
    );
    assert_eq!(outcome.waiting_grace, 1);

    // The buffer empties (its delivery filed elsewhere, or gone): the gap is judged.
    let url = buffer.queue_url().to_owned();
    for m in buffer.receive_from(&url, 10, 30, 1).await.unwrap() {
        buffer.delete_from(&url, &m.receipt_handle).await.unwrap();
    }
    let outcome = backfill_pass(&holding).await;
    assert_eq!(outcome.buffered_deliveries, 0);
    assert_eq!((outcome.fetched, outcome.backfilled), (1, 1), "{outcome:?}");
}
