//! The drain against a real PostgreSQL: exactly-once effects under concurrency, kills, poison
//! events, replays and redeliveries.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http::StatusCode;
use pipeline_tests::drain::*;
use pipeline_tests::*;
use shared::drain::Drainer;
use shared::effects::EffectRegistry;
use shared::effects::entity::EntityProjection;
use shared::store::dead_letters::ReplayFilter;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

async fn deliver(app: &TestApp, d: Delivery) -> Reply {
    let source = if d.headers.contains_key("stripe-signature") {
        "stripe"
    } else {
        ENTITIES
    };
    let reply = app.post(source, d.headers, &d.body).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json);
    reply
}

#[derive(Debug, sqlx::FromRow)]
struct Entity {
    version: i64,
    deleted: bool,
    state: serde_json::Value,
    last_event_id: String,
}

async fn entity(pool: &PgPool, id: &str) -> Option<Entity> {
    sqlx::query_as("SELECT version, deleted, state, last_event_id FROM entities WHERE tenant_id = $1 AND entity_id = $2")
        .bind(TENANT)
        .bind(id)
        .fetch_optional(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_accepted_event_is_queued_processed_and_announced_once(pool: PgPool) {
    let app = app(pool.clone()).await;
    deliver(&app, entity_event("e1", "cust-1", 1, "customer.created")).await;
    assert_eq!(
        queue_len(&pool).await,
        1,
        "accepted means queued, in the same statement"
    );

    let drainer = standard_drainer(&pool);
    let outcome = drain_all(&drainer, &pool, Duration::from_secs(10)).await;

    assert_eq!(
        (
            outcome.claimed,
            outcome.processed,
            outcome.retried,
            outcome.dead_lettered
        ),
        (1, 1, 0, 0)
    );
    let row = event(&pool, TENANT, "e1").await.unwrap();
    assert_eq!(row.status, "processed");
    let e = entity(&pool, "cust-1").await.unwrap();
    assert_eq!(
        (e.version, e.deleted, e.last_event_id.as_str()),
        (1, false, "e1")
    );
    assert_eq!(e.state["data"]["name"], "cust-1 v1");
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE action = 'entity.changed'"
        )
        .await,
        1
    );
    assert_eq!(queue_len(&pool).await, 0);
}

/// (b) A delete is a versioned soft delete; a late update never resurrects the entity.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn deletes_are_not_resurrected_by_late_updates(pool: PgPool) {
    let app = app(pool.clone()).await;
    let drainer = standard_drainer(&pool);
    for (id, version, kind) in [
        ("c1", 1, "customer.created"),
        ("c3", 3, "customer.deleted"),
        ("c2", 2, "customer.updated"),
    ] {
        deliver(&app, entity_event(id, "cust-9", version, kind)).await;
        drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    }
    let e = entity(&pool, "cust-9").await.unwrap();
    assert_eq!(
        (e.version, e.deleted, e.last_event_id.as_str()),
        (3, true, "c3")
    );
    assert_eq!(
        e.state["data"]["version"], 1,
        "the delete keeps the last state it saw"
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM entities").await,
        1,
        "never physically deleted, never duplicated"
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM webhook_events WHERE status = 'processed'"
        )
        .await,
        3
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM outbox").await,
        2,
        "the stale update announces nothing"
    );
}

/// (c) Four drainers, each with its own pool, over 10,000 events.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn four_concurrent_drainers_process_ten_thousand_events_exactly_once(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let admin = admin_with_bulk_events(pool_options, &connect, 10_000).await;
    let registry = registry_with(Arc::new(Instrumented::new(Arc::new(EntityProjection))));

    let tasks: Vec<_> = (0..4)
        .map(|i| {
            let connect = connect.clone().application_name(&format!("drainer-{i}"));
            let registry = registry.clone();
            tokio::spawn(async move {
                let pool = PgPoolOptions::new()
                    .max_connections(2)
                    .connect_with(connect)
                    .await
                    .unwrap();
                let drainer = Drainer::new(pool.clone(), registry, fast_settings());
                drain_all(&drainer, &pool, Duration::from_secs(120)).await
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap());
    }

    let processed: u64 = outcomes.iter().map(|o| o.processed).sum();
    assert_eq!(processed, 10_000, "{outcomes:?}");
    assert!(
        outcomes
            .iter()
            .all(|o| o.retried == 0 && o.dead_lettered == 0),
        "no deadlocks, no retries: {outcomes:?}"
    );
    assert!(
        outcomes.iter().filter(|o| o.processed > 0).count() >= 2,
        "the work was shared: {outcomes:?}"
    );
    assert_eq!(
        application_counts(&admin).await,
        (1, 1, 10_000),
        "every effect committed exactly once"
    );
    assert_eq!(
        scalar(
            &admin,
            "SELECT count(*) FROM webhook_events WHERE status = 'processed'"
        )
        .await,
        10_000
    );
    assert_eq!(
        scalar(&admin, "SELECT count(*) FROM entities").await,
        10_000
    );
    assert_eq!(
        scalar(&admin, "SELECT count(*) FROM outbox").await,
        10_000,
        "one outbox row per effect"
    );
    assert_eq!(
        scalar(
            &admin,
            "SELECT count(DISTINCT (tenant_id, external_id)) FROM outbox"
        )
        .await,
        10_000
    );
    assert_eq!(queue_len(&admin).await, 0);
}

/// (d) A drainer whose connection is killed mid-batch loses nothing and doubles nothing.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_drainer_killed_mid_batch_loses_and_doubles_nothing(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let admin = admin_with_bulk_events(pool_options, &connect, 300).await;

    // The victim's handler stops after its 10th application until the test releases it.
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel();
    let release = Arc::new(tokio::sync::Notify::new());
    let victim_registry = Arc::new(EffectRegistry::new(Arc::new(Gate {
        inner: Instrumented::new(Arc::new(EntityProjection)),
        calls: Default::default(),
        stop_after: 10,
        entered: std::sync::Mutex::new(Some(entered_tx)),
        release: release.clone(),
    })));
    let victim_pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(connect.clone().application_name("victim"))
        .await
        .unwrap();
    let victim = Drainer::new(victim_pool, victim_registry, fast_settings());
    let victim_run = tokio::spawn(async move { victim.run_once().await });

    entered_rx.await.unwrap();
    let killed: i64 = sqlx::query_scalar("SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'victim') AS k")
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(killed, 1);
    release.notify_one();
    let victim_result = victim_run.await.unwrap();
    assert!(
        victim_result.is_err(),
        "the killed batch must fail, not report success: {victim_result:?}"
    );
    assert_eq!(
        application_counts(&admin).await.2,
        0,
        "nothing of the killed batch committed"
    );

    let survivor_pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(connect)
        .await
        .unwrap();
    let registry = registry_with(Arc::new(Instrumented::new(Arc::new(EntityProjection))));
    let survivor = Drainer::new(survivor_pool.clone(), registry, fast_settings());
    let outcome = drain_all(&survivor, &survivor_pool, Duration::from_secs(60)).await;

    assert_eq!(outcome.processed, 300);
    assert_eq!(application_counts(&admin).await, (1, 1, 300));
    assert_eq!(scalar(&admin, "SELECT count(*) FROM outbox").await, 300);
    assert_eq!(
        scalar(
            &admin,
            "SELECT count(*) FROM webhook_events WHERE status = 'processed'"
        )
        .await,
        300
    );
}

