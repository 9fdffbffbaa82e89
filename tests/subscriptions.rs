//! Subscriptions: the verified events themselves, forwarded to the services that subscribe to
//! them, against a real PostgreSQL, a real HTTP subscriber on a loopback port and, for the AWS
//! destinations, moto. Every signed delivery a test accepts is verified by the Standard Webhooks
//! reference library from PyPI (`STANDARD_WEBHOOKS_PYTHON`, installed by scripts/test), not by
//! this code's verifier.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use pipeline_tests::drain::{fast_settings, queue_len};
use pipeline_tests::*;
use shared::domain::Scheme;
use shared::drain::Drainer;
use shared::effects::EffectRegistry;
use shared::outbox::routes::{self, Route};
use shared::outbox::{OutboxSender, OutboxSettings};
use shared::secrets::{SecretSet, SecretStore};
use sqlx::PgPool;

const SUBSCRIBER_SECRET: &str = "whsec_c3Vic2NyaWJlci1zaWduaW5nLXNlY3JldC1mb3ItdGVzdHM=";
const SUBSCRIBER_SECRET_REF: &str = "subscriber/signing";
const GITHUB: &str = "github";

/// One request the subscriber answered.
#[derive(Debug, Clone)]
struct Arrival {
    status: u16,
    headers: HashMap<String, String>,
    body: Vec<u8>,
}

/// How the subscriber behaves: answers 500 to the first attempt of the ids in `fail_first`,
/// 503 to everything while `down` holds, 410 when `gone`, else 204.
#[derive(Default)]
struct Behaviour {
    fail_first: HashSet<String>,
    failed_once: HashSet<String>,
    down: Option<(Instant, Instant)>,
    gone: bool,
    arrivals: Vec<Arrival>,
}

type Subscriber = Arc<Mutex<Behaviour>>;

async fn receive(State(s): State<Subscriber>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let headers: HashMap<String, String> = headers
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
        .collect();
    let mut b = s.lock().unwrap();
    let id = headers.get("webhook-id").cloned().unwrap_or_default();
    let now = Instant::now();
    let status = if b.gone {
        StatusCode::GONE
    } else if b.down.is_some_and(|(from, to)| from <= now && now < to) {
        StatusCode::SERVICE_UNAVAILABLE
    } else if b.fail_first.contains(&id) && b.failed_once.insert(id.clone()) {
        StatusCode::INTERNAL_SERVER_ERROR
    } else {
        StatusCode::NO_CONTENT
    };
    b.arrivals.push(Arrival {
        status: status.as_u16(),
        headers,
        body: body.to_vec(),
    });
    status
}

/// A subscriber on a free loopback port: its URL and its state.
async fn subscriber() -> (String, Subscriber) {
    let state: Subscriber = Arc::default();
    let app = axum::Router::new()
        .route("/hooks", axum::routing::post(receive))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hooks", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, state)
}

fn secrets() -> SecretStore {
    SecretStore::memory([
        (
            "secret/github".to_owned(),
            SecretSet::new(secret_of(Scheme::Github), None),
        ),
        (
            SUBSCRIBER_SECRET_REF.to_owned(),
            SecretSet::new(SUBSCRIBER_SECRET, None),
        ),
    ])
}

async fn github_app(pool: &PgPool) -> TestApp {
    let mut github = source(GITHUB, TENANT, Scheme::Github, "secret/github");
    github.fields.entity_id = Some(shared::domain::FieldLocator::json("/repository/full_name"));
    TestApp::new(pool.clone(), &[github], secrets()).await
}

/// A GitHub delivery of event `id` of type `event_type` (the `X-GitHub-Event` header).
fn github_event(id: &str, event_type: &str, action: &str) -> Delivery {
    let mut d = delivery(
        Scheme::Github,
        &secret_of(Scheme::Github),
        id,
        now(),
        // Each body its own: the replay guard takes one body under two ids for a replay.
        serde_json::json!({"action": action, "repository": {"full_name": "acme/api"}, "n": id}),
    );
    set(&mut d.headers, "x-github-event", event_type);
    d
}

fn subscription_route(url: &str, name: &str, types: &[&str]) -> Route {
    let text = format!(
        "[[route]]\ntenant = \"{TENANT}\"\nsource = \"{GITHUB}\"\naction = \"event\"\nname = \"{name}\"\n\
         types = {types:?}\ndestination = \"http\"\nurl = \"{url}\"\nsigning_secret_ref = \"{SUBSCRIBER_SECRET_REF}\"\n"
    );
    routes::parse_routes("routes.toml", &text)
        .unwrap()
        .remove(0)
}

fn sender(pool: &PgPool) -> OutboxSender {
    OutboxSender::new(
        pool.clone(),
        OutboxSettings {
            max_attempts: 50,
            backoff_base: Duration::from_millis(50),
            backoff_cap: Duration::from_millis(400),
            idle_poll: Duration::from_millis(20),
            ..OutboxSettings::routed()
        },
    )
    .unwrap()
    .with_secrets(Arc::new(secrets()))
}

