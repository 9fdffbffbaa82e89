//! Ingest handler throughput at 1, 4 and 16 concurrent requests, beside `pgbench` running the
//! same upsert statement on the same table, in the same database, in the same run.
//!
//! Each level runs the Lambda handler (signature verification, field extraction, one upsert
//! statement, commit) over fresh 1 KiB Stripe events for BENCH_SECONDS (default 10), then runs
//! pgbench with that statement's text, its parameters filled with a 1 KiB payload, for as long
//! and with as many connections. The ratio handler/pgbench is the share of the database's raw
//! upsert rate the whole ingest path keeps.
//!
//! The batch rows: HubSpot requests of 100 events each (v3-signed), each element stored as its
//! own event (one transaction: the request kept once, the set-wise upsert of its elements),
//! in elements/s, beside pgbench inserting 100 rows of the same size into the same table in one
//! statement. Goal: at least 0.7x. Between the two, pgbench adding one at a time what filing
//! each element as its own event writes (deduplicated, each queued, the request kept), and the
//! least a filing could write (one queue row for the batch), so that each cost has its ratio.
//!
//! Run: `./scripts/bench ingest` (needs DATABASE_URL with the right to create a database).

use benchmarks::PAYLOAD_BYTES;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use shared::domain::Scheme;
use shared::sources;
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
    let ingestor = Arc::new(benchmarks::memory_ingestor(pool, SECRET));
    let at = shared::ingest::unix_now();
    let prebuilt = (0..PREBUILT_PER_SECOND * seconds)
        .map(|n| {
            benchmarks::signed_request(
                benchmarks::stripe_event_body(&format!("evt_l{level}_{n}")),
                at,
                SECRET,
            )
        })
        .collect();
    benchmarks::drive_handler(ingestor, prebuilt, concurrency, seconds, 1).await
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
                        verified_layout: None,
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

/// The batch source: HubSpot, its URL fixed (v3 signs it).
const HUBSPOT_URL: &str = "https://bench.example.com/webhooks/bench-hubspot";
const BATCH_ELEMENTS: usize = 100;
const PREBUILT_BATCHES_PER_SECOND: u64 = 700;

fn hubspot_source() -> shared::sources::Source {
    let mut source = benchmarks::source(Scheme::Hubspot, Duration::from_secs(3600));
    source.source_id = shared::domain::SourceId::parse("bench-hubspot").unwrap();
    source.signed_url = Some(HUBSPOT_URL.to_owned());
    source
}

/// A HubSpot batch of [`BATCH_ELEMENTS`] contact events, ids unique to `batch`.
fn hubspot_batch(batch: &str) -> Vec<u8> {
    hubspot_batch_of(batch, BATCH_ELEMENTS, "")
}

/// A HubSpot-shaped batch of `n` contact events, each property value padded with `padding`.
fn hubspot_batch_of(batch: &str, n: usize, padding: &str) -> Vec<u8> {
    let elements: Vec<serde_json::Value> = (0..n)
        .map(|i| {
            serde_json::json!({
                "eventId": i, "subscriptionId": batch, "portalId": 62515, "appId": 54321,
                "occurredAt": 1_764_000_000_000_u64, "subscriptionType": "contact.propertyChange",
                "attemptNumber": 0, "objectId": 1000 + i, "changeSource": "CRM",
                "propertyName": "email", "propertyValue": format!("contact{i}@example.com{padding}"),
            })
        })
        .collect();
    serde_json::to_vec(&elements).unwrap()
}

fn hubspot_request(body: Vec<u8>, at: i64) -> lambda_http::Request {
    let v3 = Scheme::Hubspot
        .provider()
        .signatures
        .iter()
        .find(|l| l.name.as_deref() == Some("v3"))
        .unwrap();
    let signature = shared::signature::sign_with(
        v3,
        &shared::secrets::SigningSecret::new(SECRET),
        &shared::signature::Signing {
            message_id: "",
            timestamp: at,
            body: &body,
            method: "POST",
            url: Some(HUBSPOT_URL),
        },
    )
    .unwrap();
    benchmarks::api_gateway_request("bench-hubspot", signature, body)
}