struct Gate {
    inner: Instrumented,
    calls: std::sync::atomic::AtomicUsize,
    stop_after: usize,
    entered: std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    release: Arc<tokio::sync::Notify>,
}

impl shared::effects::EffectHandler for Gate {
    fn name(&self) -> &'static str {
        "gate"
    }

    fn apply<'a>(
        &'a self,
        conn: &'a mut sqlx::PgConnection,
        event: &'a shared::store::event_queue::ClaimedEvent,
    ) -> shared::effects::EffectFuture<'a> {
        Box::pin(async move {
            if self.calls.fetch_add(1, Ordering::SeqCst) == self.stop_after {
                if let Some(tx) = self.entered.lock().unwrap().take() {
                    let _ = tx.send(());
                }
                self.release.notified().await;
            }
            self.inner.apply(conn, event).await
        })
    }
}

/// (e) A poison event is dead-lettered after its attempt budget while the rest drains.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_poison_event_is_dead_lettered_after_its_budget_while_the_queue_drains(pool: PgPool) {
    let app = app(pool.clone()).await;
    create_application_log(&pool).await;
    let mut handler = Instrumented::new(Arc::new(EntityProjection));
    handler.poison = vec!["poison".into()];
    let drainer = drainer(&pool, registry_with(Arc::new(handler)));
    deliver(&app, entity_event("bad-1", "poison", 1, "thing.updated")).await;
    for i in 0..60 {
        deliver(
            &app,
            entity_event(
                &format!("ok-{i}"),
                &format!("thing-{i}"),
                1,
                "thing.updated",
            ),
        )
        .await;
    }

    let outcome = drain_all(&drainer, &pool, Duration::from_secs(30)).await;

    assert_eq!(
        (outcome.processed, outcome.dead_lettered),
        (60, 1),
        "{outcome:?}"
    );
    assert_eq!(
        outcome.retried, 2,
        "three attempts: two retries, then the dead letter"
    );
    let poison = event(&pool, TENANT, "bad-1").await.unwrap();
    assert_eq!(poison.status, "dead_lettered");
    #[derive(sqlx::FromRow)]
    struct Letter {
        source_id: String,
        event_type: String,
        payload: Option<Vec<u8>>,
        headers: serde_json::Value,
        error: String,
        reason: String,
        attempts: i32,
        status: String,
    }
    let letters: Vec<Letter> = sqlx::query_as("SELECT * FROM dead_letters")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(letters.len(), 1);
    let l = &letters[0];
    assert_eq!(
        (
            l.source_id.as_str(),
            l.event_type.as_str(),
            l.reason.as_str(),
            l.attempts,
            l.status.as_str()
        ),
        (ENTITIES, "thing.updated", "exhausted", 3, "new")
    );
    assert_eq!(l.payload, poison.payload);
    assert!(l.headers["webhook-signature"].is_string());
    assert!(l.error.contains("poison entity"), "{}", l.error);
    assert_eq!(application_counts(&pool).await, (1, 1, 60));
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_fatal_failure_is_dead_lettered_at_once(pool: PgPool) {
    let app = app(pool.clone()).await;
    create_application_log(&pool).await;
    let mut handler = Instrumented::new(Arc::new(EntityProjection));
    handler.poison = vec!["rejected".into()];
    handler.fatal = true;
    let drainer = drainer(&pool, registry_with(Arc::new(handler)));
    deliver(
        &app,
        entity_event("fatal-1", "rejected", 1, "thing.updated"),
    )
    .await;

    let outcome = drain_all(&drainer, &pool, Duration::from_secs(10)).await;

    assert_eq!((outcome.retried, outcome.dead_lettered), (0, 1));
    let (reason, attempts): (String, i32) =
        sqlx::query_as("SELECT reason, attempts FROM dead_letters")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((reason.as_str(), attempts), ("fatal", 1));
}

/// (f) A replay after the fix processes once; a second replay is a no-op; a failed replay
/// keeps the letter open with the new error.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn replay_after_a_fix_processes_once_and_a_second_replay_is_a_no_op(pool: PgPool) {
    let app = app(pool.clone()).await;
    create_application_log(&pool).await;
    let (handler, registry, drainer) = poisoned_drain(&pool, "flaky");
    deliver(&app, entity_event("r-1", "flaky", 1, "thing.updated")).await;
    deliver(&app, entity_event("r-2", "steady", 1, "thing.updated")).await;
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    let filter = ReplayFilter {
        error_contains: Some("POISON".into()),
        ..ReplayFilter::default()
    };

    // Still broken: the replay fails and the letter stays open with the new error.
    let failed = shared::drain::replay(&pool, &registry, &filter)
        .await
        .unwrap();
    assert_eq!((failed.selected, failed.replayed, failed.failed), (1, 0, 1));
    let (status, replays): (String, i32) =
        sqlx::query_as("SELECT status, replay_count FROM dead_letters")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((status.as_str(), replays), ("new", 1));

    handler.broken.store(false, Ordering::SeqCst);
    let fixed = shared::drain::replay(&pool, &registry, &filter)
        .await
        .unwrap();
    assert_eq!((fixed.selected, fixed.replayed, fixed.failed), (1, 1, 0));
    let again = shared::drain::replay(&pool, &registry, &filter)
        .await
        .unwrap();
    assert_eq!((again.selected, again.replayed), (0, 0));

    assert_eq!(
        event(&pool, TENANT, "r-1").await.unwrap().status,
        "processed"
    );
    let (status, replayed_at_set): (String, bool) =
        sqlx::query_as("SELECT status, replayed_at IS NOT NULL FROM dead_letters")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((status.as_str(), replayed_at_set), ("replayed", true));
    assert_eq!(entity(&pool, "flaky").await.unwrap().version, 1);
    assert_eq!(
        application_counts(&pool).await,
        (1, 1, 2),
        "r-1 applied once, by the replay"
    );
    assert_eq!(scalar(&pool, "SELECT count(*) FROM outbox").await, 2);
}

/// (g) An amount mismatch records an exception and produces no fulfilment; a matching payment
/// pays once; a second payment for a paid order is an exception too.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn payments_pay_once_and_never_on_a_mismatch(pool: PgPool) {
    let app = app(pool.clone()).await;
    let drainer = standard_drainer(&pool);
    create_order(&pool, "ord-1", "REF-1", 5000, "eur").await;
    create_order(&pool, "ord-2", "REF-2", 1200, "eur").await;

    deliver(&app, payment("evt_short", "ord-1", "REF-1", 4999, "eur")).await;
    deliver(&app, payment("evt_ok", "ord-2", "REF-2", 1200, "EUR")).await;
    deliver(&app, payment("evt_again", "ord-2", "REF-2", 1200, "eur")).await;
    deliver(&app, payment("evt_ghost", "ord-404", "REF-X", 100, "eur")).await;
    deliver(
        &app,
        payment("evt_wrong_ref", "ord-1", "REF-9", 5000, "eur"),
    )
    .await;
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;

    let states: Vec<(String, String, Option<String>)> =
        sqlx::query_as("SELECT order_id, state, paid_by_event FROM orders ORDER BY order_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        states,
        [
            ("ord-1".into(), "awaiting_payment".into(), None),
            ("ord-2".into(), "paid".into(), Some("evt_ok".into()))
        ]
    );
    let exceptions: Vec<(String, String)> =
        sqlx::query_as("SELECT external_id, kind FROM payment_exceptions ORDER BY external_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        exceptions,
        [
            ("evt_again".into(), "already_paid".into()),
            ("evt_ghost".into(), "unknown_order".into()),
            ("evt_short".into(), "amount_mismatch".into()),
            ("evt_wrong_ref".into(), "reference_mismatch".into()),
        ]
    );
    let outbox: Vec<(String, String, serde_json::Value)> =
        sqlx::query_as("SELECT external_id, action, payload FROM outbox")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        outbox.len(),
        1,
        "only the matching payment is fulfilled: {outbox:?}"
    );
    assert_eq!(
        (outbox[0].0.as_str(), outbox[0].1.as_str()),
        ("evt_ok", "fulfil_order")
    );
    assert_eq!(outbox[0].2["amount_minor"], 1200);
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM webhook_events WHERE status = 'processed'"
        )
        .await,
        5
    );
}