fn drainer(pool: &PgPool) -> Drainer {
    Drainer::new(
        pool.clone(),
        Arc::new(EffectRegistry::standard()),
        shared::drain::DrainSettings {
            idle_poll: Duration::from_millis(20),
            ..fast_settings()
        },
    )
}

async fn pending_messages(pool: &PgPool) -> i64 {
    scalar(
        pool,
        "SELECT count(*) FROM outbox WHERE status = 'pending' AND next_attempt_at < 'infinity'",
    )
    .await
}

async fn scalar(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Runs the drain and the outbox as the functions do, staying for work, until the queue and
/// the outbox hold nothing due (or `limit` passes).
async fn run_pipeline(pool: &PgPool, limit: Duration) {
    run_pipeline_with(pool, &drainer(pool), &sender(pool), limit).await
}

async fn run_pipeline_with(
    pool: &PgPool,
    drainer: &Drainer,
    sender: &OutboxSender,
    limit: Duration,
) {
    // The drain and the outbox stay for work until `limit`, as a deployed invocation stays
    // until its deadline; they are stopped when settled: nothing queued, nothing due or leased
    // (a settled sender holds no lease, so stopping it leaves nothing behind). A short stint
    // instead would cut the calls in flight at each of its ends short: retried with their keys
    // (at least once), they would reach the subscriber twice.
    let give_up = Instant::now() + limit;
    let running = async {
        let (drained, sent) = tokio::join!(drainer.stay_until(give_up), sender.stay_until(give_up));
        drained.unwrap();
        sent.unwrap();
    };
    let settled = async {
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            // The queue first: once it is empty, every message its events wrote exists.
            if queue_len(pool).await == 0 && pending_messages(pool).await == 0 {
                return;
            }
        }
    };
    tokio::select! {
        () = running => panic!("pipeline not settled after {limit:?}"),
        () = settled => {}
    }
}

