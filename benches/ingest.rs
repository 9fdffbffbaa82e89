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

use benchmarks::PAYLOAD_BYTES;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use shared::domain::Scheme;
use shared::ingest::{IngestLimits, Ingestor};
use shared::secrets::{SecretSet, SecretStore};
use shared::sources::{self, SourceRegistry};
use shared::store::{self, webhook_events};
use sqlx::postgres::PgConnectOptions;

const SECRET: &str = "whsec_bench";

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
        .map(|n| {
            std::sync::Mutex::new(Some(benchmarks::signed_request(
                benchmarks::stripe_event_body(&format!("evt_l{level}_{n}")),
                at,
                SECRET,
            )))
        })
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
    let body = Arc::new(benchmarks::stripe_event_body("evt_store_only"));
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
                        signed_digest: None,
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

fn run_pgbench(options: &PgConnectOptions, concurrency: usize, seconds: u64, level: usize) -> f64 {
    benchmarks::pgbench_tps(
        options,
        concurrency,
        seconds,
        &benchmarks::pgbench_upsert_script(level),
    )
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
