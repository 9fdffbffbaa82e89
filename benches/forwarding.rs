//! How long a verified event takes to reach a subscriber: from ingest's answer to the
//! subscriber's receipt, at a steady rate (BENCH_RATE, default 100 events/s, for BENCH_SECONDS,
//! default 20), with the drain and the outbox running as the functions run them in AWS (each
//! staying for new work, polling every 100 ms: the deployed defaults) and a subscription sending
//! every event, signed, to a local HTTP subscriber.
//!
//! Beside it, in the same run: the time of one direct upsert of the same event plus one POST of
//! its envelope to the same subscriber (the floor: what a request costs with no queue between),
//! and the limit, one second at p99. Each figure is printed with its ratio to both.
//!
//! Run: `./scripts/bench forwarding` (DATABASE_URL with the right to create a database).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use shared::domain::Scheme;
use shared::drain::{DrainSettings, Drainer};
use shared::effects::EffectRegistry;
use shared::ingest::{IngestLimits, Ingestor};
use shared::outbox::routes;
use shared::outbox::{OutboxSender, OutboxSettings};
use shared::secrets::{SecretSet, SecretStore};
use shared::sources::{self, SourceRegistry};

const SECRET: &str = "whsec_bench";
const SUBSCRIBER_SECRET: &str = "whsec_YmVuY2gtc3Vic2NyaWJlci1zaWduaW5nLXNlY3JldA==";

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

type Receipts = Arc<Mutex<HashMap<String, Instant>>>;

async fn receive(State(receipts): State<Receipts>, body: Bytes) -> &'static str {
    let at = Instant::now();
    if let Ok(envelope) = serde_json::from_slice::<serde_json::Value>(&body)
        && let Some(id) = envelope["providerid"].as_str()
    {
        receipts.lock().unwrap().entry(id.to_owned()).or_insert(at);
    }
    "ok"
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[tokio::main]
async fn main() {
    let (rate, seconds) = (env("BENCH_RATE", 100), env("BENCH_SECONDS", 20));
    let db = benchmarks::BenchDatabase::create("bench_forwarding").await;
    let pool = db.pool.clone();
    sources::apply(
        &pool,
        &[benchmarks::source(Scheme::Stripe, Duration::from_secs(300))],
    )
    .await
    .unwrap();
    let receipts: Receipts = Arc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hooks", listener.local_addr().unwrap());
    let app = axum::Router::new()
        .route("/hooks", axum::routing::post(receive))
        .with_state(receipts.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let text = format!(
        "[[route]]\ntenant = \"bench\"\naction = \"event\"\nname = \"everything\"\n\
         destination = \"http\"\nurl = \"{url}\"\nsigning_secret_ref = \"subscriber\"\n"
    );
    routes::apply(&pool, &routes::parse_routes("bench.toml", &text).unwrap())
        .await
        .unwrap();
    let secrets = Arc::new(SecretStore::memory([
        ("bench".to_owned(), SecretSet::new(SECRET, None)),
        (
            "subscriber".to_owned(),
            SecretSet::new(SUBSCRIBER_SECRET, None),
        ),
    ]));
    let ingestor = Arc::new(Ingestor::new(
        pool.clone(),
        Arc::new(SourceRegistry::new(pool.clone(), Duration::from_secs(3600))),
        secrets.clone(),
        IngestLimits {
            max_body_bytes: 1 << 20,
        },
    ));
    // The functions as deployed: default settings, staying for work.
    let drainer = Arc::new(Drainer::new(
        pool.clone(),
        Arc::new(EffectRegistry::standard()),
        DrainSettings::default(),
    ));
    let sender = Arc::new(
        OutboxSender::new(pool.clone(), OutboxSettings::routed())
            .unwrap()
            .with_secrets(secrets.clone()),
    );
    let total = Duration::from_secs(seconds + 10);
    let pipeline = {
        let (drainer, sender) = (drainer.clone(), sender.clone());
        tokio::spawn(async move {
            let until = Instant::now() + total;
            let (d, s) = tokio::join!(drainer.stay_until(until), sender.stay_until(until));
            d.unwrap();
            s.unwrap();
        })
    };

    // Ingest at a steady rate: event i is sent at start + i/rate; its answer time recorded.
    let n = (rate * seconds) as usize;
    let at = shared::ingest::unix_now();
    let answered: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let start = Instant::now();
    let mut sends = Vec::with_capacity(n);
    for i in 0..n {
        let due = start + Duration::from_secs_f64(i as f64 / rate as f64);
        tokio::time::sleep_until(due.into()).await;
        let id = format!("evt_fwd_{i}");
        let req = benchmarks::signed_request(benchmarks::stripe_event_body(&id), at, SECRET);
        let (ingestor, answered) = (ingestor.clone(), answered.clone());
        sends.push(tokio::spawn(async move {
            let response = ingest::handler(req, &ingestor).await.unwrap();
            assert_eq!(response.status(), 200);
            answered.lock().unwrap().insert(id, Instant::now());
        }));
    }
    for s in sends {
        s.await.unwrap();
    }
    let give_up = Instant::now() + Duration::from_secs(10);
    while receipts.lock().unwrap().len() < n && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (answered, received) = (
        answered.lock().unwrap().clone(),
        receipts.lock().unwrap().clone(),
    );
    assert_eq!(received.len(), n, "every event reached the subscriber");
    let mut latencies: Vec<f64> = answered
        .iter()
        .map(|(id, a)| {
            received[id]
                .checked_duration_since(*a)
                .unwrap_or_default()
                .as_secs_f64()
                * 1000.0
        })
        .collect();
    latencies.sort_by(f64::total_cmp);
    pipeline.abort();

    // The floor: one direct upsert of a like event and one POST of an envelope, one after the
    // other, 200 times; the median.
    let http = reqwest::Client::new();
    let mut floor = Vec::new();
    for i in 0..200 {
        let body = benchmarks::stripe_event_body(&format!("evt_floor_{i}"));
        let t = Instant::now();
        sqlx::query(
            "INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, payload, \
                 payload_sha256, verified_with, received_at, first_received_at, last_seen_at) \
             VALUES ('bench', $1, 'bench', 'payment_intent.succeeded', $2, sha256($2), 'current', now(), now(), now()) \
             ON CONFLICT (tenant_id, external_id) DO NOTHING",
        )
        .bind(format!("evt_floor_{i}"))
        .bind(&body)
        .execute(&pool)
        .await
        .unwrap();
        http.post(&url)
            .header("content-type", "application/json")
            .body(
                serde_json::json!({"providerid": format!("floor_{i}"), "data": "x".repeat(1024)})
                    .to_string(),
            )
            .send()
            .await
            .unwrap();
        floor.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let floor = benchmarks::median(&mut floor);

    println!(
        "ingest's answer to the subscriber's receipt, {n} Stripe events at {rate}/s, drain and outbox staying for work (100 ms polls), one signed HTTP subscription"
    );
    println!(
        "{:>8} {:>10} {:>22} {:>16}",
        "", "ms", "x (upsert + POST)", "x (1 s limit)"
    );
    for (name, p) in [("p50", 0.50), ("p90", 0.90), ("p99", 0.99), ("max", 1.0)] {
        let v = percentile(&latencies, p);
        println!(
            "{name:>8} {v:>10.1} {:>21.1}x {:>15.3}x",
            v / floor,
            v / 1000.0
        );
    }
    println!(
        "{:>8} {floor:>10.2}   (one direct upsert + one POST, median of 200)",
        "floor"
    );
    db.drop().await;
}
