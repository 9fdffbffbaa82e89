//! Ingest handler throughput at 1, 4 and 16 concurrent requests, beside `pgbench` running the
//! same upsert statement on the same table, in the same database, in the same run.
//!
//! Each level runs the Lambda handler (signature verification, field extraction, one upsert
//! statement, commit) over fresh 1 KiB Stripe events for BENCH_SECONDS (default 10), then runs
//! pgbench with that statement's text, its parameters filled with a 1 KiB payload, for as long
//! and with as many connections. The ratio handler/pgbench is the share of the database's raw
//! upsert rate the whole ingest path keeps.
//!
//! Run: `./scripts/bench ingest` (needs DATABASE_URL with the right to create a database).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use http::HeaderMap;
use lambda_http::{Body, RequestExt};
use shared::domain::Scheme;
use shared::ingest::{IngestLimits, Ingestor};
use shared::secrets::{SecretSet, SecretStore, SigningSecret};
use shared::sources::{self, SourceRegistry};
use shared::store::{self, webhook_events};
use sqlx::postgres::PgConnectOptions;

const SECRET: &str = "whsec_bench";
const PAYLOAD_BYTES: usize = 1024;

fn event_body(id: &str) -> Vec<u8> {
    let mut body = serde_json::json!({
        "id": id, "object": "event", "type": "payment_intent.succeeded",
        "data": {"object": {"id": "pi_bench", "amount": 4200, "currency": "eur", "padding": ""}}
    });
    let base = serde_json::to_vec(&body).unwrap().len();
    body["data"]["object"]["padding"] =
        serde_json::Value::String("x".repeat(PAYLOAD_BYTES.saturating_sub(base)));
    serde_json::to_vec(&body).unwrap()
}

fn request(body: Vec<u8>, at: i64) -> lambda_http::Request {
    let headers: HeaderMap =
        shared::signature::sign(Scheme::Stripe, &SigningSecret::new(SECRET), "", at, &body)
            .unwrap()
            .into_iter()
            .chain([(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            )])
            .collect();
    let mut req = http::Request::builder()
        .method("POST")
        .uri("/webhooks/bench")
        .body(Body::Binary(body))
        .unwrap();
    *req.headers_mut() = headers;
    req.with_path_parameters(std::collections::HashMap::from([(
        "source_id".to_owned(),
        "bench".to_owned(),
    )]))
}

/// A pool built as the functions build theirs ([`store::pool_options`]), `concurrency`
/// connections, all open before the clock starts.
async fn deployed_pool(options: &PgConnectOptions, concurrency: usize) -> sqlx::PgPool {
    store::pool_options(&store::PoolSettings {
        max_connections: concurrency as u32,
        acquire_timeout: Duration::from_secs(3),
    })
    .min_connections(concurrency as u32)
    .connect_with(options.clone())
    .await
    .unwrap()
}

/// Requests are signed before the clock starts, so the figure is the handler's alone.
const PREBUILT_PER_SECOND: u64 = 12_000;