/// Verifies every delivery with the Standard Webhooks reference library (PyPI), and checks that
/// it refuses one whose body was changed: prints how many verified.
fn verified_by_reference_library(arrivals: &[&Arrival]) -> usize {
    let python = std::env::var("STANDARD_WEBHOOKS_PYTHON").expect(
        "STANDARD_WEBHOOKS_PYTHON is not set: run the tests with scripts/test, which installs the Standard Webhooks reference library",
    );
    let lines: Vec<String> = arrivals
        .iter()
        .map(|a| {
            serde_json::json!({
                "headers": {
                    "webhook-id": a.headers["webhook-id"],
                    "webhook-timestamp": a.headers["webhook-timestamp"],
                    "webhook-signature": a.headers["webhook-signature"],
                },
                "body": String::from_utf8(a.body.clone()).unwrap(),
            })
            .to_string()
        })
        .collect();
    let file =
        std::env::temp_dir().join(format!("deliveries-{}-{}.jsonl", std::process::id(), now()));
    std::fs::write(&file, lines.join("\n")).unwrap();
    const SCRIPT: &str = r#"
import json, sys
from standardwebhooks.webhooks import Webhook, WebhookVerificationError
wh = Webhook(sys.argv[1])
verified = 0
first = None
for line in open(sys.argv[2]):
    d = json.loads(line)
    wh.verify(d["body"].encode(), d["headers"])
    verified += 1
    first = first or d
if first is not None:
    try:
        wh.verify(first["body"].encode() + b" ", first["headers"])
        sys.exit("a changed body verified")
    except WebhookVerificationError:
        pass
print(verified)
"#;
    let out = std::process::Command::new(python)
        .args(["-c", SCRIPT, SUBSCRIBER_SECRET])
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    assert!(
        out.status.success(),
        "the reference library refused a delivery: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// The issue's scenario: GitHub events of four types, some delivered twice, reach a subscription
/// filtered on two of them; the subscriber answers 500 to some first attempts and is down for a
/// while (SUBSCRIBER_DOWN_SECONDS, default 2). Each subscribed event arrives accepted exactly
/// once by idempotency key, every accepted delivery verified by the reference library, no other
/// type sent.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn every_subscribed_event_reaches_its_subscriber_once_signed(pool: PgPool) {
    let n: usize = std::env::var("SUBSCRIPTION_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let down_for = Duration::from_secs(
        std::env::var("SUBSCRIBER_DOWN_SECONDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2),
    );
    let app = github_app(&pool).await;
    let (url, state) = subscriber().await;
    routes::apply(
        &pool,
        &[subscription_route(
            &url,
            "issues-and-prs",
            &["issues", "pull_request"],
        )],
    )
    .await
    .unwrap();
    let types = ["issues", "pull_request", "push", "star"];
    let mut subscribed = HashSet::new();
    for i in 0..n {
        let id = format!("gh-{i}");
        if i % 4 < 2 {
            subscribed.insert(id.clone());
        }
        if i % 10 == 3 {
            let key = shared::effects::outbox_key(
                TENANT,
                &id,
                &shared::subscriptions::action_of("issues-and-prs"),
            );
            state.lock().unwrap().fail_first.insert(key);
        }
    }
    {
        let start = Instant::now() + Duration::from_millis(300);
        state.lock().unwrap().down = Some((start, start + down_for));
    }
    // Ingest and the pipeline run together, as they do deployed; every seventh event twice.
    let ingest = async {
        for i in 0..n {
            let (id, event_type) = (format!("gh-{i}"), types[i % types.len()]);
            let d = github_event(&id, event_type, "opened");
            let reply = app.post(GITHUB, d.headers.clone(), &d.body).await;
            assert!(reply.status.is_success(), "{reply:?}");
            if i % 7 == 0 {
                let again = app.post(GITHUB, d.headers, &d.body).await;
                assert_eq!(again.json["status"], "duplicate", "{again:?}");
            }
        }
    };
    let pipeline = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        run_pipeline(&pool, Duration::from_secs(120)).await;
    };
    tokio::join!(ingest, pipeline);
    run_pipeline(&pool, Duration::from_secs(120)).await;

    let arrivals = state.lock().unwrap().arrivals.clone();
    let accepted: Vec<&Arrival> = arrivals.iter().filter(|a| a.status == 204).collect();
    let refused = arrivals.len() - accepted.len();
    assert!(refused > 0, "the subscriber refused some attempts");
    let mut by_key: HashMap<&str, usize> = HashMap::new();
    let mut provider_ids = HashSet::new();
    for a in &accepted {
        *by_key.entry(a.headers["webhook-id"].as_str()).or_default() += 1;
        let envelope: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(envelope["id"], a.headers["webhook-id"].as_str());
        assert_eq!(envelope["specversion"], "1.0");
        assert!(
            ["issues", "pull_request"].contains(&envelope["type"].as_str().unwrap()),
            "only the subscribed types: {envelope}"
        );
        assert_eq!(envelope["tenant"], TENANT);
        assert_eq!(envelope["sourceid"], GITHUB);
        assert_eq!(
            envelope["source"],
            format!("/tenants/{TENANT}/sources/{GITHUB}")
        );
        assert_eq!(envelope["subject"], "acme/api");
        assert_eq!(envelope["data"]["repository"]["full_name"], "acme/api");
        provider_ids.insert(envelope["providerid"].as_str().unwrap().to_owned());
    }
    assert!(
        by_key.values().all(|n| *n == 1),
        "no event accepted twice: {by_key:?}"
    );
    assert_eq!(
        provider_ids, subscribed,
        "every subscribed event, and no other"
    );
    assert_eq!(accepted.len(), subscribed.len());
    assert_eq!(verified_by_reference_library(&accepted), accepted.len());
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE action = 'event:issues-and-prs' AND status = 'delivered'"
        )
        .await,
        subscribed.len() as i64
    );
    eprintln!(
        "{n} events ({} subscribed), {} attempts refused by the subscriber, {} accepted, all verified by the reference library",
        subscribed.len(),
        refused,
        accepted.len()
    );
}

