//! Ingest in `queue` mode beside `database` mode, in the same run: requests/s and p99 latency at
//! 1, 4 and 16 concurrent requests, over fresh 1 KiB Stripe events for BENCH_SECONDS (default 5)
//! per level and mode.
//!
//! `database`: verification, field extraction, one upsert, commit. `queue`: verification, field
//! extraction, one SQS SendMessage. The queue here is moto's (a single-threaded Python server),
//! so the `queue` figure is moto's limit, not SQS's: in AWS a send takes 10-30 ms and SQS scales
//! with the senders. What the run shows is that `queue` mode does not touch the database (its
//! rows stay at zero until the consumer files them), so the database's limit no longer caps the
//! ingest rate. The consumer's side, the batch statement against the single-row limit, is
//! `benches/buffer.rs`.
//!
//! Run: `./scripts/bench buffer` (needs DATABASE_URL with the right to create a database, and
//! MOTO_ENDPOINT: the script starts moto).

use benchmarks::PAYLOAD_BYTES;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use shared::buffer::{BufferMode, BufferQueue};
use shared::domain::Scheme;
use shared::ingest::{Buffer, Ingestor};
use shared::sources;
use shared::store;
use sqlx::postgres::PgConnectOptions;

const SECRET: &str = "whsec_bench";

async fn ingestor(
    options: &PgConnectOptions,
    concurrency: usize,
    buffer: Option<Buffer>,
) -> Arc<Ingestor> {
    let pool = store::pool_options(&store::PoolSettings {
        max_connections: concurrency as u32,
        acquire_timeout: Duration::from_secs(3),
    })
    .min_connections(concurrency as u32)
    .connect_with(options.clone())
    .await
    .unwrap();
    let ingestor = benchmarks::memory_ingestor(pool, SECRET);
    Arc::new(match buffer {
        Some(buffer) => ingestor.with_buffer(buffer),
        None => ingestor,
    })
}

/// Requests per second and the 99th percentile latency in milliseconds.
async fn run(ingestor: Arc<Ingestor>, concurrency: usize, seconds: u64, tag: &str) -> (f64, f64) {
    let at = shared::ingest::unix_now();
    let next = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (ingestor, next) = (ingestor.clone(), next.clone());
            let tag = tag.to_owned();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                while Instant::now() < deadline {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let req = benchmarks::signed_request(
                        benchmarks::stripe_event_body(&format!("evt_{tag}_{n}")),
                        at,
                        SECRET,
                    );
                    let sent = Instant::now();
                    let response = ingest::handler(req, &ingestor).await.unwrap();
                    latencies.push(sent.elapsed().as_secs_f64() * 1000.0);
                    assert_eq!(response.status(), 200, "{:?}", response.body());
                }
                latencies
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let elapsed = start.elapsed().as_secs_f64();
    all.sort_by(f64::total_cmp);
    let p99 = all
        .get((all.len() * 99 / 100).min(all.len().saturating_sub(1)))
        .copied()
        .unwrap_or(0.0);
    (all.len() as f64 / elapsed, p99)
}

async fn moto_queue() -> BufferQueue {
    let endpoint = shared::aws::AwsEndpoint {
        endpoint_url: Some(
            std::env::var("MOTO_ENDPOINT").expect("MOTO_ENDPOINT (scripts/bench starts moto)"),
        ),
        region: Some("us-east-1".into()),
    };
    let name = format!("bench-buffer-{}", std::process::id());
    hookctl::serve::create_buffer_queue(&endpoint, &name, 5, 30)
        .await
        .unwrap()
}

#[tokio::main]
async fn main() {
    let seconds: u64 = std::env::var("BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let db = benchmarks::BenchDatabase::create("bench_buffer_modes").await;
    let (setup, options) = (db.pool.clone(), db.options.clone());
    sources::apply(
        &setup,
        &[benchmarks::source(
            Scheme::Stripe,
            Duration::from_secs(3600),
        )],
    )
    .await
    .unwrap();
    let queue = moto_queue().await;

    println!(
        "ingest in queue mode (SQS: moto) beside database mode, {seconds} s per run, {PAYLOAD_BYTES} B payloads"
    );
    println!(
        "{:>11} {:>16} {:>13} {:>13} {:>10} {:>16}",
        "concurrency",
        "database req/s",
        "database p99",
        "queue req/s",
        "queue p99",
        "queue/database"
    );
    for concurrency in [1usize, 4, 16] {
        let direct = ingestor(&options, concurrency, None).await;
        let (db_rate, db_p99) = run(direct, concurrency, seconds, &format!("d{concurrency}")).await;
        let rows_before: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_events")
            .fetch_one(&setup)
            .await
            .unwrap();
        let buffered = ingestor(
            &options,
            concurrency,
            Some(Buffer::new(
                BufferMode::Queue,
                queue.clone(),
                Duration::from_secs(2),
                Duration::from_secs(1),
            )),
        )
        .await;
        let (q_rate, q_p99) = run(buffered, concurrency, seconds, &format!("q{concurrency}")).await;
        let rows_after: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_events")
            .fetch_one(&setup)
            .await
            .unwrap();
        assert_eq!(rows_before, rows_after, "queue mode wrote to the database");
        println!(
            "{concurrency:>11} {db_rate:>16.0} {db_p99:>11.1}ms {q_rate:>13.0} {q_p99:>8.1}ms {:>15.2}x",
            q_rate / db_rate
        );
    }
    db.drop().await;
}