/// The outbox keeps no unique index on the Idempotency-Key: a key is the digest of its row's
/// (tenant, event, action), which the outbox admits once, so keys are unique by construction.
/// Every path that writes the outbox (the projection, fulfilment, reconcile's re-announcement
/// of a lost row) must keep deriving them that way.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn every_outbox_key_is_the_digest_of_its_tenant_event_and_action(pool: PgPool) {
    let app = app(pool.clone()).await;
    let drainer = standard_drainer(&pool);
    create_order(&pool, "ord-1", "REF-1", 500, "eur").await;
    deliver(&app, entity_event("k-1", "a", 1, "thing.updated")).await;
    deliver(&app, entity_event("k-2", "b", 1, "thing.updated")).await;
    deliver(&app, payment("k-3", "ord-1", "REF-1", 500, "eur")).await;
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    // Two announcements are lost; reconcile writes them again.
    sqlx::query("DELETE FROM outbox WHERE external_id IN ('k-2', 'k-3')")
        .execute(&pool)
        .await
        .unwrap();
    shared::reconcile::run_once(&pool, &drainer, &Default::default(), "test")
        .await
        .unwrap();
    assert_eq!(scalar(&pool, "SELECT count(*) FROM event_queue").await, 0);

    let rows: Vec<(String, String, String, String)> = sqlx::query_as(
        "SELECT tenant_id, external_id, action, idempotency_key FROM outbox ORDER BY external_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let written: Vec<(&str, &str)> = rows
        .iter()
        .map(|(_, event, action, _)| (event.as_str(), action.as_str()))
        .collect();
    assert_eq!(
        written,
        [
            ("k-1", "entity.changed"),
            ("k-2", "entity.changed"),
            ("k-3", "fulfil_order")
        ]
    );
    for (tenant, event, action, key) in &rows {
        assert_eq!(
            key,
            &shared::effects::outbox_key(tenant, event, action),
            "the key of {event}'s {action}"
        );
    }
}

/// (h) Our 2xx was lost after the commit: the provider redelivers; the redelivery is a
/// duplicate and nothing happens twice. Likewise a drain invocation retried after it committed.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_redelivery_after_commit_is_a_duplicate_with_no_second_effect(pool: PgPool) {
    let app = app(pool.clone()).await;
    let drainer = standard_drainer(&pool);
    create_order(&pool, "ord-7", "REF-7", 990, "usd").await;
    let first = payment("evt_lost_ack", "ord-7", "REF-7", 990, "usd");
    let again = Delivery {
        headers: first.headers.clone(),
        body: first.body.clone(),
    };
    deliver(&app, first).await;
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;

    assert_eq!(deliver(&app, again).await.outcome(), "duplicate");
    let retried_invocation = drainer
        .drain_until(std::time::Instant::now() + Duration::from_secs(5))
        .await
        .unwrap();

    assert_eq!(retried_invocation.claimed, 0);
    assert_eq!(queue_len(&pool).await, 0);
    assert_eq!(scalar(&pool, "SELECT count(*) FROM outbox").await, 1);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM payment_exceptions").await,
        0
    );
    let row = event(&pool, TENANT, "evt_lost_ack").await.unwrap();
    assert_eq!((row.status.as_str(), row.delivery_count), ("processed", 2));
}

/// A delivery that conflicts with an event being processed waits for the drain's commit and
/// then finds it processed: the processed payload is never rewritten.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_conflicting_delivery_during_processing_never_rewrites_the_processed_payload(
    pool: PgPool,
) {
    let app = app(pool.clone()).await;
    let original = entity_event("race-1", "thing-r", 1, "thing.updated");
    deliver(
        &app,
        Delivery {
            headers: original.headers.clone(),
            body: original.body.clone(),
        },
    )
    .await;
    let drainer = standard_drainer(&pool);
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    let changed = entity_event("race-1", "thing-r", 2, "thing.updated");
    assert_eq!(deliver(&app, changed).await.outcome(), "conflict");
    assert_eq!(
        event(&pool, TENANT, "race-1")
            .await
            .unwrap()
            .payload
            .as_deref(),
        Some(&original.body[..])
    );
    assert_eq!(
        queue_len(&pool).await,
        0,
        "a conflict does not queue the event again"
    );
}

/// A dead letter stays replayable for as long as it is open: retention purges payloads of
/// finished events after 7 days, but the letter keeps what its replay needs. Once the letter is
/// closed, its own copy of the payload goes the same way.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_dead_letter_older_than_the_payload_horizon_is_still_replayable(pool: PgPool) {
    let app = app(pool.clone()).await;
    create_application_log(&pool).await;
    let mut handler = Instrumented::new(Arc::new(EntityProjection));
    handler.poison = vec!["poison".into()];
    handler.fatal = true;
    let handler = Arc::new(handler);
    let registry = registry_with(handler.clone());
    let drainer = drainer(&pool, registry.clone());
    let poison = entity_event("dl-1", "poison", 3, "thing.updated");
    let body = poison.body.clone();
    deliver(&app, poison).await;
    deliver(&app, entity_event("ok-1", "steady", 1, "thing.updated")).await;
    drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    assert_eq!(
        event(&pool, TENANT, "dl-1").await.unwrap().status,
        "dead_lettered"
    );

    // Eight days later, retention has run; then the handler is fixed.
    for sql in [
        "UPDATE webhook_events SET received_at = received_at - interval '8 days', \
             first_received_at = first_received_at - interval '8 days', last_seen_at = last_seen_at - interval '8 days'",
        "UPDATE dead_letters SET created_at = created_at - interval '8 days', updated_at = updated_at - interval '8 days'",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    let retention = shared::retention::RetentionSettings::default();
    let purged = shared::retention::run_once(&pool, &retention, "schedule")
        .await
        .unwrap();
    assert_eq!(purged.payloads_purged, 2, "{purged:?}");
    handler.broken.store(false, Ordering::SeqCst);

    let replay = shared::drain::replay(&pool, &registry, &ReplayFilter::default())
        .await
        .unwrap();

    let error: String = sqlx::query_scalar("SELECT error FROM dead_letters")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        (replay.selected, replay.replayed, replay.failed),
        (1, 1, 0),
        "the letter could not be replayed: {error}"
    );
    let e = entity(&pool, "poison").await.unwrap();
    assert_eq!((e.version, e.last_event_id.as_str()), (3, "dl-1"));
    assert_eq!(e.state["data"]["name"], "poison v3");
    assert_eq!(
        event(&pool, TENANT, "dl-1").await.unwrap().status,
        "processed"
    );

    // Closed now: a week after the replay, the letter's copy of the payload is purged too.
    let (letter_payload,): (Option<Vec<u8>>,) = sqlx::query_as("SELECT payload FROM dead_letters")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(letter_payload.as_deref(), Some(&body[..]));
    sqlx::query("UPDATE dead_letters SET updated_at = updated_at - interval '8 days'")
        .execute(&pool)
        .await
        .unwrap();
    let later = shared::retention::run_once(&pool, &retention, "schedule")
        .await
        .unwrap();
    assert_eq!(later.dead_letter_payloads_purged, 1, "{later:?}");
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM dead_letters WHERE payload IS NULL"
        )
        .await,
        1
    );
}