/// A subscription hears of events processed after it exists; earlier ones only through a
/// replay, which keeps the keys, resumes where an interrupted run stopped, and skips events
/// whose payload retention purged.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_replay_sends_earlier_events_with_the_same_keys_and_resumes(pool: PgPool) {
    let app = github_app(&pool).await;
    let (url, state) = subscriber().await;
    for i in 0..20 {
        let d = github_event(&format!("old-{i}"), "issues", "opened");
        assert!(
            app.post(GITHUB, d.headers, &d.body)
                .await
                .status
                .is_success()
        );
    }
    run_pipeline(&pool, Duration::from_secs(30)).await;
    routes::apply(&pool, &[subscription_route(&url, "late", &["issues"])])
        .await
        .unwrap();
    let d = github_event("new-1", "issues", "opened");
    app.post(GITHUB, d.headers, &d.body).await;
    run_pipeline(&pool, Duration::from_secs(30)).await;
    let ids = |state: &Subscriber| -> Vec<String> {
        state
            .lock()
            .unwrap()
            .arrivals
            .iter()
            .map(|a| {
                serde_json::from_slice::<serde_json::Value>(&a.body).unwrap()["providerid"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect()
    };
    assert_eq!(
        ids(&state),
        vec!["new-1"],
        "earlier events are not sent unasked"
    );

    // Retention took one earlier payload.
    sqlx::query("UPDATE webhook_events SET payload = NULL WHERE external_id = 'old-0'")
        .execute(&pool)
        .await
        .unwrap();
    let request = shared::subscriptions::replay::ReplayRequest {
        tenant_id: TENANT.into(),
        subscription: "late".into(),
        source_id: None,
        event_types: vec![],
        since: chrono::Utc::now() - chrono::Duration::hours(1),
        until: chrono::Utc::now() + chrono::Duration::seconds(1),
        rate: Some(10.0),
    };
    // Interrupted: at 10 events a second, a run with half a second stops after a step.
    let first = shared::subscriptions::replay::run(
        &pool,
        &request,
        "alice",
        Some("catch up"),
        Instant::now() + Duration::from_millis(500),
    )
    .await
    .unwrap();
    assert!(!first.finished && !first.resumed, "{first:?}");
    assert!(first.remaining > 0, "{first:?}");
    let second = shared::subscriptions::replay::run(
        &pool,
        &request,
        "alice",
        Some("catch up"),
        Instant::now() + Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert!(second.finished && second.resumed, "{second:?}");
    assert_eq!(second.replay_id, first.replay_id);
    assert_eq!(second.skipped_purged, 1, "{second:?}");
    assert_eq!(
        second.queued, 20,
        "19 earlier events and new-1 again: {second:?}"
    );
    run_pipeline(&pool, Duration::from_secs(30)).await;
    let arrived = ids(&state);
    let mut distinct: Vec<&String> = arrived.iter().collect();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 20, "old-1..old-19 and new-1: {arrived:?}");
    assert!(!arrived.contains(&"old-0".to_owned()));
    // new-1 arrived twice, under one key: the subscriber deduplicates.
    let b = state.lock().unwrap();
    let new_keys: HashSet<&str> = b
        .arrivals
        .iter()
        .filter(|a| String::from_utf8_lossy(&a.body).contains("\"new-1\""))
        .map(|a| a.headers["webhook-id"].as_str())
        .collect();
    assert_eq!(new_keys.len(), 1);
    assert_eq!(
        b.arrivals
            .iter()
            .filter(|a| String::from_utf8_lossy(&a.body).contains("\"new-1\""))
            .count(),
        2
    );
}

/// A subscriber's bad day: paused by an operator, its messages wait and none is dropped;
/// resumed, they go. A subscriber answering 410 Gone pauses its subscription instead of being
/// retried. Both are shown per subscription, and the pause and resume are recorded.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_paused_or_gone_subscription_keeps_its_messages(pool: PgPool) {
    let app = github_app(&pool).await;
    let (url, state) = subscriber().await;
    routes::apply(&pool, &[subscription_route(&url, "ops", &[])])
        .await
        .unwrap();
    let registry = EffectRegistry::standard();
    let ask = |request: serde_json::Value| {
        let pool = pool.clone();
        let registry = &registry;
        async move {
            let request = shared::operator::parse(request).unwrap();
            serde_json::to_value(
                shared::operator::handle(&pool, registry, request)
                    .await
                    .unwrap(),
            )
            .unwrap()
        }
    };
    let paused = ask(
        serde_json::json!({"action": "pause_subscription", "tenant_id": TENANT,
        "subscription": "ops", "actor": "alice", "reason": "subscriber deploying"}),
    )
    .await;
    assert_eq!(paused["newly"], true);
    for i in 0..5 {
        let d = github_event(&format!("p-{i}"), "push", "opened");
        app.post(GITHUB, d.headers, &d.body).await;
    }
    run_pipeline(&pool, Duration::from_secs(30)).await;
    assert!(
        state.lock().unwrap().arrivals.is_empty(),
        "nothing sent while paused"
    );
    // Reconcile hurries overdue messages; a paused subscription's stay parked.
    shared::store::reconcile::hurry_outbox(&pool, 0.0)
        .await
        .unwrap();
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE next_attempt_at = 'infinity'"
        )
        .await,
        5,
        "reconcile does not wake a paused subscription's messages"
    );
    let listed = ask(serde_json::json!({"action": "list_subscriptions"})).await;
    let ops = &listed["subscriptions"][0];
    assert_eq!(
        (ops["undelivered"].as_i64(), ops["paused"].as_bool()),
        (Some(5), Some(true))
    );
    let resumed = ask(
        serde_json::json!({"action": "resume_subscription", "tenant_id": TENANT,
        "subscription": "ops", "actor": "alice", "reason": "subscriber back"}),
    )
    .await;
    assert_eq!(resumed["due"], 5);
    run_pipeline(&pool, Duration::from_secs(30)).await;
    assert_eq!(state.lock().unwrap().arrivals.len(), 5);

    // Gone: one attempt, then the subscription is paused by the sender, the message parked.
    state.lock().unwrap().gone = true;
    let d = github_event("g-1", "push", "opened");
    app.post(GITHUB, d.headers, &d.body).await;
    run_pipeline(&pool, Duration::from_secs(30)).await;
    assert_eq!(
        state.lock().unwrap().arrivals.len(),
        6,
        "one try, not retried"
    );
    let listed = ask(serde_json::json!({"action": "list_subscriptions"})).await;
    let ops = &listed["subscriptions"][0];
    assert_eq!(
        (
            ops["undelivered"].as_i64(),
            ops["paused"].as_bool(),
            ops["failed"].as_i64()
        ),
        (Some(1), Some(true), Some(0))
    );
    let status = ask(serde_json::json!({"action": "status"})).await;
    assert_eq!(status["subscriptions"][0]["paused"], true, "{status}");
    let pause: (String, String) =
        sqlx::query_as("SELECT actor, reason FROM subscription_pauses WHERE name = 'ops'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(pause.0, shared::outbox::GONE_ACTOR);
    assert!(pause.1.contains("410"), "{pause:?}");
    state.lock().unwrap().gone = false;
    ask(
        serde_json::json!({"action": "resume_subscription", "tenant_id": TENANT,
        "subscription": "ops", "actor": "alice", "reason": "subscriber fixed"}),
    )
    .await;
    run_pipeline(&pool, Duration::from_secs(30)).await;
    assert_eq!(state.lock().unwrap().arrivals.last().unwrap().status, 204);
    let recorded = scalar(
        &pool,
        "SELECT count(*) FROM operator_actions WHERE action IN ('pause_subscription', 'resume_subscription') AND actor = 'alice'",
    )
    .await;
    assert_eq!(recorded, 3);
}