/// The ingest function's timeout (template.yaml, `IngestFunction`'s `Timeout`).
const INGEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest batches a request may carry, each through the handler: [`MAX_ELEMENTS`] small
/// events, and a body at the 1 MiB limit. Prints the median of 5 of each (fresh ids) beside
/// the ingest function's timeout.
async fn run_largest_batches(options: &PgConnectOptions) {
    use shared::domain::MAX_ELEMENTS;
    let pool = deployed_pool(options, 1).await;
    let ingestor = benchmarks::memory_ingestor(pool, SECRET);
    // Just under 1 MiB: 1 800 elements of about 550 B.
    let padding = "x".repeat(300);
    for (name, n, pad) in [
        ("elements", MAX_ELEMENTS, ""),
        ("1 MiB", 1800, padding.as_str()),
    ] {
        let mut took = Vec::new();
        let mut bytes = 0;
        for run in 0..5 {
            let batch = format!("largest-{name}-{run}");
            let body = if pad.is_empty() {
                // The fewest fields HubSpot sends, so that 4 000 fit in 1 MiB.
                let elements: Vec<serde_json::Value> = (0..n)
                    .map(|i| {
                        serde_json::json!({"eventId": i, "subscriptionId": batch, "portalId": 62515,
                            "subscriptionType": "contact.creation", "objectId": i, "attemptNumber": 0})
                    })
                    .collect();
                serde_json::to_vec(&elements).unwrap()
            } else {
                hubspot_batch_of(&batch, n, pad)
            };
            bytes = body.len();
            assert!(bytes <= 1 << 20, "{bytes} bytes");
            let request = hubspot_request(body, shared::ingest::unix_now());
            let started = Instant::now();
            let response = ingest::handler(request, &ingestor).await.unwrap();
            took.push(started.elapsed().as_secs_f64());
            assert_eq!(response.status(), 200, "{:?}", response.body());
        }
        let median = benchmarks::median(&mut took);
        println!(
            "largest batch ({name}): {n} elements, {bytes} B: {:.0} ms, {:.3}x of ingest's {} s timeout",
            median * 1000.0,
            median / INGEST_TIMEOUT.as_secs_f64(),
            INGEST_TIMEOUT.as_secs()
        );
    }
}

/// Elements stored per second through the handler, HubSpot batches of [`BATCH_ELEMENTS`].
async fn run_batch_handler(options: &PgConnectOptions, concurrency: usize, seconds: u64) -> f64 {
    let pool = deployed_pool(options, concurrency).await;
    let ingestor = Arc::new(benchmarks::memory_ingestor(pool, SECRET));
    let at = shared::ingest::unix_now();
    let prebuilt = (0..PREBUILT_BATCHES_PER_SECOND * seconds)
        .map(|n| hubspot_request(hubspot_batch(&format!("c{concurrency}-{n}")), at))
        .collect();
    benchmarks::drive_handler(ingestor, prebuilt, concurrency, seconds, BATCH_ELEMENTS).await
}

/// What pgbench writes for a batch, each step adding one thing the issue asks of a filing: the
/// limit first, then what storing each element as its own event adds to it.
#[derive(Clone, Copy)]
enum PgbenchBatch {
    /// [`BATCH_ELEMENTS`] rows the size of a stored HubSpot element inserted into
    /// `webhook_events` in one statement: the limit.
    Insert,
    /// The same insert deduplicated: `ON CONFLICT (tenant_id, external_id) DO NOTHING`, as an
    /// element sent again must be.
    Deduplicated,
    /// Deduplicated, and each new row queued (`event_queue`, what the drain claims).
    Queued,
    /// Deduplicated, each queued, and the request's bytes kept once (`batch_requests`), in one
    /// transaction: what filing a batch writes.
    Filed,
    /// Deduplicated, the request kept, and one queue row for the whole batch instead of one per
    /// element (a table of the bench's own, `bench_batch_queue`: the schema has none): the
    /// least a filing could write, the drain then reading the batch's elements from it.
    OneQueueRowPerBatch,
}