/// Wraps [`Instrumented`] and, after each application, counts the transaction ids the drain's
/// backend holds (its transaction's and one per live subtransaction that wrote), as PostgreSQL
/// shows them in `pg_locks`.
struct SubtransactionProbe {
    inner: Instrumented,
    peak: std::sync::atomic::AtomicI64,
}

impl shared::effects::EffectHandler for SubtransactionProbe {
    fn name(&self) -> &'static str {
        "subtransaction_probe"
    }

    fn expects(
        &self,
        event: &shared::store::event_queue::ClaimedEvent,
    ) -> shared::effects::Expectation {
        self.inner.expects(event)
    }

    fn apply<'a>(
        &'a self,
        conn: &'a mut sqlx::PgConnection,
        event: &'a shared::store::event_queue::ClaimedEvent,
    ) -> shared::effects::EffectFuture<'a> {
        Box::pin(async move {
            let effect = self.inner.apply(&mut *conn, event).await?;
            let held: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'transactionid'",
            )
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| shared::effects::EffectError::from(shared::store::StoreError::from(e)))?;
            self.peak.fetch_max(held, Ordering::SeqCst);
            Ok(effect)
        })
    }
}

/// PostgreSQL caches 64 subtransaction ids per backend; one more and every other session's
/// visibility checks go to `pg_subtrans`. However large the batch and however many of its
/// events fail (here every other one, the worst case for isolating them), a drain transaction
/// never holds more than 64 live subtransactions, and every event still gets its own verdict:
/// each poison dead-lettered alone, every other event processed exactly once.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn no_batch_holds_more_than_64_subtransactions_however_many_events_fail(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let admin = admin_with_bulk_events(pool_options, &connect, 600).await;
    let mut inner = Instrumented::new(Arc::new(EntityProjection));
    inner.poison = (1..=300).map(|i| format!("item-{}", 2 * i)).collect();
    inner.fatal = true;
    let probe = Arc::new(SubtransactionProbe {
        inner,
        peak: std::sync::atomic::AtomicI64::new(0),
    });
    let mut registry = EffectRegistry::new(probe.clone());
    registry.register(
        shared::domain::Scheme::Stripe,
        "payment_intent.succeeded",
        Arc::new(shared::effects::payments::Payments::stripe()),
    );
    let drainer = Drainer::new(
        admin.clone(),
        Arc::new(registry),
        shared::drain::DrainSettings {
            batch_size: 600,
            ..fast_settings()
        },
    );

    let outcome = drain_all(&drainer, &admin, Duration::from_secs(60)).await;

    assert_eq!(
        (outcome.processed, outcome.dead_lettered, outcome.retried),
        (300, 300, 0),
        "{outcome:?}"
    );
    assert_eq!(application_counts(&admin).await, (1, 1, 300));
    assert!(
        outcome.deferred > 0,
        "a batch of 300 failures has more to isolate than 64 subtransactions allow: {outcome:?}"
    );
    assert_eq!(
        scalar(
            &admin,
            "SELECT count(*) FROM dead_letters WHERE reason = 'fatal'"
        )
        .await,
        300
    );
    // Subtransactions that committed into their parent hold no lock any more but keep their
    // place in the cache: count them by the rows they wrote, per drain transaction.
    let committed = scalar(
        &admin,
        "SELECT max(n) FROM (SELECT count(DISTINCT xmin::text) AS n FROM test_applications GROUP BY written_by) AS per_transaction",
    )
    .await;
    assert!(
        committed <= 64,
        "one drain transaction committed {committed} subtransactions"
    );
    // Those still open (and their ancestors, which get ids when a descendant writes) hold the
    // lock on their own id.
    let peak = probe.peak.load(Ordering::SeqCst);
    assert!(
        peak <= 65,
        "the drain's backend held {peak} transaction ids: its transaction's and {} subtransactions'",
        peak - 1
    );
}

/// An entity event whose state carries `name`: two of one version can differ.
fn named_entity_event(id: &str, entity: &str, version: i64, name: &str) -> Delivery {
    let body = serde_json::json!({"type": "thing.updated", "data": {"id": entity, "version": version, "name": name}});
    resign(
        shared::domain::Scheme::StandardWebhooks,
        ENTITIES_SECRET,
        id,
        now(),
        http::HeaderMap::new(),
        serde_json::to_vec(&body).unwrap(),
    )
}

/// Everything processing leaves behind, one line per row, in a stable order.
async fn processing_state(pool: &PgPool) -> Vec<String> {
    let queries = [
        "SELECT format('entity %s/%s v%s %s deleted=%s by %s', entity_type, entity_id, version, state::text, deleted, last_event_id) \
         FROM entities ORDER BY entity_type, entity_id",
        "SELECT format('outbox %s %s %s %s', external_id, action, payload::text, idempotency_key) \
         FROM outbox ORDER BY external_id, action",
        "SELECT format('order %s %s paid by %s gateway %s', order_id, state, paid_by_event, gateway_order_id) \
         FROM orders ORDER BY order_id",
        "SELECT format('exception %s %s %s %s', external_id, kind, order_id, detail) \
         FROM payment_exceptions ORDER BY external_id, kind",
        "SELECT format('anomaly %s %s %s', kind, external_id, detail) \
         FROM ingest_anomalies ORDER BY kind, external_id",
        "SELECT format('event %s %s attempts=%s expects=%s', external_id, status, attempts, expects) \
         FROM webhook_events ORDER BY external_id",
    ];
    let mut lines = Vec::new();
    for sql in queries {
        let rows: Vec<String> = sqlx::query_scalar(sql).fetch_all(pool).await.unwrap();
        lines.extend(rows);
    }
    lines
}