/// A subscription's rate limit: a burst of a second's worth goes at once, the rest waits its
/// turn without spending an attempt.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_rate_limited_subscription_is_sent_at_its_pace(pool: PgPool) {
    let app = github_app(&pool).await;
    let (url, state) = subscriber().await;
    let text = format!(
        "[[route]]\ntenant = \"{TENANT}\"\naction = \"event\"\nname = \"slow\"\ndestination = \"http\"\n\
         url = \"{url}\"\nrate_limit = 10\n"
    );
    routes::apply(&pool, &routes::parse_routes("r.toml", &text).unwrap())
        .await
        .unwrap();
    for i in 0..30 {
        let d = github_event(&format!("r-{i}"), "push", "opened");
        app.post(GITHUB, d.headers, &d.body).await;
    }
    let started = Instant::now();
    // One sender throughout: the limit is kept per sender process.
    run_pipeline_with(
        &pool,
        &drainer(&pool),
        &sender(&pool),
        Duration::from_secs(30),
    )
    .await;
    let took = started.elapsed();
    let arrivals = state.lock().unwrap().arrivals.clone();
    assert_eq!(arrivals.len(), 30, "every message, once");
    assert!(
        arrivals
            .iter()
            .all(|a| !a.headers.contains_key("webhook-signature")),
        "a route without a secret sends unsigned"
    );
    assert!(
        took >= Duration::from_millis(1500),
        "30 at 10/s after a burst of 10: {took:?}"
    );
    assert_eq!(
        scalar(&pool, "SELECT max(attempts)::bigint FROM outbox").await,
        1,
        "waiting spent no attempt"
    );
}

#[test]
fn a_subscription_route_is_checked_with_its_reason() {
    let refused = |extra: &str| {
        let text = format!(
            "[[route]]\ntenant = \"a\"\naction = \"event\"\ndestination = \"http\"\nurl = \"https://x\"\n{extra}"
        );
        routes::parse_routes("r.toml", &text)
            .unwrap_err()
            .to_string()
    };
    assert!(refused("").contains("needs a name"));
    assert!(refused("name = \"Bad Name\"").contains("is not a subscription name"));
    assert!(
        refused("name = \"a\"\nfilter = { pointer = \"x\", equals = 1 }").contains("JSON pointer")
    );
    assert!(refused("name = \"a\"\nfilter = { pointer = \"/x\" }").contains("equals"));
    assert!(refused("name = \"a\"\nrate_limit = 0").contains("rate_limit"));
    let twice = "[[route]]\ntenant = \"a\"\naction = \"event\"\nname = \"s\"\ndestination = \"http\"\nurl = \"https://x\"\n\
                 [[route]]\ntenant = \"a\"\naction = \"event\"\nname = \"s\"\ndestination = \"http\"\nurl = \"https://y\"\n";
    assert!(
        routes::parse_routes("r.toml", twice)
            .unwrap_err()
            .to_string()
            .contains("routed twice")
    );
    let sqs_signed = "[[route]]\ntenant = \"a\"\naction = \"entity.changed\"\ndestination = \"sqs\"\n\
        queue_url = \"https://sqs.us-east-1.amazonaws.com/123456789012/q\"\nsigning_secret_ref = \"x\"\n";
    assert!(
        routes::parse_routes("r.toml", sqs_signed)
            .unwrap_err()
            .to_string()
            .contains("signs HTTP")
    );
    let not_event = "[[route]]\ntenant = \"a\"\naction = \"entity.changed\"\nname = \"x\"\ndestination = \"http\"\nurl = \"https://x\"\n";
    assert!(
        routes::parse_routes("r.toml", not_event)
            .unwrap_err()
            .to_string()
            .contains("belongs to a subscription")
    );
}