impl PgbenchBatch {
    const LADDER: [PgbenchBatch; 5] = [
        PgbenchBatch::Insert,
        PgbenchBatch::Deduplicated,
        PgbenchBatch::Queued,
        PgbenchBatch::Filed,
        PgbenchBatch::OneQueueRowPerBatch,
    ];

    fn label(self) -> &'static str {
        match self {
            PgbenchBatch::Insert => "pgbench: the rows inserted (the limit)",
            PgbenchBatch::Deduplicated => "pgbench: + deduplicated",
            PgbenchBatch::Queued => "pgbench: + each queued",
            PgbenchBatch::Filed => "pgbench: + the request kept (what filing writes)",
            PgbenchBatch::OneQueueRowPerBatch => {
                "pgbench: deduplicated, kept, one queue row a batch"
            }
        }
    }
}

/// The table [`PgbenchBatch::OneQueueRowPerBatch`] queues in: a row per kept request.
const BENCH_BATCH_QUEUE: &str = "CREATE TABLE IF NOT EXISTS bench_batch_queue ( \
     batch_request_id bigint PRIMARY KEY REFERENCES batch_requests ON DELETE CASCADE, \
     ready_at timestamptz NOT NULL DEFAULT now(), \
     enqueued_at timestamptz NOT NULL DEFAULT now())";