/// Set-wise effects are a faster way to the same end as one event at a time: the same
/// deliveries (three versions of one entity out of order, a delete followed by a late update,
/// two different changes with one version, two payments of one order, a mismatch, an unknown
/// and a cancelled order, an unreadable payment) drained one by one and in one batch leave the
/// same entities, outbox, orders, exceptions, anomalies and event rows.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn one_batch_ends_where_one_event_at_a_time_ends(pool: PgPool) {
    let app = app(pool.clone()).await;
    let deliveries = || {
        vec![
            named_entity_event("e1", "a", 1, "a one"),
            payment("p1", "ord-1", "REF-1", 500, "eur"),
            named_entity_event("e2", "a", 3, "a three"),
            entity_event("e3", "b", 2, "thing.deleted"),
            payment("p2", "ord-1", "REF-1", 500, "eur"),
            named_entity_event("e4", "a", 2, "a two"),
            entity_event("e5", "b", 1, "thing.updated"),
            payment("p3", "ord-2", "REF-2", 1, "eur"),
            named_entity_event("e6", "c", 5, "c first"),
            payment("p4", "ord-404", "REF-4", 500, "eur"),
            named_entity_event("e7", "c", 5, "c second"),
            payment("p5", "ord-3", "REF-3", 700, "eur"),
            payment("p6", "", "REF-6", 500, "eur"),
        ]
    };
    let mut ends = Vec::new();
    for batch_size in [1, 200] {
        sqlx::query("TRUNCATE event_queue, outbox, entities, payment_exceptions, ingest_anomalies, dead_letters, orders, webhook_events CASCADE")
            .execute(&pool)
            .await
            .unwrap();
        create_order(&pool, "ord-1", "REF-1", 500, "eur").await;
        create_order(&pool, "ord-2", "REF-2", 900, "eur").await;
        create_order(&pool, "ord-3", "REF-3", 700, "eur").await;
        sqlx::query("UPDATE orders SET state = 'cancelled' WHERE order_id = 'ord-3'")
            .execute(&pool)
            .await
            .unwrap();
        for d in deliveries() {
            deliver(&app, d).await;
        }
        let drainer = Drainer::new(
            pool.clone(),
            Arc::new(EffectRegistry::standard()),
            shared::drain::DrainSettings {
                batch_size,
                ..fast_settings()
            },
        );
        let outcome = drain_all(&drainer, &pool, Duration::from_secs(30)).await;
        ends.push((
            batch_size,
            (outcome.processed, outcome.retried, outcome.dead_lettered),
            processing_state(&pool).await,
        ));
    }
    let (one_by_one, batched) = (&ends[0], &ends[1]);
    assert_eq!(one_by_one.1, (13, 0, 0));
    assert_eq!(batched.1, one_by_one.1);
    assert_eq!(batched.2, one_by_one.2);
    // And that end is the one the rules name.
    let end = one_by_one.2.join("\n");
    for expected in [
        "entity thing/a v3 {\"data\": {\"id\": \"a\", \"name\": \"a three\", \"version\": 3}, \"type\": \"thing.updated\"} deleted=f by e2",
        "entity thing/b v2 {\"data\": {\"id\": \"b\", \"name\": \"b v2\", \"version\": 2}, \"type\": \"thing.deleted\"} deleted=t by e3",
        "entity thing/c v5 {\"data\": {\"id\": \"c\", \"name\": \"c second\", \"version\": 5}, \"type\": \"thing.updated\"} deleted=f by e7",
        "order ord-1 paid paid by p1",
        "exception p2 already_paid ord-1",
        "exception p3 amount_mismatch ord-2",
        "exception p4 unknown_order ord-404",
        "exception p5 invalid_state ord-3",
        "exception p6 unmappable_event",
        "anomaly ambiguous_version e7",
        "outbox p1 fulfil_order",
    ] {
        assert!(end.contains(expected), "missing {expected:?} in\n{end}");
    }
}

/// A set statement planned once, while its table was small, and cached as a generic plan joins
/// that table by a sequential scan for as long as the connection lives (nothing replans it
/// until the table is next analyzed): the drain decayed to half its rate within minutes. The
/// entity projection's statement is therefore planned afresh every batch, never prepared on the
/// connection, while the claim, whose plan does not depend on the batch, stays prepared.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_set_statements_are_never_cached_as_prepared_plans(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let admin = admin_with_bulk_events(pool_options, &connect, 400).await;
    let one_connection = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(connect.clone())
        .await
        .unwrap();
    let drainer = standard_drainer(&one_connection);

    let outcome = drain_all(&drainer, &admin, Duration::from_secs(30)).await;
    assert_eq!(outcome.processed, 400, "{outcome:?}");
    assert!(outcome.batches >= 8, "{outcome:?}");

    let prepared: Vec<String> = sqlx::query_scalar("SELECT statement FROM pg_prepared_statements")
        .fetch_all(&one_connection)
        .await
        .unwrap();
    assert!(
        prepared.iter().any(|s| s.contains("FROM event_queue AS q")),
        "the drain's connection keeps its prepared claim: {prepared:#?}"
    );
    let cached: Vec<&String> = prepared
        .iter()
        .filter(|s| s.contains("INSERT INTO entities"))
        .collect();
    assert!(cached.is_empty(), "cached set statements: {cached:#?}");
}

/// Rows a plan compared and threw away as a join filter, over the whole plan tree.
fn rows_removed_by_join_filter(plan: &serde_json::Value) -> i64 {
    plan["Rows Removed by Join Filter"].as_i64().unwrap_or(0)
        + plan["Plans"].as_array().map_or(0, |plans| {
            plans.iter().map(rows_removed_by_join_filter).sum()
        })
}

