//! The outbox sender against a real PostgreSQL and a real HTTP target (spawned here, scripted
//! to fail): at-least-once delivery with a stable idempotency key, bounded retries, refusals.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use pipeline_tests::drain::*;
use pipeline_tests::*;
use shared::outbox::{OutboxSender, OutboxSettings};
use sqlx::PgPool;

#[derive(Clone, Default)]
struct Target {
    /// Status codes to answer, in order; 200 once exhausted.
    script: Arc<Mutex<VecDeque<u16>>>,
    /// (Idempotency-Key, body) of every request received.
    received: Arc<Mutex<Vec<(String, serde_json::Value)>>>,
    /// How long the target takes to answer (a slow target).
    latency: Duration,
    /// When set, every request waits for a permit before it is answered.
    gate: Option<Arc<tokio::sync::Semaphore>>,
    /// Notified as each request arrives.
    arrived: Arc<tokio::sync::Notify>,
}

async fn receive(
    State(t): State<Target>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> StatusCode {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    t.received
        .lock()
        .unwrap()
        .push((key, serde_json::from_slice(&body).unwrap()));
    t.arrived.notify_one();
    if let Some(gate) = &t.gate {
        let _permit = gate.acquire().await.unwrap();
    }
    tokio::time::sleep(t.latency).await;
    StatusCode::from_u16(t.script.lock().unwrap().pop_front().unwrap_or(200)).unwrap()
}

async fn spawn_target(script: &[u16]) -> (Target, String) {
    serve_target(Target {
        script: Arc::new(Mutex::new(script.iter().copied().collect())),
        ..Target::default()
    })
    .await
}

async fn serve_target(target: Target) -> (Target, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let app = axum::Router::new()
        .route("/hook", post(receive))
        .with_state(target.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (target, url)
}

fn settings(url: &str) -> OutboxSettings {
    OutboxSettings {
        max_attempts: 3,
        backoff_base: Duration::from_millis(5),
        backoff_cap: Duration::from_millis(20),
        ..OutboxSettings::new(url)
    }
}

/// A sender (the tests' settings) passing until `deadline_in` from now against a target that
/// holds every request until `gate` has permits, once the first request has arrived: its
/// batch leased and in flight. Returns the target, the gate, its URL and the pass.
async fn sending_to_a_gated_target(
    pool: &PgPool,
    deadline_in: Duration,
) -> (
    Target,
    Arc<tokio::sync::Semaphore>,
    String,
    tokio::task::JoinHandle<Result<shared::outbox::OutboxOutcome, shared::store::StoreError>>,
) {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (target, url) = serve_target(Target {
        gate: Some(gate.clone()),
        ..Target::default()
    })
    .await;
    let sender = OutboxSender::new(pool.clone(), settings(&url)).unwrap();
    let sending =
        tokio::spawn(async move { sender.send_until(Instant::now() + deadline_in).await });
    target.arrived.notified().await;
    (target, gate, url, sending)
}

/// Ingests and drains `n` entity events, leaving `n` outbox rows.
async fn outbox_rows(pool: &PgPool, n: usize) {
    let app = app(pool.clone()).await;
    for i in 0..n {
        let d = entity_event(&format!("o-{i}"), &format!("thing-{i}"), 1, "thing.updated");
        assert_eq!(app.post(ENTITIES, d.headers, &d.body).await.status, 200);
    }
    let drainer = standard_drainer(pool);
    drain_all(&drainer, pool, Duration::from_secs(10)).await;
}

async fn send_until_settled(sender: &OutboxSender, pool: &PgPool) {
    let give_up = Instant::now() + Duration::from_secs(10);
    while scalar(pool, "SELECT count(*) FROM outbox WHERE status = 'pending'").await > 0 {
        assert!(Instant::now() < give_up, "outbox not settled");
        sender
            .send_until(Instant::now() + Duration::from_secs(5))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn messages_are_delivered_with_their_idempotency_key_and_retried_on_5xx(pool: PgPool) {
    outbox_rows(&pool, 3).await;
    let (target, url) = spawn_target(&[503, 500]).await;
    let sender = OutboxSender::new(pool.clone(), settings(&url)).unwrap();

    send_until_settled(&sender, &pool).await;

    let rows: Vec<(String, String, i32)> =
        sqlx::query_as("SELECT idempotency_key, status, attempts FROM outbox ORDER BY outbox_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(rows.iter().all(|r| r.1 == "delivered"), "{rows:?}");
    let received = target.received.lock().unwrap().clone();
    assert_eq!(
        received.len(),
        5,
        "3 messages, 2 of the first deliveries refused with 5xx"
    );
    let mut keys: Vec<&str> = received.iter().map(|(k, _)| k.as_str()).collect();
    keys.sort();
    keys.dedup();
    let mut expected: Vec<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    expected.sort();
    assert_eq!(
        keys, expected,
        "every request carries its row's key; retries reuse it"
    );
    assert_eq!(rows.iter().map(|r| r.2).sum::<i32>(), 5);
    let body = &received.last().unwrap().1;
    assert_eq!(body["action"], "entity.changed");
    assert_eq!(body["tenant_id"], TENANT);
    assert_eq!(body["payload"]["entity_type"], "thing");
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_refusing_target_fails_the_message_and_a_dead_target_exhausts_it(pool: PgPool) {
    outbox_rows(&pool, 1).await;
    let (target, url) = spawn_target(&[422]).await;
    let sender = OutboxSender::new(pool.clone(), settings(&url)).unwrap();
    send_until_settled(&sender, &pool).await;
    let (status, error): (String, String) = sqlx::query_as("SELECT status, last_error FROM outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        (status.as_str(), error.as_str()),
        ("failed", "target answered 422 Unprocessable Entity")
    );
    assert_eq!(
        target.received.lock().unwrap().len(),
        1,
        "a 4xx is not retried"
    );

    sqlx::query("UPDATE outbox SET status = 'pending', attempts = 0, next_attempt_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    let dead = OutboxSender::new(pool.clone(), settings("http://127.0.0.1:1/hook")).unwrap();
    send_until_settled(&dead, &pool).await;
    let (status, attempts): (String, i32) = sqlx::query_as("SELECT status, attempts FROM outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        (status.as_str(), attempts),
        ("failed", 3),
        "bounded by the attempt budget"
    );
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn concurrent_senders_lease_each_message_to_one_of_them(pool: PgPool) {
    outbox_rows(&pool, 40).await;
    let (target, url) = spawn_target(&[]).await;
    let senders: Vec<_> = (0..3)
        .map(|_| {
            Arc::new(
                OutboxSender::new(
                    pool.clone(),
                    OutboxSettings {
                        batch_size: 5,
                        ..settings(&url)
                    },
                )
                .unwrap(),
            )
        })
        .collect();
    let tasks: Vec<_> = senders
        .into_iter()
        .map(|s| {
            tokio::spawn(async move {
                s.send_until(Instant::now() + Duration::from_secs(10))
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut delivered = 0;
    for t in tasks {
        delivered += t.await.unwrap().delivered;
    }
    assert_eq!(delivered, 40);
    let received = target.received.lock().unwrap();
    let mut keys: Vec<&String> = received.iter().map(|(k, _)| k).collect();
    keys.sort();
    keys.dedup();
    assert_eq!(
        (received.len(), keys.len()),
        (40, 40),
        "each message sent once"
    );
}

/// Attempts count tries, not leases. Against a slow target an invocation checks its deadline
/// before each message and hands back what it leased and did not send: it ends by its deadline
/// (a Lambda invocation would be killed past it), each row's attempts equal the requests the
/// target received for it, and nothing reaches `failed` for having been leased.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_slow_target_spends_attempts_only_on_tries(pool: PgPool) {
    outbox_rows(&pool, 10).await;
    let (target, url) = serve_target(Target {
        latency: Duration::from_millis(300),
        ..Target::default()
    })
    .await;
    let sender = OutboxSender::new(
        pool.clone(),
        OutboxSettings {
            batch_size: 10,
            request_timeout: Duration::from_secs(2),
            // One call at a time: with the default sixteen in flight, ten fit one invocation.
            http_concurrency: 1,
            ..settings(&url)
        },
    )
    .unwrap();

    // Ten 300 ms requests do not fit one 1 s invocation, so every invocation but the last
    // hands back what it leased. How many invocations the ten take depends on how fast this
    // machine is (CI once needed more than six): the bound is generous, the count is not asserted.
    let mut handed_back = 0;
    for invocation in 1..=30 {
        let deadline = Instant::now() + Duration::from_secs(1);
        // The runtime ends an invocation that outlives its deadline (here, one second after).
        let run = tokio::time::timeout(Duration::from_secs(2), sender.send_until(deadline)).await;
        if let Ok(Ok(outcome)) = &run {
            handed_back += outcome.handed_back;
        }
        let counts: Vec<(String, i32)> =
            sqlx::query_as("SELECT idempotency_key, attempts FROM outbox ORDER BY outbox_id")
                .fetch_all(&pool)
                .await
                .unwrap();
        let received = target.received.lock().unwrap().clone();
        for (key, attempts) in &counts {
            let tries = received.iter().filter(|(k, _)| k == key).count() as i32;
            assert_eq!(
                *attempts, tries,
                "invocation {invocation}: attempts are tries, not leases: {counts:?}"
            );
        }
        let untried_hidden = scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE status = 'pending' AND attempts = 0 AND next_attempt_at > now()",
        )
        .await;
        assert_eq!(
            untried_hidden, 0,
            "invocation {invocation}: what was leased and not sent is handed back"
        );
        assert!(
            run.is_ok_and(|sent| sent.is_ok()),
            "invocation {invocation} ran past its deadline and was killed"
        );
        if scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE status = 'pending'",
        )
        .await
            == 0
        {
            break;
        }
    }
    assert!(
        handed_back > 0,
        "no invocation handed anything back: the target was not slow enough to test that"
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE status = 'delivered'"
        )
        .await,
        10
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM outbox WHERE status = 'failed'").await,
        0
    );
}

/// Reconcile never makes a row that a sender holds leased due: a second sender would POST the
/// same message while the first is still sending it.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn reconcile_leaves_leased_rows_to_their_sender(pool: PgPool) {
    outbox_rows(&pool, 3).await;
    // The first sender holds the batch and waits on the target's answer to its first message.
    let (target, gate, url, sending) =
        sending_to_a_gated_target(&pool, Duration::from_secs(30)).await;
    sqlx::query("UPDATE outbox SET created_at = now() - interval '2 hours'")
        .execute(&pool)
        .await
        .unwrap();

    let drainer = standard_drainer(&pool);
    let pass = shared::reconcile::run_once(&pool, &drainer, &Default::default(), "schedule")
        .await
        .unwrap();
    let shared::reconcile::ReconcileOutcome::Completed {
        found, repaired, ..
    } = pass
    else {
        panic!("skipped: {pass:?}");
    };
    assert_eq!(found.outbox_undelivered_past_window, 3, "{found:?}");
    assert_eq!(
        repaired.outbox_made_due, 0,
        "reconcile made rows due that a sender holds"
    );
    let second = OutboxSender::new(pool.clone(), settings(&url)).unwrap();
    let meanwhile = tokio::time::timeout(
        Duration::from_secs(3),
        second.send_until(Instant::now() + Duration::from_secs(1)),
    )
    .await;
    gate.add_permits(100);
    let first_outcome = sending.await.unwrap().unwrap();

    assert_eq!(first_outcome.delivered, 3, "{first_outcome:?}");
    assert!(
        meanwhile
            .as_ref()
            .is_ok_and(|o| o.as_ref().is_ok_and(|o| o.leased == 0)),
        "the second sender leased held rows: {meanwhile:?}"
    );
    let received = target.received.lock().unwrap().clone();
    let mut keys: Vec<&String> = received.iter().map(|(k, _)| k).collect();
    keys.sort();
    keys.dedup();
    assert_eq!(
        (received.len(), keys.len()),
        (3, 3),
        "each message POSTed once"
    );
}

/// A target behind a login page or a trailing-slash redirect answers 302: following it would
/// turn the POST into a bodiless GET that lands on a 200 page, and the message would read
/// `delivered` while nothing arrived. The redirect is not followed: the message fails with a
/// reason naming the status and where it pointed, and the page it pointed to is never asked.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_redirecting_target_is_a_failure_not_a_delivery(pool: PgPool) {
    outbox_rows(&pool, 1).await;
    let landed = Arc::new(Mutex::new(0_usize));
    let posted = Arc::new(Mutex::new(0_usize));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new()
        .route(
            "/hook",
            post({
                let posted = posted.clone();
                move || async move {
                    *posted.lock().unwrap() += 1;
                    (StatusCode::FOUND, [("location", "/login")])
                }
            }),
        )
        .route(
            "/login",
            axum::routing::any({
                let landed = landed.clone();
                move || async move {
                    *landed.lock().unwrap() += 1;
                    StatusCode::OK
                }
            }),
        );
    tokio::spawn(async move { axum::serve(listener, app).await });
    let sender = OutboxSender::new(pool.clone(), settings(&format!("{base}/hook"))).unwrap();

    send_until_settled(&sender, &pool).await;

    let (status, attempts, error): (String, i32, Option<String>) =
        sqlx::query_as("SELECT status, attempts, last_error FROM outbox")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (status.as_str(), attempts, error.as_deref()),
        (
            "failed",
            1,
            Some("target answered 302 Found, a redirect to /login (not followed)")
        ),
        "a redirect is not a delivery"
    );
    assert_eq!(
        (*posted.lock().unwrap(), *landed.lock().unwrap()),
        (1, 0),
        "one POST, and the redirect's target never asked"
    );
}

/// A message that failed for good is an effect that never happened: retention must not forget
/// it (nor its event) when the event passes the identity horizon, weeks after the failure.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_failed_message_outlives_the_identity_horizon(pool: PgPool) {
    outbox_rows(&pool, 1).await;
    let (_target, url) = spawn_target(&[422]).await;
    let sender = OutboxSender::new(pool.clone(), settings(&url)).unwrap();
    send_until_settled(&sender, &pool).await;
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM outbox WHERE status = 'failed'").await,
        1
    );

    assert_eq!(retention_past_the_horizon(&pool).await, 0);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM outbox WHERE status = 'failed'").await,
        1,
        "the failed message is still there for an operator to resend or discard"
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM webhook_events").await,
        1
    );
}

/// A processed event whose outbox row was lost, and which reconcile re-queued as a repair just as
/// it passed the identity horizon: retention must not delete it (the queue row goes with it, by
/// cascade) while the repair is queued: the drain then restores the message or, its payload
/// purged, records the loss for the verdict; either way it is not dropped unseen.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_queued_repair_keeps_its_event_past_the_identity_horizon(pool: PgPool) {
    outbox_rows(&pool, 1).await;
    sqlx::query("DELETE FROM outbox")
        .execute(&pool)
        .await
        .unwrap();
    // What reconcile's re-queue writes for a processed event missing its outbox row.
    sqlx::query(
        "INSERT INTO event_queue (tenant_id, external_id, repair) \
         SELECT tenant_id, external_id, true FROM webhook_events",
    )
    .execute(&pool)
    .await
    .unwrap();

    assert_eq!(retention_past_the_horizon(&pool).await, 0);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM event_queue WHERE repair").await,
        1,
        "the repair is still queued"
    );

    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM webhook_events").await,
        1,
        "the event the repair needs is still there"
    );
}