/// pgbench writing a batch as `what` says, ids fresh per transaction: rows/s.
fn run_pgbench_batch(
    options: &PgConnectOptions,
    concurrency: usize,
    seconds: u64,
    what: PgbenchBatch,
) -> f64 {
    let batch = hubspot_batch("pgbench");
    let element =
        serde_json::to_vec(&serde_json::from_slice::<Vec<serde_json::Value>>(&batch).unwrap()[0])
            .unwrap();
    let headers = serde_json::json!({"content-type": "application/json",
        "x-hubspot-signature-v3": "0".repeat(44), "x-hubspot-request-timestamp": "1700000000000"});
    let insert = format!(
        "INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, entity_id, \
         payload, payload_sha256, headers, verified_with, received_at, first_received_at, last_seen_at) \
         SELECT 'bench', 'pgb:' || :client_id || ':' || :n || ':' || g, 'bench-hubspot', \
         'contact.propertyChange', (1000 + g)::text, '\\x{}'::bytea, '\\x{}'::bytea, \
         '{headers}'::jsonb, 'current', now(), now(), now() FROM generate_series(1, {BATCH_ELEMENTS}) AS g",
        hex::encode(&element),
        "07".repeat(32),
    );
    let deduplicated = format!("{insert} ON CONFLICT (tenant_id, external_id) DO NOTHING");
    let queued = format!(
        "WITH ins AS ({deduplicated} RETURNING tenant_id, external_id) \
         INSERT INTO event_queue (tenant_id, external_id) SELECT tenant_id, external_id FROM ins"
    );
    // The kept body differs per transaction (the id is in it), as a real one does.
    let keep = format!(
        "INSERT INTO batch_requests (received_at, tenant_id, source_id, external_ids, body, \
         body_sha256, headers, verified_with) SELECT now(), 'bench', 'bench-hubspot', \
         ARRAY(SELECT 'pgb:' || :client_id || ':' || :n || ':' || g FROM generate_series(1, {BATCH_ELEMENTS}) AS g), \
         convert_to(:n::text || '{}', 'UTF8'), '\\x{}'::bytea, '{headers}'::jsonb, 'current'",
        String::from_utf8(batch).unwrap().replace('\'', "''"),
        "07".repeat(32),
    );
    let n = "\\set n random(1, 1000000000000)\n";
    let script = match what {
        PgbenchBatch::Insert => format!("{n}{insert};\n"),
        PgbenchBatch::Deduplicated => format!("{n}{deduplicated};\n"),
        PgbenchBatch::Queued => format!("{n}{queued};\n"),
        PgbenchBatch::Filed => format!("{n}BEGIN;\n{keep};\n{queued};\nCOMMIT;\n"),
        PgbenchBatch::OneQueueRowPerBatch => format!(
            "{n}BEGIN;\nWITH kept AS ({keep} RETURNING batch_request_id) \
             INSERT INTO bench_batch_queue (batch_request_id) SELECT batch_request_id FROM kept;\n\
             {deduplicated};\nCOMMIT;\n"
        ),
    };
    BATCH_ELEMENTS as f64 * benchmarks::pgbench_tps(options, concurrency, seconds, &script)
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

/// The parts of the bench a run takes: every one, or those BENCH_INGEST_PARTS lists
/// (`singles`, `batches`, `largest`, comma-separated), as the run with the database on its own
/// core takes the batches alone.
struct Parts {
    singles: bool,
    batches: bool,
    largest: bool,
}

fn parts() -> Parts {
    match std::env::var("BENCH_INGEST_PARTS") {
        Ok(list) => {
            let named: Vec<&str> = list.split(',').map(str::trim).collect();
            if let Some(unknown) = named
                .iter()
                .find(|p| !["singles", "batches", "largest"].contains(p))
            {
                panic!(
                    "BENCH_INGEST_PARTS names {unknown:?}: the parts are singles, batches, largest"
                );
            }
            let has = |name: &str| named.contains(&name);
            Parts {
                singles: has("singles"),
                batches: has("batches"),
                largest: has("largest"),
            }
        }
        Err(_) => Parts {
            singles: true,
            batches: true,
            largest: true,
        },
    }
}

#[tokio::main]
async fn main() {
    let parts = parts();
    let seconds: u64 = std::env::var("BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let db = benchmarks::BenchDatabase::create("bench_ingest").await;
    let (setup, options) = (db.pool.clone(), db.options.clone());
    let source = benchmarks::source(Scheme::Stripe, Duration::from_secs(3600));
    sources::apply(&setup, &[source, hubspot_source()])
        .await
        .unwrap();

    println!(
        "{}",
        benchmarks::cpus_line("the handler and pgbench's client")
    );
    if parts.singles {
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
            println!(
                "{concurrency:>11} {handler:>15.0} {raw:>17.0} {ratio:>7.2}x {store_only:>15.0}"
            );
        }
        println!();
    }
    if parts.batches {
        println!(
            "batches: HubSpot requests of {BATCH_ELEMENTS} events, each stored as its own event, vs pgbench inserting {BATCH_ELEMENTS} rows in one statement (goal 0.70x)"
        );
        println!(
            "(then pgbench adding, one at a time, what filing each element as its own event writes; each row's ratio is to the insert of the same concurrency)"
        );
        sqlx::query(BENCH_BATCH_QUEUE)
            .execute(&setup)
            .await
            .unwrap();
        println!(
            "{:>11} {:<52} {:>11} {:>8}",
            "concurrency", "what", "rows/s", "ratio"
        );
        for concurrency in [1, 4] {
            let handler = run_batch_handler(&options, concurrency, seconds).await;
            let ladder: Vec<(PgbenchBatch, f64)> = PgbenchBatch::LADDER
                .into_iter()
                .map(|what| {
                    (
                        what,
                        run_pgbench_batch(&options, concurrency, seconds, what),
                    )
                })
                .collect();
            let limit = ladder[0].1;
            for (what, rows) in &ladder {
                println!(
                    "{concurrency:>11} {:<52} {rows:>11.0} {:>7.2}x",
                    what.label(),
                    rows / limit
                );
            }
            let filed = ladder
                .iter()
                .find(|(what, _)| matches!(what, PgbenchBatch::Filed))
                .map_or(f64::NAN, |(_, rows)| *rows);
            println!(
                "{concurrency:>11} {:<52} {handler:>11.0} {:>7.2}x (goal 0.70x; {:.2}x of what filing writes)",
                "handler: elements stored",
                handler / limit,
                handler / filed
            );
        }
    }
    if parts.largest {
        run_largest_batches(&options).await;
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_events")
        .fetch_one(&setup)
        .await
        .unwrap();
    println!("rows in webhook_events at the end: {rows}");
    db.drop().await;
}
