//! The buffer consumer's batch statement, rows/s, beside `pgbench` running the single-row upsert
//! on the same table, in the same database, in the same run.
//!
//! For each concurrency level (default 1 and 4; `BENCH_LEVELS`), for BENCH_SECONDS (default 10)
//! each:
//! - pgbench runs the direct path's statement (`upsert_sql()`), a 1 KiB payload, one row per
//!   transaction: the single-row limit, rows/s;
//! - `upsert_batch` stores fresh 1 KiB Stripe events in batches of 10 and of 100, each batch its
//!   own transaction (the statement, and the commit), rows/s;
//! - `file_batch` files batches of 100 buffered deliveries as the consumer does (receipts, the
//!   source read, the fields read, the statement, the commit), rows/s.
//!
//! The ratios are each batch figure over pgbench's. Goal: at least 3× at batch 100.
//!
//! Run: `./scripts/bench buffer` (needs DATABASE_URL with the right to create a database).

use benchmarks::PAYLOAD_BYTES;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use shared::buffer::filing::{self, Message};
use shared::buffer::{BufferedDelivery, ENVELOPE_VERSION, Envelope};
use shared::domain::Scheme;
use shared::sources;
use shared::store::{self, webhook_events};
use sqlx::postgres::PgConnectOptions;

fn digest(body: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(body).into()
}

async fn pool(options: &PgConnectOptions, concurrency: usize) -> sqlx::PgPool {
    store::pool_options(&store::PoolSettings {
        max_connections: concurrency as u32,
        acquire_timeout: Duration::from_secs(3),
    })
    .min_connections(concurrency as u32)
    .connect_with(options.clone())
    .await
    .unwrap()
}

/// `concurrency` tasks each running `batch(task, n)` until the deadline; returns rows/s.
async fn rows_per_second<F, Fut>(
    concurrency: usize,
    seconds: u64,
    rows_per_call: usize,
    f: F,
) -> f64
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let f = Arc::new(f);
    let done = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|task| {
            let (f, done) = (f.clone(), done.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < deadline {
                    n += 1;
                    f(task, n).await;
                    done.fetch_add(rows_per_call, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// `upsert_batch` over batches of `size` fresh events, one transaction each.
async fn run_upsert_batch(
    options: &PgConnectOptions,
    concurrency: usize,
    seconds: u64,
    size: usize,
    tag: &'static str,
) -> f64 {
    let pool = pool(options, concurrency).await;
    let body = Arc::new(benchmarks::stripe_event_body("evt_batch"));
    let sha = digest(&body);
    rows_per_second(concurrency, seconds, size, move |task, n| {
        let (pool, body) = (pool.clone(), body.clone());
        async move {
            let ids: Vec<String> = (0..size)
                .map(|i| format!("{tag}_c{concurrency}_{task}_{n}_{i}"))
                .collect();
            let now = chrono::Utc::now();
            let batch: Vec<webhook_events::BatchedEvent<'_>> = ids
                .iter()
                .map(|id| webhook_events::BatchedEvent {
                    event: webhook_events::NewEvent {
                        tenant_id: "bench",
                        external_id: id,
                        source_id: "bench",
                        event_type: "payment_intent.succeeded",
                        entity_id: Some("pi_bench"),
                        entity_version: None,
                        version_tiebreak: None,
                        sequence: None,
                        payload: &body,
                        payload_sha256: sha,
                        headers: serde_json::json!({"content-type": "application/json"}),
                        verified_with: "current",
                        provider_retries: 0,
                        id_outside_signature: false,
                        signed_digest: None,
                        verified_layout: None,
                    },
                    received_at: now,
                    buffered: false,
                })
                .collect();
            let mut tx = pool.begin().await.unwrap();
            let stored = webhook_events::upsert_batch(&mut tx, &batch).await.unwrap();
            assert_eq!(stored.len(), size);
            tx.commit().await.unwrap();
        }
    })
    .await
}

/// `file_batch` over batches of `size` buffered deliveries, as the consumer files them.
async fn run_file_batch(
    options: &PgConnectOptions,
    concurrency: usize,
    seconds: u64,
    size: usize,
    tag: &'static str,
) -> f64 {
    let pool = pool(options, concurrency).await;
    rows_per_second(concurrency, seconds, size, move |task, n| {
        let pool = pool.clone();
        async move {
            let messages: Vec<Message> = (0..size)
                .map(|i| {
                    let id = format!("{tag}_c{concurrency}_{task}_{n}_{i}");
                    Message {
                        message_id: id.clone(),
                        delivery: Ok(BufferedDelivery {
                            envelope: Envelope {
                                v: ENVELOPE_VERSION,
                                delivery_id: id.clone(),
                                verified_layout: None,
                                source_id: "bench".into(),
                                received_at_micros: shared::ingest::unix_now_micros(),
                                verified_with: "current".into(),
                                headers: [(
                                    "content-type".to_owned(),
                                    "application/json".to_owned(),
                                )]
                                .into(),
                                signed_headers: vec![],
                                signed_digest: None,
                                element_digests: Vec::new(),
                            },
                            body: benchmarks::stripe_event_body(&id),
                        }),
                    }
                })
                .collect();
            let filed = filing::file_batch(&pool, &messages).await.unwrap();
            assert!(filed.iter().all(|f| matches!(f, filing::Filed::Stored(_))));
        }
    })
    .await
}

fn levels() -> Vec<usize> {
    std::env::var("BENCH_LEVELS")
        .ok()
        .map(|s| s.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .filter(|levels: &Vec<usize>| !levels.is_empty())
        .unwrap_or_else(|| vec![1, 4])
}

#[tokio::main]
async fn main() {
    let seconds: u64 = std::env::var("BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let db = benchmarks::BenchDatabase::create("bench_buffer").await;
    let (setup, options) = (db.pool.clone(), db.options.clone());
    let source = benchmarks::source(Scheme::Stripe, Duration::from_secs(3600));
    sources::apply(&setup, &[source]).await.unwrap();

    println!(
        "buffer consumer: upsert_batch rows/s vs pgbench single-row upsert rows/s, same table, {seconds} s per run, {PAYLOAD_BYTES} B payloads"
    );
    println!("(file_batch: the whole consumer step: receipts, source, fields, statement, commit)");
    println!(
        "{:>11} {:>17} {:>13} {:>7} {:>14} {:>7} {:>18} {:>7}",
        "concurrency",
        "pgbench upsert/s",
        "batch10 row/s",
        "ratio",
        "batch100 row/s",
        "ratio",
        "file_batch100 row/s",
        "ratio"
    );
    for (level, concurrency) in levels().into_iter().enumerate() {
        let raw = benchmarks::pgbench_tps(
            &options,
            concurrency,
            seconds,
            &benchmarks::pgbench_upsert_script(level),
        );
        let b10 = run_upsert_batch(&options, concurrency, seconds, 10, "b10").await;
        let b100 = run_upsert_batch(&options, concurrency, seconds, 100, "b100").await;
        let f100 = run_file_batch(&options, concurrency, seconds, 100, "f100").await;
        println!(
            "{concurrency:>11} {raw:>17.0} {b10:>13.0} {:>6.2}x {b100:>14.0} {:>6.2}x {f100:>18.0} {:>6.2}x",
            b10 / raw,
            b100 / raw,
            f100 / raw
        );
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_events")
        .fetch_one(&setup)
        .await
        .unwrap();
    println!("rows in webhook_events at the end: {rows}");
    db.drop().await;
}