/// An `entity.changed` route to HTTP that names a secret signs its deliveries too; while the
/// secret is rolled each carries two signatures, and a subscriber holding only the previous
/// secret verifies it with the reference library.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_effect_route_signs_and_a_rolled_secret_signs_twice(pool: PgPool) {
    use pipeline_tests::drain::{ENTITIES, ENTITIES_SECRET, entity_event, entity_source};
    let secrets = SecretStore::memory([
        (
            "secret/entities".to_owned(),
            SecretSet::new(ENTITIES_SECRET, None),
        ),
        (
            SUBSCRIBER_SECRET_REF.to_owned(),
            SecretSet::new(
                "whsec_bmV3LXN1YnNjcmliZXItc2VjcmV0LWFmdGVyLXRoZS1yb2xs",
                Some(SUBSCRIBER_SECRET.to_owned()),
            ),
        ),
    ]);
    let app = TestApp::new(pool.clone(), &[entity_source()], secrets).await;
    let (url, state) = subscriber().await;
    let text = format!(
        "[[route]]\ntenant = \"{TENANT}\"\naction = \"entity.changed\"\ndestination = \"http\"\n\
         url = \"{url}\"\nsigning_secret_ref = \"{SUBSCRIBER_SECRET_REF}\"\n"
    );
    routes::apply(&pool, &routes::parse_routes("r.toml", &text).unwrap())
        .await
        .unwrap();
    for i in 0..3 {
        let d = entity_event(&format!("e-{i}"), &format!("thing-{i}"), 1, "thing.updated");
        app.post(ENTITIES, d.headers, &d.body).await;
    }
    let rolled = SecretStore::memory([(
        SUBSCRIBER_SECRET_REF.to_owned(),
        SecretSet::new(
            "whsec_bmV3LXN1YnNjcmliZXItc2VjcmV0LWFmdGVyLXRoZS1yb2xs",
            Some(SUBSCRIBER_SECRET.to_owned()),
        ),
    )]);
    let sender = OutboxSender::new(
        pool.clone(),
        OutboxSettings {
            idle_poll: Duration::from_millis(20),
            ..OutboxSettings::routed()
        },
    )
    .unwrap()
    .with_secrets(Arc::new(rolled));
    run_pipeline_with(&pool, &drainer(&pool), &sender, Duration::from_secs(30)).await;
    let arrivals = state.lock().unwrap().arrivals.clone();
    assert_eq!(arrivals.len(), 3);
    for a in &arrivals {
        assert_eq!(
            a.headers["webhook-signature"].split(' ').count(),
            2,
            "{a:?}"
        );
        assert_eq!(a.headers["webhook-id"], a.headers["idempotency-key"]);
        let body: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(
            body["action"], "entity.changed",
            "an effect's body, as before"
        );
    }
    // The reference library, holding the previous secret only, verifies every one.
    let accepted: Vec<&Arrival> = arrivals.iter().collect();
    assert_eq!(verified_by_reference_library(&accepted), 3);
}