/// Completing, rescheduling and dead-lettering a batch touch each of its rows once, even from
/// the generic plan the server caches for a prepared statement. The statements once joined the
/// rows they had changed back to their own arrays; with a backlog queued, the generic plan
/// (which guesses ten rows for an array) ran that join as a nested loop over the whole batch for
/// every row: 39,800 comparisons thrown away for a batch of 200 (9,900 per 100 in the drain
/// bench, more than half the completion's time), quadratic in DRAIN_BATCH_SIZE.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn finishing_a_batch_never_compares_each_row_with_the_whole_batch(pool: PgPool) {
    use shared::store::{dead_letters, event_queue};
    let app = app(pool.clone()).await;
    let n = 200;
    for i in 0..n {
        let (id, thing) = (format!("f-{i}"), format!("thing-{i}"));
        deliver(&app, entity_event(&id, &thing, 1, "thing.updated")).await;
    }
    // A backlog: 20,000 more events wait in the queue (due tomorrow), and the tables are
    // analyzed, as they are once a deployment has run a while.
    sqlx::query(
        "WITH e AS (INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, payload_sha256, \
             verified_with, received_at, first_received_at, last_seen_at) \
         SELECT e.tenant_id, 'later-' || g, e.source_id, e.event_type, sha256(convert_to('later-' || g, 'UTF8')), \
             'current', now(), now(), now() \
         FROM (SELECT * FROM webhook_events LIMIT 1) AS e, generate_series(1, 20000) AS g \
         RETURNING tenant_id, external_id) \
         INSERT INTO event_queue (tenant_id, external_id, ready_at) \
         SELECT tenant_id, external_id, now() + interval '1 day' FROM e",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE webhook_events, event_queue, dead_letters")
        .execute(&pool)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET plan_cache_mode = force_generic_plan")
        .execute(&mut *conn)
        .await
        .unwrap();
    // Each statement prepared on this connection, run once for an event that is not queued.
    let nobody = (vec![TENANT.to_owned()], vec!["not-queued".to_owned()]);
    let error = vec!["error".to_owned()];
    event_queue::complete(&mut *conn, &nobody.0, &nobody.1, &["projection"])
        .await
        .unwrap();
    event_queue::retry_later(&mut *conn, &nobody.0, &nobody.1, &[1000], &error)
        .await
        .unwrap();
    dead_letters::bury(&mut *conn, &nobody.0, &nobody.1, &error, &["fatal"])
        .await
        .unwrap();

    let queued: Vec<(String, String)> = sqlx::query_as(
        "SELECT tenant_id, external_id FROM event_queue WHERE external_id LIKE 'f-%'",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    assert_eq!(queued.len(), n);
    // Test-made ids only ('f-<n>' under the test tenant): safe to write as literals.
    let literal = |values: Vec<&str>, ty: &str| {
        let quoted: Vec<String> = values.iter().map(|v| format!("'{v}'")).collect();
        format!("ARRAY[{}]::{ty}[]", quoted.join(", "))
    };
    let tenants = literal(queued.iter().map(|q| q.0.as_str()).collect(), "text");
    let ids = literal(queued.iter().map(|q| q.1.as_str()).collect(), "text");
    let each = |value: &str, ty: &str| literal(vec![value; n], ty);
    for (statement_says, rest, effect) in [
        (
            "status = 'processed'",
            each("projection", "text"),
            "SELECT count(*) FROM webhook_events WHERE status = 'processed' AND external_id LIKE 'f-%'",
        ),
        (
            "make_interval",
            format!("{}, {}", each("1000", "bigint"), each("error", "text")),
            "SELECT count(*) FROM webhook_events WHERE last_error = 'error'",
        ),
        (
            "INSERT INTO dead_letters",
            format!("{}, {}", each("error", "text"), each("fatal", "text")),
            "SELECT count(*) FROM dead_letters",
        ),
    ] {
        let name: String = sqlx::query_scalar(
            "SELECT name FROM pg_prepared_statements WHERE statement LIKE '%' || $1 || '%'",
        )
        .bind(statement_says)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
        let explain =
            format!("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE {name}({tenants}, {ids}, {rest})");
        let plan: serde_json::Value = sqlx::query_scalar(sqlx::AssertSqlSafe(explain))
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        let changed: i64 = sqlx::query_scalar(effect)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        sqlx::query("ROLLBACK").execute(&mut *conn).await.unwrap();
        assert_eq!(changed, n as i64, "{statement_says}: every event changed");
        assert_eq!(
            rows_removed_by_join_filter(&plan[0]["Plan"]),
            0,
            "{statement_says}: rows compared and thrown away in\n{plan:#}"
        );
    }
}

/// Plan nodes of `kind` over the whole plan tree, with the relation each reads.
fn plan_nodes(plan: &serde_json::Value, kind: &str) -> Vec<String> {
    let mut found = Vec::new();
    if plan["Node Type"] == kind {
        found.push(plan["Relation Name"].as_str().unwrap_or("").to_owned());
    }
    for child in plan["Plans"].as_array().into_iter().flatten() {
        found.extend(plan_nodes(child, kind));
    }
    found
}

/// The statement that claims and completes a batch finds the rows it claimed again by their
/// addresses, reading those rows and no others, even from the generic plan the server may cache
/// for it: that plan guesses a tenth of a ready queue for `LIMIT $1`, and with the rows joined
/// to the claim as a relation it read the whole queue and the whole event table to hash them
/// (here, with 200,000 events ready behind the batch: 111 ms for 50; with 340,000 queued of
/// 400,000 events, 687 ms for 100 against 2.8 ms from a custom plan).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn claiming_a_batch_reads_only_its_rows_even_from_a_generic_plan(pool: PgPool) {
    use shared::store::event_queue;
    let app = app(pool.clone()).await;
    for i in 0..200 {
        let (id, thing) = (format!("g-{i}"), format!("thing-{i}"));
        deliver(&app, entity_event(&id, &thing, 1, "thing.updated")).await;
    }
    // A backlog, ready behind them and analyzed, as in a deployment that has fallen behind.
    bulk_events(&pool, 200_000).await;
    sqlx::query("ANALYZE webhook_events, event_queue")
        .execute(&pool)
        .await
        .unwrap();
    let registry = EffectRegistry::standard();
    let declared = registry.declared_expectations();
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET plan_cache_mode = force_generic_plan")
        .execute(&mut *conn)
        .await
        .unwrap();
    // Prepared on this connection by a real batch of 50.
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    let claimed = event_queue::claim_completed(&mut conn, 50, &declared)
        .await
        .unwrap();
    sqlx::query("ROLLBACK").execute(&mut *conn).await.unwrap();
    assert_eq!(claimed.len(), 50);

    let name: String = sqlx::query_scalar(
        "SELECT name FROM pg_prepared_statements WHERE statement LIKE '%UPDATE webhook_events%' \
             AND statement LIKE '%FROM event_queue AS q%' AND statement NOT LIKE '%pg_prepared_statements%'",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    let explain = format!(
        "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE {name}(50, ARRAY['stripe'], ARRAY['payment_intent.succeeded'], \
             ARRAY['fulfilment'], ARRAY['fulfilment'], 'projection', 'nothing')"
    );
    let plan: serde_json::Value = sqlx::query_scalar(sqlx::AssertSqlSafe(explain))
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let (processed, queued): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM webhook_events WHERE status = 'processed'), \
             (SELECT count(*) FROM event_queue WHERE external_id LIKE 'g-%')",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    sqlx::query("ROLLBACK").execute(&mut *conn).await.unwrap();
    assert_eq!(
        (processed, queued),
        (50, 150),
        "one batch claimed and completed in\n{plan:#}"
    );
    assert_eq!(
        plan_nodes(&plan[0]["Plan"], "Seq Scan"),
        Vec::<String>::new(),
        "whole tables read for a batch of 50 in\n{plan:#}"
    );
}

/// Each event row's heap page, by external id.
async fn event_pages(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT external_id, (ctid::text::point)[0]::bigint FROM webhook_events ORDER BY external_id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Drains the `delivered` events queued and returns those whose row is no longer on the page it
/// was first written to.
async fn drained_rows_off_their_page(pool: &PgPool, delivered: usize) -> Vec<String> {
    let written = event_pages(pool).await;
    assert_eq!(written.len(), delivered);

    drain_all(&standard_drainer(pool), pool, Duration::from_secs(20)).await;

    assert_eq!(
        scalar(
            pool,
            "SELECT count(*) FROM webhook_events WHERE status = 'processed'"
        )
        .await,
        delivered as i64
    );
    event_pages(pool)
        .await
        .into_iter()
        .zip(&written)
        .filter(|(now, then)| now.1 != then.1)
        .map(|(now, _)| now.0)
        .collect()
}

/// Completing an event changes only columns no index covers, so its new row version can stay
/// on its page (a HOT update) and none of `webhook_events`' indexes gets a second entry for it,
/// provided the page has room for the new versions of every row one batch completes on it (their
/// old versions cannot be pruned before the batch commits). With the kilobyte-and-a-half payloads
/// providers send (a Stripe event, a Shopify order), delivered and drained: every row is still on
/// the page it was first written to, so processing never grew the table's indexes.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn completing_events_keeps_each_row_on_its_page(pool: PgPool) {
    let app = app(pool.clone()).await;
    for i in 0..120 {
        let body = serde_json::json!({
            "type": "customer.updated",
            "data": {"id": format!("cust-{i}"), "version": 1, "name": format!("customer {i}"),
                     "notes": format!("{i:x}").repeat(1400 / format!("{i:x}").len())},
        });
        let d = resign(
            shared::domain::Scheme::StandardWebhooks,
            ENTITIES_SECRET,
            &format!("evt-{i:03}"),
            now(),
            http::HeaderMap::new(),
            serde_json::to_vec(&body).unwrap(),
        );
        deliver(&app, d).await;
    }
    assert_eq!(
        drained_rows_off_their_page(&pool, 120).await,
        Vec::<String>::new(),
        "rows that left their page: each left a second entry in every index"
    );
}