async fn run_handler(
    options: &PgConnectOptions,
    concurrency: usize,
    seconds: u64,
    level: usize,
) -> f64 {
    let pool = deployed_pool(options, concurrency).await;
    let registry = Arc::new(SourceRegistry::new(pool.clone(), Duration::from_secs(3600)));
    let secrets = SecretStore::memory([("bench".to_owned(), SecretSet::new(SECRET, None))]);
    let ingestor = Arc::new(Ingestor::new(
        pool,
        registry,
        Arc::new(secrets),
        IngestLimits {
            max_body_bytes: 1 << 20,
        },
    ));
    let at = shared::ingest::unix_now();
    let prebuilt: Vec<_> = (0..PREBUILT_PER_SECOND * seconds)
        .map(|n| std::sync::Mutex::new(Some(request(event_body(&format!("evt_l{level}_{n}")), at))))
        .collect();
    let prebuilt = Arc::new(prebuilt);
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (ingestor, prebuilt, next, done) = (
                ingestor.clone(),
                prebuilt.clone(),
                next.clone(),
                done.clone(),
            );
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let Some(slot) = prebuilt.get(n) else {
                        panic!("ran out of prebuilt requests: raise PREBUILT_PER_SECOND");
                    };
                    let req = slot.lock().unwrap().take().unwrap();
                    let response = ingest::handler(req, &ingestor).await.unwrap();
                    assert_eq!(response.status(), 200, "{:?}", response.body());
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// The same statement through sqlx alone (no signature, no parsing): separates the driver's
/// share of the gap from the handler's.
async fn run_store_only(
    options: &PgConnectOptions,
    concurrency: usize,
    seconds: u64,
    level: usize,
) -> f64 {
    let pool = deployed_pool(options, concurrency).await;
    let body = Arc::new(event_body("evt_store_only"));
    let done = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|task| {
            let (pool, body, done) = (pool.clone(), body.clone(), done.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < deadline {
                    n += 1;
                    let id = format!("sqlx_l{level}_{task}_{n}");
                    let event = webhook_events::NewEvent {
                        tenant_id: "bench",
                        external_id: &id,
                        source_id: "bench",
                        event_type: "payment_intent.succeeded",
                        entity_id: Some("pi_bench"),
                        entity_version: None,
                        version_tiebreak: None,
                        sequence: None,
                        payload: &body,
                        payload_sha256: [7; 32],
                        headers: serde_json::json!({"content-type": "application/json"}),
                        verified_with: "current",
                        provider_retries: 0,
                        id_outside_signature: false,
                    };
                    webhook_events::upsert(&pool, &event).await.unwrap();
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// The ingest statement with its parameters replaced by pgbench expressions.
fn pgbench_script(level: usize) -> String {
    let body = event_body("evt_pgbench");
    let digest = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&body))
    };
    let headers = serde_json::json!({"content-type": "application/json", "stripe-signature": format!("t=1700000000,v1={}", "0".repeat(64))});
    let params = [
        "'bench'".to_owned(),
        format!("'pg_l{level}_' || :client_id || '_' || :n"),
        "'bench'".to_owned(),
        "'payment_intent.succeeded'".to_owned(),
        "'pi_bench'".to_owned(),
        "NULL::bigint".to_owned(),
        "NULL::bigint".to_owned(),
        format!("'\\x{}'::bytea", hex::encode(&body)),
        format!("'\\x{digest}'::bytea"),
        format!("'{headers}'::jsonb"),
        "'current'".to_owned(),
        "0".to_owned(),
        "false".to_owned(),
        "NULL::bigint".to_owned(),
    ];
    let sql = webhook_events::upsert_sql();
    let mut out = String::new();
    let mut rest = sql;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let digits: String = rest[i + 1..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        let n: usize = digits.parse().expect("placeholder number");
        out.push_str(&params[n - 1]);
        rest = &rest[i + 1 + digits.len()..];
    }
    out.push_str(rest);
    // pgbench reads one SQL command per line unless it ends with a semicolon; flatten it.
    let flat: String = out.lines().map(str::trim).collect::<Vec<_>>().join(" ");
    format!("\\set n random(1, 1000000000000)\n{flat};\n")
}

fn run_pgbench(options: &PgConnectOptions, concurrency: usize, seconds: u64, level: usize) -> f64 {
    benchmarks::pgbench_tps(options, concurrency, seconds, &pgbench_script(level))
}

/// The concurrency levels: 1, 4 and 16, or the comma-separated list in BENCH_LEVELS (to
/// profile one level alone).
fn levels() -> Vec<usize> {
    std::env::var("BENCH_LEVELS")
        .ok()
        .map(|s| s.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .filter(|levels: &Vec<usize>| !levels.is_empty())
        .unwrap_or_else(|| vec![1, 4, 16])
}

#[tokio::main]
async fn main() {
    let seconds: u64 = std::env::var("BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let db = benchmarks::BenchDatabase::create("bench_ingest").await;
    let (setup, options) = (db.pool.clone(), db.options.clone());
    let source = benchmarks::source(Scheme::Stripe, Duration::from_secs(3600));
    sources::apply(&setup, &[source]).await.unwrap();

    println!(
        "ingest handler vs pgbench, same upsert statement, same table, {seconds} s per run, {PAYLOAD_BYTES} B payloads"
    );
    println!("(sqlx upsert/s: the same statement through the driver alone, no verification)");
    println!(
        "{:>11} {:>15} {:>17} {:>8} {:>15}",
        "concurrency", "handler req/s", "pgbench upsert/s", "ratio", "sqlx upsert/s"
    );
    for (level, concurrency) in levels().into_iter().enumerate() {
        let handler = run_handler(&options, concurrency, seconds, level).await;
        let raw = run_pgbench(&options, concurrency, seconds, level);
        let store_only = run_store_only(&options, concurrency, seconds, level).await;
        let ratio = handler / raw;
        println!("{concurrency:>11} {handler:>15.0} {raw:>17.0} {ratio:>7.2}x {store_only:>15.0}");
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_events")
        .fetch_one(&setup)
        .await
        .unwrap();
    println!("rows in webhook_events at the end: {rows}");
    db.drop().await;
}