/// On SQS and SNS a subscriber selects on message attributes without parsing, and reads the
/// envelope as the body; an envelope over SNS's 256 KiB goes without its data, marked, with the
/// request that fetches it, which answers the data.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn aws_subscribers_get_attributes_and_a_too_large_envelope_goes_without_data(pool: PgPool) {
    use aws_sdk_sqs::types::QueueAttributeName;
    let app = github_app(&pool).await;
    let config = shared::aws::sdk_config(&shared::aws::AwsEndpoint {
        endpoint_url: Some(moto_endpoint()),
        region: Some("us-east-1".into()),
    })
    .await;
    let sqs = aws_sdk_sqs::Client::new(&config);
    let sns = aws_sdk_sns::Client::new(&config);
    let suffix = format!("{}-{}", std::process::id(), now());
    let queue_url = sqs
        .create_queue()
        .queue_name(format!("subscribed-{suffix}"))
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    let tap_url = sqs
        .create_queue()
        .queue_name(format!("topic-tap-{suffix}"))
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    let tap_arn = sqs
        .get_queue_attributes()
        .queue_url(&tap_url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap()
        .remove(&QueueAttributeName::QueueArn)
        .unwrap();
    let topic_arn = sns
        .create_topic()
        .name(format!("subscribed-{suffix}"))
        .send()
        .await
        .unwrap()
        .topic_arn
        .unwrap();
    sns.subscribe()
        .topic_arn(&topic_arn)
        .protocol("sqs")
        .endpoint(&tap_arn)
        .attributes("RawMessageDelivery", "true")
        .send()
        .await
        .unwrap();
    let text = format!(
        "[[route]]\ntenant = \"{TENANT}\"\naction = \"event\"\nname = \"to-queue\"\ndestination = \"sqs\"\nqueue_url = \"{queue_url}\"\n\
         [[route]]\ntenant = \"{TENANT}\"\naction = \"event\"\nname = \"to-topic\"\ndestination = \"sns\"\ntopic_arn = \"{topic_arn}\"\n"
    );
    routes::apply(&pool, &routes::parse_routes("r.toml", &text).unwrap())
        .await
        .unwrap();
    let d = github_event("small-1", "issues", "opened");
    app.post(GITHUB, d.headers, &d.body).await;
    // 300 KiB of issue text: over SNS's limit, under SQS's.
    let big = delivery(
        Scheme::Github,
        &secret_of(Scheme::Github),
        "big-1",
        now(),
        serde_json::json!({"action": "opened", "repository": {"full_name": "acme/api"},
                           "issue": {"body": "x".repeat(300 * 1024)}}),
    );
    let big_app = TestApp::with_limits(
        pool.clone(),
        &[],
        secrets(),
        Duration::from_secs(30),
        1 << 20,
    )
    .await;
    let reply = big_app.post(GITHUB, big.headers, &big.body).await;
    assert!(reply.status.is_success(), "{reply:?}");
    let sender = OutboxSender::new(
        pool.clone(),
        OutboxSettings {
            idle_poll: Duration::from_millis(20),
            endpoints: shared::outbox::destinations::AwsDestinationEndpoints::all(
                shared::aws::AwsEndpoint {
                    endpoint_url: Some(moto_endpoint()),
                    region: Some("us-east-1".into()),
                },
            ),
            ..OutboxSettings::routed()
        },
    )
    .unwrap();
    run_pipeline_with(&pool, &drainer(&pool), &sender, Duration::from_secs(60)).await;
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE status = 'delivered'"
        )
        .await,
        4
    );

    let read = |url: String| {
        let sqs = sqs.clone();
        async move {
            let mut out = Vec::new();
            for _ in 0..20 {
                let got = sqs
                    .receive_message()
                    .queue_url(&url)
                    .max_number_of_messages(10)
                    .message_attribute_names("All")
                    .send()
                    .await
                    .unwrap()
                    .messages
                    .unwrap_or_default();
                out.extend(got);
                if out.len() >= 2 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            out
        }
    };
    let queued = read(queue_url).await;
    assert_eq!(queued.len(), 2);
    for m in &queued {
        let attributes = m.message_attributes.clone().unwrap();
        assert_eq!(attributes["type"].string_value(), Some("issues"));
        assert_eq!(attributes["tenant"].string_value(), Some(TENANT));
        assert_eq!(
            attributes["source"].string_value(),
            Some(format!("/tenants/{TENANT}/sources/{GITHUB}").as_str())
        );
        let envelope: serde_json::Value = serde_json::from_str(m.body().unwrap()).unwrap();
        assert!(
            envelope["data"].is_object(),
            "SQS takes 1 MiB: the data stays"
        );
    }
    let published = read(tap_url).await;
    assert_eq!(published.len(), 2);
    let envelopes: Vec<serde_json::Value> = published
        .iter()
        .map(|m| serde_json::from_str(m.body().unwrap()).unwrap())
        .collect();
    let slim = envelopes
        .iter()
        .find(|e| e["providerid"] == "big-1")
        .unwrap();
    assert!(slim.get("data").is_none(), "{slim}");
    assert_eq!(slim["dataomitted"], "too_large");
    let fetch: serde_json::Value =
        serde_json::from_str(slim["datafetch"].as_str().unwrap()).unwrap();
    let registry = EffectRegistry::standard();
    let shown = shared::operator::handle(&pool, &registry, shared::operator::parse(fetch).unwrap())
        .await
        .unwrap();
    let shown = serde_json::to_value(shown).unwrap();
    assert_eq!(
        shown["data"]["issue"]["body"].as_str().map(str::len),
        Some(300 * 1024),
        "the operator request in datafetch returns the data"
    );
    let small = envelopes
        .iter()
        .find(|e| e["providerid"] == "small-1")
        .unwrap();
    assert!(small["data"].is_object());
}