/// Each message's status, attempts, resent count, and whether it was resent and discarded, in id
/// order: what the sender and an operator's decisions left on it.
async fn decisions(pool: &PgPool) -> Vec<(String, i32, i32, bool, bool)> {
    sqlx::query_as(
        "SELECT status, attempts, resent_count, resent_at IS NOT NULL, discarded_at IS NOT NULL \
         FROM outbox ORDER BY outbox_id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

fn decided(
    status: &str,
    attempts: i32,
    resent_count: i32,
    resent: bool,
    discarded: bool,
) -> (String, i32, i32, bool, bool) {
    (status.to_owned(), attempts, resent_count, resent, discarded)
}

/// The operator's answer to `request`, as JSON (what the operator function returns).
async fn operator(pool: &PgPool, request: serde_json::Value) -> serde_json::Value {
    let request = shared::operator::parse(request).unwrap();
    let registry = shared::effects::EffectRegistry::standard();
    let answer = shared::operator::handle(pool, &registry, request)
        .await
        .unwrap();
    serde_json::to_value(answer).unwrap()
}

fn ids(answer: &serde_json::Value, key: &str) -> Vec<i64> {
    answer[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect()
}

/// Weeks after a target refused three messages, an operator who fixed it resends two and
/// discards the third: the two reach the target under the keys they were first sent with, the
/// status verdict clears, and retention may then take the events with their outbox rows.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_failed_message_waits_for_an_operator_who_resends_or_discards_it(pool: PgPool) {
    outbox_rows(&pool, 3).await;
    let (target, url) = spawn_target(&[422, 422, 422]).await;
    let sender = OutboxSender::new(pool.clone(), settings(&url)).unwrap();
    send_until_settled(&sender, &pool).await;

    let report = shared::status::report(&pool, &Default::default())
        .await
        .unwrap();
    let finding = report
        .findings
        .iter()
        .find(|f| f.kind == shared::status::FindingKind::FailedOutbox)
        .expect("a failed-outbox finding");
    assert_eq!(
        (finding.count, finding.next.as_str()),
        (3, "hookctl outbox list")
    );

    let listed = operator(
        &pool,
        serde_json::json!({"action": "list_failed_outbox", "filter": {"error_contains": "UNPROCESSABLE"}}),
    )
    .await;
    let failed = listed["failed_outbox"].as_array().unwrap();
    assert_eq!(failed.len(), 3, "{listed}");
    for m in failed {
        assert_eq!(m["last_error"], "target answered 422 Unprocessable Entity");
        assert_eq!(
            (m["attempts"].as_i64(), m["resent_count"].as_i64()),
            (Some(1), Some(0))
        );
        assert_eq!(m["action"], "entity.changed");
    }
    let all: Vec<i64> = failed
        .iter()
        .map(|m| m["outbox_id"].as_i64().unwrap())
        .collect();
    let keys: Vec<String> = failed
        .iter()
        .map(|m| m["idempotency_key"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        retention_past_the_horizon(&pool).await,
        0,
        "nothing decided yet"
    );

    // The target is fixed; two are wanted.
    let resent = operator(
        &pool,
        serde_json::json!({"action": "resend_outbox", "filter": {"ids": [all[0], all[1]]}, "actor": "alice", "reason": "the fix is deployed"}),
    )
    .await;
    assert_eq!(ids(&resent, "resent"), vec![all[0], all[1]]);
    assert_eq!(
        decisions(&pool).await,
        [
            decided("pending", 0, 1, true, false),
            decided("pending", 0, 1, true, false),
            decided("failed", 1, 0, false, false),
        ],
        "due again with a fresh attempt budget, the resend recorded"
    );
    let again = operator(
        &pool,
        serde_json::json!({"action": "resend_outbox", "filter": {"ids": [all[0], all[1]]}, "actor": "alice", "reason": "the fix is deployed"}),
    )
    .await;
    assert_eq!(
        ids(&again, "resent"),
        Vec::<i64>::new(),
        "resent once, not twice"
    );

    send_until_settled(&sender, &pool).await;
    assert_eq!(
        decisions(&pool).await,
        [
            decided("delivered", 1, 1, true, false),
            decided("delivered", 1, 1, true, false),
            decided("failed", 1, 0, false, false),
        ]
    );
    let received: Vec<String> = target
        .received
        .lock()
        .unwrap()
        .iter()
        .map(|(k, _)| k.clone())
        .collect();
    assert_eq!(
        received.len(),
        5,
        "three refused tries, then the two resent"
    );
    for key in &keys[..2] {
        assert_eq!(
            received.iter().filter(|k| *k == key).count(),
            2,
            "a resent message carries the key of its first try"
        );
    }

    // The third is not wanted; the first is delivered and cannot be discarded.
    let discarded = operator(
        &pool,
        serde_json::json!({"action": "discard_outbox", "outbox_ids": [all[2], all[0]], "actor": "alice", "reason": "the fix is deployed"}),
    )
    .await;
    assert_eq!(ids(&discarded, "discarded"), vec![all[2]]);
    assert_eq!(ids(&discarded, "not_failed"), vec![all[0]]);
    assert_eq!(
        decisions(&pool).await,
        [
            decided("delivered", 1, 1, true, false),
            decided("delivered", 1, 1, true, false),
            decided("discarded", 1, 0, false, true),
        ],
        "only the failed one is discarded"
    );
    let resend_discarded = operator(
        &pool,
        serde_json::json!({"action": "resend_outbox", "filter": {}, "all": true, "actor": "alice", "reason": "the fix is deployed"}),
    )
    .await;
    assert_eq!(
        ids(&resend_discarded, "resent"),
        Vec::<i64>::new(),
        "a discarded message is never sent again"
    );
    let report = shared::status::report(&pool, &Default::default())
        .await
        .unwrap();
    assert_eq!(report.outbox.failed, 0);
    assert!(
        report
            .findings
            .iter()
            .all(|f| f.kind != shared::status::FindingKind::FailedOutbox),
        "{:?}",
        report.findings
    );

    assert_eq!(retention_past_the_horizon(&pool).await, 3);
    assert_eq!(scalar(&pool, "SELECT count(*) FROM outbox").await, 0);
}

/// Discarding names what it discards: an empty list is refused with its reason.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_discard_without_ids_is_refused(pool: PgPool) {
    let request =
        shared::operator::parse(serde_json::json!({"action": "discard_outbox", "outbox_ids": []}))
            .unwrap();
    let registry = shared::effects::EffectRegistry::standard();
    let refused = shared::operator::handle(&pool, &registry, request)
        .await
        .unwrap_err();
    assert_eq!(
        refused.to_string(),
        "invalid request: discard_outbox needs the outbox_ids to discard"
    );
}

/// A deploy of the operator's decisions over a live outbox: every stored message keeps its
/// status, the widened status check ends validated over them, and it still refuses a status
/// nobody defined.
#[sqlx::test(migrations = false)]
async fn the_upgrade_keeps_every_stored_message(pool: PgPool) {
    let migrator = &shared::store::MIGRATOR;
    migrator.run_to(20261201000031, &pool).await.unwrap();
    sqlx::query(
        "INSERT INTO outbox (tenant_id, external_id, action, payload, idempotency_key, status, attempts) \
         SELECT 't', 'evt_' || s, 'entity.changed', '{}', 'key-' || s, s, n \
         FROM unnest(ARRAY['pending', 'delivered', 'failed'], ARRAY[0, 1, 8]) AS u(s, n)",
    )
    .execute(&pool)
    .await
    .unwrap();

    migrator.run(&pool).await.unwrap();

    assert_eq!(
        decisions(&pool).await,
        [
            decided("pending", 0, 0, false, false),
            decided("delivered", 1, 0, false, false),
            decided("failed", 8, 0, false, false),
        ]
    );
    let validated: bool = sqlx::query_scalar(
        "SELECT convalidated FROM pg_constraint WHERE conname = 'outbox_status_check'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(validated);
    let refused = sqlx::query("UPDATE outbox SET status = 'lost' WHERE status = 'failed'")
        .execute(&pool)
        .await
        .unwrap_err();
    assert_eq!(
        refused
            .as_database_error()
            .and_then(|e| e.code())
            .as_deref(),
        Some("23514"),
        "{refused}"
    );
}

/// A sender's bookkeeping commits without waiting for the WAL flush, and nothing else does: the
/// setting lives in its own transaction, so the connection, back in the pool, serves ingest and
/// the drain with `synchronous_commit` as the server has it (a 2xx is never answered before the
/// event is on disk).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn only_the_senders_own_transactions_commit_without_waiting_for_the_disk(pool: PgPool) {
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    let show = "SELECT current_setting('synchronous_commit')";
    let server: String = sqlx::query_scalar(show).fetch_one(&one).await.unwrap();
    assert_eq!(server, "on");

    let mut tx = shared::store::outbox::relaxed(&one).await.unwrap();
    let inside: String = sqlx::query_scalar(show).fetch_one(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
    let after: String = sqlx::query_scalar(show).fetch_one(&one).await.unwrap();

    assert_eq!(inside, "off", "the sender's transaction waits for the disk");
    assert_eq!(
        after, "on",
        "the relaxed setting outlived the sender's transaction on its connection"
    );
}

/// A batch stops once its payloads pass the bound a sender is given (a function holds two
/// batches in memory), the first message always taken so one larger than the bound still goes;
/// what it left is due for the next lease, in order.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_lease_stops_at_its_payload_bound_and_always_takes_one(pool: PgPool) {
    // Five messages of about 1 000 bytes each, stored as written (too small to compress).
    sqlx::query(
        "INSERT INTO outbox (tenant_id, external_id, action, payload, idempotency_key) \
         SELECT 't', 'e' || i, 'entity.changed', \
                jsonb_build_object('filler', (SELECT string_agg(md5(i::text || ':' || j), '') FROM generate_series(1, 30) AS j)), \
                'k' || i \
         FROM generate_series(1, 5) AS i",
    )
    .execute(&pool)
    .await
    .unwrap();
    let lease = |max_bytes: i64| {
        let pool = pool.clone();
        async move {
            let mut tx = shared::store::outbox::relaxed(&pool).await.unwrap();
            let leased = shared::store::outbox::lease(&mut *tx, 100, max_bytes, 60.0)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            leased
                .into_iter()
                .map(|m| m.external_id)
                .collect::<Vec<_>>()
        }
    };

    assert_eq!(lease(1).await, ["e1"], "the first message is always taken");
    assert_eq!(
        lease(2_500).await,
        ["e2", "e3", "e4"],
        "taken while the payloads before each were under the bound"
    );
    assert_eq!(lease(1 << 20).await, ["e5"]);
    assert!(lease(1 << 20).await.is_empty(), "each message leased once");
}

/// A lease lasts no longer than its pass can use it: no call starts after the pass's deadline
/// nor outlives the request timeout, so a sender that dies mid-pass (a function killed at its
/// timeout) frees its messages a request timeout after that deadline, not after the
/// (batch size + 1) request timeouts a whole batch sent one by one could take (over half an hour
/// at the defaults).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_sender_that_dies_frees_its_messages_soon_after_its_deadline(pool: PgPool) {
    outbox_rows(&pool, 3).await;
    let (_, gate, url, sending) = sending_to_a_gated_target(&pool, Duration::from_secs(2)).await;
    assert!(settings(&url).lease() > Duration::from_secs(1000));
    sending.abort();
    let held_for: f64 = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM max(leased_until) - now())::float8 FROM outbox WHERE status = 'pending'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    gate.add_permits(100);

    // The deadline (2 s), one request timeout (10 s) and the margin to commit (5 s).
    assert!(
        held_for > 0.0 && held_for <= 17.0,
        "a dead sender's messages stay hidden for {held_for} s"
    );
}