/// The same with the smallest events providers send (a ping, a status change: rows of a few
/// hundred bytes, ten or more to a page), of several sizes: each page must keep room for the
/// completed version of every row on it, which at half a page free fell short by a row for
/// rows of about 400 bytes (the drain bench: 8% of completions left their page, each a second
/// entry in every index).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn completing_small_events_keeps_each_row_on_its_page(pool: PgPool) {
    let app = app(pool.clone()).await;
    let mut sent = 0;
    for padding in [0, 40, 80, 120, 160, 200, 240, 280, 320] {
        for i in 0..40 {
            let id = format!("small-{padding:03}-{i:02}");
            let body = serde_json::json!({
                "type": "customer.updated",
                "data": {"id": format!("c-{padding}-{i}"), "version": 1, "note": "x".repeat(padding)},
            });
            let d = resign(
                shared::domain::Scheme::StandardWebhooks,
                ENTITIES_SECRET,
                &id,
                now(),
                http::HeaderMap::new(),
                serde_json::to_vec(&body).unwrap(),
            );
            deliver(&app, d).await;
            sent += 1;
        }
    }
    assert_eq!(
        drained_rows_off_their_page(&pool, sent).await,
        Vec::<String>::new(),
        "rows that left their page: each left a second entry in every index"
    );
}

/// Of each event's row in `test_applications`: was it written by its batch's own transaction
/// (no savepoint between) or inside a subtransaction? Counted over the rows of `external_ids`
/// matching `pattern`: (by the top-level transaction, inside a subtransaction).
async fn written_outside_and_inside_savepoints(pool: &PgPool, pattern: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE xmin::text::bigint = written_by::text::bigint % 4294967296), \
                count(*) FILTER (WHERE xmin::text::bigint <> written_by::text::bigint % 4294967296) \
         FROM test_applications WHERE external_id LIKE $1",
    )
    .bind(pattern)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A batch in which nothing fails is one transaction with no savepoint (a savepoint per group is
/// a round trip and a subtransaction such a batch never uses). When an event fails, its batch is
/// rolled back and redone under savepoints, so the failing event still stands alone and the rest
/// commits; the drainer keeps its savepoints for the next batch, and drops them again after a
/// batch in which nothing failed.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn batches_take_savepoints_only_around_a_failure(pool: PgPool) {
    let app = app(pool.clone()).await;
    create_application_log(&pool).await;
    let mut handler = Instrumented::new(Arc::new(EntityProjection));
    handler.poison = vec!["poison".into()];
    handler.fatal = true;
    let drainer = drainer(&pool, registry_with(Arc::new(handler)));
    let deliver_ten = |round: &'static str| {
        let app = &app;
        async move {
            for i in 0..10 {
                let (id, thing) = (format!("{round}-{i}"), format!("thing-{round}-{i}"));
                deliver(app, entity_event(&id, &thing, 1, "thing.updated")).await;
            }
        }
    };

    deliver_ten("calm").await;
    let calm = drainer.run_once().await.unwrap();
    assert_eq!((calm.processed, calm.redone), (10, 0), "{calm:?}");
    assert_eq!(
        written_outside_and_inside_savepoints(&pool, "calm-%").await,
        (10, 0)
    );

    deliver_ten("stormy").await;
    deliver(&app, entity_event("bad-1", "poison", 1, "thing.updated")).await;
    let stormy = drainer.run_once().await.unwrap();
    assert_eq!(
        (stormy.processed, stormy.dead_lettered, stormy.redone),
        (10, 1, 1),
        "{stormy:?}"
    );
    assert_eq!(
        written_outside_and_inside_savepoints(&pool, "stormy-%").await,
        (0, 10)
    );

    deliver_ten("after").await;
    let after = drainer.run_once().await.unwrap();
    assert_eq!((after.processed, after.redone), (10, 0), "{after:?}");
    assert_eq!(
        written_outside_and_inside_savepoints(&pool, "after-%").await,
        (0, 10),
        "the batch after a failure still isolates"
    );

    deliver_ten("calm-again").await;
    let calm_again = drainer.run_once().await.unwrap();
    assert_eq!((calm_again.processed, calm_again.redone), (10, 0));
    assert_eq!(
        written_outside_and_inside_savepoints(&pool, "calm-again-%").await,
        (10, 0),
        "a batch in which nothing failed ends the isolation"
    );
    assert_eq!(application_counts(&pool).await, (1, 1, 40));
}

/// A handler that projects entities as the standard one does and answers what it expects event
/// by event as that one does, but declares `declared` (the standard one declares its answer).
struct AnswersOnly {
    declared: Option<shared::effects::DeclaredExpectation>,
}

impl shared::effects::EffectHandler for AnswersOnly {
    fn name(&self) -> &'static str {
        "answers_only"
    }

    fn expects(
        &self,
        event: &shared::store::event_queue::ClaimedEvent,
    ) -> shared::effects::Expectation {
        shared::effects::EffectHandler::expects(&EntityProjection, event)
    }

    fn declares(&self) -> Option<shared::effects::DeclaredExpectation> {
        self.declared
    }

    fn apply<'a>(
        &'a self,
        conn: &'a mut sqlx::PgConnection,
        event: &'a shared::store::event_queue::ClaimedEvent,
    ) -> shared::effects::EffectFuture<'a> {
        shared::effects::EffectHandler::apply(&EntityProjection, conn, event)
    }
}

/// The batch's claim records what each event's handler declares it expects, in the statement
/// that marks it processed; a handler that declares nothing, or declares other than it answers
/// event by event, still has its answer recorded, and an event naming no entity and version
/// gets what its handler expects of such events: what reconcile later checks is each handler's
/// answer, whichever way it was recorded.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn each_processed_event_records_what_its_handler_answers_it_expects(pool: PgPool) {
    use shared::domain::Scheme;
    use shared::effects::{DeclaredExpectation, Expectation};
    let app = app(pool.clone()).await;
    deliver(&app, entity_event("v-undeclared", "a", 1, "thing.updated")).await;
    deliver(&app, entity_event("v-misdeclared", "b", 1, "thing.created")).await;
    deliver(&app, payment("p-declared", "ord-404", "REF-4", 500, "eur")).await;
    // The Standard Webhooks source reads no entity and no version.
    let body =
        serde_json::to_vec(&serde_json::json!({"type": "thing.updated", "data": {}})).unwrap();
    let unversioned = resign(
        Scheme::StandardWebhooks,
        &secret_of(Scheme::StandardWebhooks),
        "u-undeclared",
        now(),
        http::HeaderMap::new(),
        body,
    );
    let reply = app
        .post(
            Scheme::StandardWebhooks.as_str(),
            unversioned.headers,
            &unversioned.body,
        )
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json);

    let mut registry = EffectRegistry::new(Arc::new(AnswersOnly { declared: None }));
    registry.register(
        Scheme::StandardWebhooks,
        "thing.created",
        Arc::new(AnswersOnly {
            declared: Some(DeclaredExpectation::always(Expectation::Fulfilment)),
        }),
    );
    registry.register(
        Scheme::Stripe,
        "payment_intent.succeeded",
        Arc::new(shared::effects::payments::Payments::stripe()),
    );
    let drainer = drainer(&pool, Arc::new(registry));
    let outcome = drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    assert_eq!(
        (outcome.processed, outcome.redone, outcome.retried),
        (4, 0, 0),
        "{outcome:?}"
    );

    let recorded: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT external_id, status, expects FROM webhook_events ORDER BY external_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let expected = [
        ("p-declared", "fulfilment"),
        ("u-undeclared", "nothing"),
        ("v-misdeclared", "projection"),
        ("v-undeclared", "projection"),
    ];
    assert_eq!(
        recorded,
        expected
            .iter()
            .map(|(id, e)| (id.to_string(), "processed".to_string(), Some(e.to_string())))
            .collect::<Vec<_>>()
    );
    assert!(entity(&pool, "a").await.is_some() && entity(&pool, "b").await.is_some());
}