/// The operator's commands as a user runs them: `hookctl routes pause` and `resume` exit 0 and
/// are recorded with the actor; pausing a subscription the route file lacks exits 2; `hookctl
/// events replay --json` exits 0 once its range is done and its messages reach the subscriber;
/// `--until` before `--since` exits 2 and queues nothing.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_subscription_commands_exit_as_documented(pool: PgPool) {
    use hookctl::backend::Backend;
    use hookctl::commands::{self, Decision, EventsAction, ReplayArgs, SubscriptionName};
    let app = github_app(&pool).await;
    let (url, state) = subscriber().await;
    for i in 0..4 {
        let d = github_event(&format!("c-{i}"), "issues", "opened");
        app.post(GITHUB, d.headers, &d.body).await;
    }
    run_pipeline(&pool, Duration::from_secs(30)).await;
    routes::apply(&pool, &[subscription_route(&url, "cli", &["issues"])])
        .await
        .unwrap();
    let backend = Backend::direct(pool.clone());
    let decision = |reason: &str| Decision {
        reason: reason.into(),
        actor: Some("bob".into()),
    };
    let name = |name: &str| SubscriptionName {
        tenant: TENANT.into(),
        name: name.into(),
    };
    assert_eq!(
        commands::pause_or_resume(&backend, true, true, name("cli"), decision("deploying")).await,
        0
    );
    assert_eq!(
        commands::pause_or_resume(&backend, true, true, name("nope"), decision("typo")).await,
        2,
        "a subscription the route file lacks"
    );
    assert_eq!(
        commands::pause_or_resume(&backend, true, false, name("cli"), decision("deployed")).await,
        0
    );
    let replay = |since: chrono::DateTime<chrono::Utc>, until| ReplayArgs {
        subscription: "cli".into(),
        tenant: TENANT.into(),
        source: None,
        types: vec![],
        since,
        until: Some(until),
        rate: None,
        decision: decision("catch up"),
    };
    let now = chrono::Utc::now();
    let refused = commands::events(
        &backend,
        true,
        EventsAction::Replay(replay(now, now - chrono::Duration::hours(1))),
    )
    .await;
    assert_eq!(refused, 2);
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE action = 'event:cli'"
        )
        .await,
        0
    );
    let done = commands::events(
        &backend,
        true,
        EventsAction::Replay(replay(
            now - chrono::Duration::hours(1),
            now + chrono::Duration::seconds(1),
        )),
    )
    .await;
    assert_eq!(done, 0);
    run_pipeline(&pool, Duration::from_secs(30)).await;
    assert_eq!(state.lock().unwrap().arrivals.len(), 4);
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM operator_actions WHERE actor = 'bob' \
             AND action IN ('pause_subscription', 'resume_subscription', 'replay_to_subscription')"
        )
        .await,
        3
    );
}

/// Day 60: retention purges an event's payload, and the copies subscriptions hold go with it.
/// A delivered message keeps no data past the payload horizon; a message still waiting (its
/// subscription paused) is sent after the purge without data, marked `purged`, with the request
/// that says so.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_payload_purge_takes_the_data_out_of_subscription_messages(pool: PgPool) {
    let app = github_app(&pool).await;
    let (url, state) = subscriber().await;
    routes::apply(
        &pool,
        &[
            subscription_route(&url, "now", &[]),
            subscription_route(&url, "later", &[]),
        ],
    )
    .await
    .unwrap();
    shared::store::subscriptions::pause(&pool, TENANT, "later", "its subscriber is down", "alice")
        .await
        .unwrap();
    let d = github_event("p-1", "issues", "opened");
    app.post(GITHUB, d.headers, &d.body).await;
    run_pipeline(&pool, Duration::from_secs(30)).await;
    assert_eq!(state.lock().unwrap().arrivals.len(), 1);

    let purged = shared::store::retention::purge_payloads(&pool, 0.0, 100)
        .await
        .unwrap();
    assert_eq!(purged.purged, 1);
    let kept: Vec<(String, serde_json::Value)> =
        sqlx::query_as("SELECT action, payload FROM outbox ORDER BY action")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(kept.len(), 2);
    for (action, envelope) in &kept {
        assert!(
            envelope.get("data").is_none(),
            "{action} kept the data: {envelope}"
        );
        assert_eq!(envelope["dataomitted"], "purged", "{action}");
        assert_eq!(envelope["providerid"], "p-1");
    }
    shared::store::subscriptions::resume(
        &mut pool.acquire().await.unwrap(),
        TENANT,
        "later",
        &shared::subscriptions::action_of("later"),
    )
    .await
    .unwrap();
    run_pipeline(&pool, Duration::from_secs(30)).await;
    let arrivals = state.lock().unwrap().arrivals.clone();
    assert_eq!(arrivals.len(), 2);
    let late: serde_json::Value = serde_json::from_slice(&arrivals[1].body).unwrap();
    assert!(late.get("data").is_none(), "{late}");
    assert_eq!(late["dataomitted"], "purged");
    let fetch: serde_json::Value =
        serde_json::from_str(late["datafetch"].as_str().unwrap()).unwrap();
    assert_eq!(
        (fetch["action"].as_str(), fetch["external_id"].as_str()),
        (Some("show_event"), Some("p-1"))
    );
}

/// A subscription naming a source its tenant does not have is refused with the route file
/// whole, as a route naming one is: nothing of the file is stored.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_subscription_to_an_unknown_source_is_refused_whole(pool: PgPool) {
    let _app = github_app(&pool).await;
    let text = format!(
        "[[route]]\ntenant = \"{TENANT}\"\naction = \"event\"\nname = \"fine\"\ndestination = \"http\"\nurl = \"https://x.example\"\n\
         [[route]]\ntenant = \"{TENANT}\"\nsource = \"nope\"\naction = \"event\"\nname = \"stray\"\ndestination = \"http\"\nurl = \"https://x.example\"\n"
    );
    let refused = routes::apply(&pool, &routes::parse_routes("r.toml", &text).unwrap())
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("nope"), "{refused}");
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM outbox_subscriptions").await,
        0
    );
}