/// The merged claim (`claim_completed`) completes every event it claims, even one a redelivery
/// updated after the statement began and before it locked the row. Under READ COMMITTED the
/// claim then locks (and returns) the redelivery's version, which the statement's own snapshot
/// cannot see: completion that finds rows again by the address the claim locked misses it,
/// leaving the event `pending` with its queue row deleted and its effects committed.
///
/// Two sessions make the window wide and certain: one holds the queue rows ahead of the target
/// locked (the claim skips each), and once the claim is running the other commits an update of
/// the target's event row, as a redelivery does. The claim returns the target with the new
/// payload: proof that it locked the version committed during the statement.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_event_redelivered_while_its_claim_runs_is_completed(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    use shared::store::event_queue::{self, DeclaredExpectations};
    let admin = admin_with_bulk_events(pool_options, &connect, 60_000).await;
    let target = "bulk-60000";
    let ready_at = |when: &'static str| {
        let admin = admin.clone();
        async move {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE event_queue SET ready_at = {when} WHERE external_id = '{target}'"
            )))
            .execute(&admin)
            .await
            .unwrap();
        }
    };
    ready_at("now() + interval '1 hour'").await;
    let session = |name: &str| {
        let connect = connect.clone().application_name(name);
        async move {
            PgPoolOptions::new()
                .max_connections(1)
                .connect_with(connect)
                .await
                .unwrap()
        }
    };
    let (holder, claimer, redeliverer) = (
        session("holder").await,
        session("claimer").await,
        session("redeliverer").await,
    );
    let mut held = holder.begin().await.unwrap();
    let ahead: i64 = sqlx::query_scalar(
        "WITH l AS (SELECT 1 FROM event_queue WHERE external_id <> $1 FOR UPDATE) SELECT count(*) FROM l",
    )
    .bind(target)
    .fetch_one(&mut *held)
    .await
    .unwrap();
    assert_eq!(ahead, 59_999);
    // The claim's statement prepared on its connection by a claim that finds nothing ready, so
    // that the one below is only bound and executed: running means its snapshot is taken.
    let mut tx = claimer.begin().await.unwrap();
    let none = event_queue::claim_completed(&mut tx, 1, &DeclaredExpectations::default())
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert!(none.is_empty());
    // Ready now: behind every held row, so the claim skips them all before it reaches it.
    ready_at("now()").await;

    let claim = tokio::spawn(async move {
        let mut tx = claimer.begin().await.unwrap();
        let claimed = event_queue::claim_completed(&mut tx, 1, &DeclaredExpectations::default())
            .await
            .unwrap();
        tx.commit().await.unwrap();
        claimed
    });
    // Once the claim's statement is running, commit a redelivery's update of the target.
    let started = std::time::Instant::now();
    loop {
        let running: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'claimer' \
                 AND state = 'active' AND query LIKE 'WITH c AS%'",
        )
        .fetch_one(&redeliverer)
        .await
        .unwrap();
        if running > 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the claim never ran"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    sqlx::query(
        "UPDATE webhook_events SET payload = convert_to('redelivered', 'UTF8'), \
             delivery_count = delivery_count + 1, last_seen_at = now() WHERE external_id = $1",
    )
    .bind(target)
    .execute(&redeliverer)
    .await
    .unwrap();
    let claimed = claim.await.unwrap();
    held.rollback().await.unwrap();

    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].event.external_id, target);
    assert_eq!(
        claimed[0].event.payload.as_deref(),
        Some(&b"redelivered"[..]),
        "the claim locked the version committed while it ran (else the window was missed)"
    );
    let (status, queued): (String, i64) = sqlx::query_as(
        "SELECT status, (SELECT count(*) FROM event_queue WHERE external_id = $1) \
             FROM webhook_events WHERE external_id = $1",
    )
    .bind(target)
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(
        (status.as_str(), queued),
        ("processed", 0),
        "a claimed event is completed, never left pending without its queue row"
    );
}

/// A drainer taking one event a batch beside four tasks redelivering the events next in line, again
/// and again, as providers' retries do: every claimed event ends processed, and no pending event
/// is left without its queue row (the one-statement claim once completed rows by the address it locked,
/// missing a version a redelivery committed while the claim ran).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn redeliveries_during_the_drain_never_leave_an_event_pending_without_its_queue_row(
    pool: PgPool,
) {
    let app = Arc::new(app(pool.clone()).await);
    let mut deliveries = std::collections::HashMap::new();
    for i in 0..1000 {
        let id = format!("r-{i}");
        let d = entity_event(&id, &format!("thing-{i}"), 1, "thing.updated");
        deliver(&app, d.clone()).await;
        deliveries.insert(id, d);
    }
    let deliveries = Arc::new(deliveries);
    let draining = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let redeliverers: Vec<_> = (0..4)
        .map(|_| {
            let (app, deliveries, draining, pool) = (
                app.clone(),
                deliveries.clone(),
                draining.clone(),
                pool.clone(),
            );
            tokio::spawn(async move {
                let mut redelivered = 0u64;
                while draining.load(Ordering::Relaxed) {
                    let pending: Vec<String> = sqlx::query_scalar(
                        "SELECT external_id FROM event_queue ORDER BY ready_at LIMIT 4",
                    )
                    .fetch_all(&pool)
                    .await
                    .unwrap();
                    for id in pending {
                        let Some(d) = deliveries.get(&id) else {
                            continue;
                        };
                        deliver(&app, d.clone()).await;
                        redelivered += 1;
                    }
                    tokio::task::yield_now().await;
                }
                redelivered
            })
        })
        .collect();

    let settings = shared::drain::DrainSettings {
        batch_size: 1,
        ..fast_settings()
    };
    let drainer = Drainer::new(pool.clone(), Arc::new(EffectRegistry::standard()), settings);
    let outcome = drain_all(&drainer, &pool, Duration::from_secs(120)).await;
    draining.store(false, Ordering::Relaxed);
    let mut redelivered = 0;
    for r in redeliverers {
        redelivered += r.await.unwrap();
    }
    assert!(redelivered > 0, "the redeliveries ran beside the drain");

    let stranded = scalar(
        &pool,
        "SELECT count(*) FROM webhook_events AS e WHERE e.status = 'pending' AND NOT EXISTS \
             (SELECT 1 FROM event_queue AS q WHERE q.tenant_id = e.tenant_id AND q.external_id = e.external_id)",
    )
    .await;
    assert_eq!(
        stranded, 0,
        "pending events without a queue row ({outcome:?})"
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM webhook_events WHERE status = 'processed'"
        )
        .await,
        1000
    );
}
