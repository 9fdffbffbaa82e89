//! The outbox sender's deliveries per second per destination kind, beside a bare loop of the
//! same call on the same endpoint, in the same run (issue 24).
//!
//! For each kind (http: a local HTTP sink; eventbridge, sqs, sns: moto, `MOTO_ENDPOINT`),
//! BENCH_MESSAGES (default 500; HTTP: BENCH_HTTP_MESSAGES, default 20 000) `entity.changed`
//! rows are written to the outbox, routed to one destination of that kind, and sent by one
//! `OutboxSender` (its defaults) until every row is delivered: leases, routes, the batch calls,
//! the settling statements. The bare loop
//! makes the same calls with the same bodies, batched the same way (HTTP: one POST each, as many
//! in flight as the sender's `http_concurrency`; the others: 10 entries a call), and nothing
//! else. The ratio is sender / bare: the share of the
//! endpoint's throughput the outbox's bookkeeping leaves.
//!
//! moto's SQS slows as a queue fills (each send costs more with every message it holds: about
//! 100 messages/s into an empty queue, 15/s at 2000 deep), so the sender and the bare loop each
//! send into a fresh queue of their own: both meet the same depths in the same order.
//!
//! Run: `./scripts/bench outbox` (DATABASE_URL with the right to create a database, and moto).
//! It runs this twice: every kind on cores shared with PostgreSQL, then the HTTP rows again
//! with PostgreSQL on a core of its own (`BENCH_TOPOLOGY` names the arrangement), which is how
//! the sender meets its database when deployed: RDS is a machine of its own.

use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use shared::aws::AwsEndpoint;
use shared::outbox::destinations::{AwsDestinationEndpoints, Destination};
use shared::outbox::routes::{self, Route};
use shared::outbox::{OutboxSender, OutboxSettings};
use sqlx::PgPool;

const TENANT: &str = "bench";

fn messages() -> usize {
    env_or("BENCH_MESSAGES", 500)
}

/// Sender and bare loop runs, in pairs, behind the HTTP row's ratio.
const HTTP_PAIRS: usize = 5;

/// The HTTP row's messages: a local sink takes 500 POSTs in about 10 ms, too short a run to
/// measure a sender that leases and commits in batches of 200, so it sends many more.
fn http_messages() -> usize {
    env_or("BENCH_HTTP_MESSAGES", 20_000)
}

/// A setting the run may override (BENCH_OUTBOX_BATCH, BENCH_OUTBOX_WORKERS), else the default.
fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn endpoint() -> AwsEndpoint {
    AwsEndpoint {
        endpoint_url: Some(
            std::env::var("MOTO_ENDPOINT").expect("MOTO_ENDPOINT (./scripts/bench starts moto)"),
        ),
        region: Some("us-east-1".into()),
    }
}

/// The body each destination but HTTP carries, as the sender builds it.
fn body(i: usize, key: &str) -> String {
    serde_json::json!({
        "action": "entity.changed",
        "tenant_id": TENANT,
        "event_id": format!("evt_{i}"),
        "idempotency_key": key,
        "payload": {"entity_type": "customer", "entity_id": format!("cus_{i}"), "version": 1, "deleted": false},
    })
    .to_string()
}

/// `n` pending `entity.changed` rows of the bench tenant, written as the drain writes them.
async fn fill(pool: &PgPool, kind: &str, n: usize) {
    sqlx::query("TRUNCATE outbox").execute(pool).await.unwrap();
    sqlx::query(
        "INSERT INTO outbox (tenant_id, external_id, action, payload, idempotency_key) \
         SELECT $1, $2 || '_' || i, 'entity.changed', \
                jsonb_build_object('entity_type', 'customer', 'entity_id', 'cus_' || i, 'version', 1, 'deleted', false), \
                encode(sha256(($2 || '_' || i)::bytea), 'hex') \
         FROM generate_series(1, $3) AS i",
    )
    .bind(TENANT)
    .bind(kind)
    .bind(n as i64)
    .execute(pool)
    .await
    .unwrap();
}

/// Sends until nothing is pending; deliveries per second.
async fn sender_rate(pool: &PgPool, destination: Destination, kind: &str, n: usize) -> f64 {
    fill(pool, kind, n).await;
    routes::apply(
        pool,
        &[Route {
            tenant_id: TENANT.into(),
            source_id: None,
            action: "entity.changed".into(),
            destination,
            signing_secret_ref: None,
            subscription: None,
        }],
    )
    .await
    .unwrap();
    let sender = OutboxSender::new(
        pool.clone(),
        OutboxSettings {
            endpoints: AwsDestinationEndpoints::all(endpoint()),
            batch_size: env_or("BENCH_OUTBOX_BATCH", OutboxSettings::routed().batch_size),
            workers: env_or("BENCH_OUTBOX_WORKERS", OutboxSettings::routed().workers),
            ..OutboxSettings::routed()
        },
    )
    .unwrap();
    let start = Instant::now();
    let mut delivered = 0;
    while delivered < n as u64 {
        let pass = sender
            .send_until(Instant::now() + Duration::from_secs(600))
            .await
            .unwrap();
        assert_eq!(pass.failed + pass.unrouted, 0, "{pass:?}");
        delivered += pass.delivered;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// Messages per second of `call` over `n` messages in chunks of `per_call`.
async fn bare_rate<F, Fut>(n: usize, per_call: usize, mut call: F) -> f64
where
    F: FnMut(Vec<(usize, String)>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let all: Vec<(usize, String)> = (0..n).map(|i| (i, body(i, &format!("bare_{i}")))).collect();
    let start = Instant::now();
    for chunk in all.chunks(per_call) {
        call(chunk.to_vec()).await;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

async fn serve_sink() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/sink", listener.local_addr().unwrap());
    let app = axum::Router::new().route("/sink", axum::routing::post(|| async { "ok" }));
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

#[tokio::main]
async fn main() {
    let n = messages();
    let db = benchmarks::BenchDatabase::create("bench_outbox").await;
    let pool = db.pool.clone();
    let config = shared::aws::sdk_config(&endpoint()).await;
    let sqs = aws_sdk_sqs::Client::new(&config);
    let eventbridge = aws_sdk_eventbridge::Client::new(&config);
    let sns = aws_sdk_sns::Client::new(&config);
    let suffix = std::process::id();

    let queue = |name: String| {
        let sqs = sqs.clone();
        async move {
            sqs.create_queue()
                .queue_name(name)
                .send()
                .await
                .unwrap()
                .queue_url
                .unwrap()
        }
    };
    let sender_queue = queue(format!("bench-outbox-sender-{suffix}")).await;
    let queue_url = queue(format!("bench-outbox-bare-{suffix}")).await;
    let bus = format!("bench-outbox-{suffix}");
    eventbridge
        .create_event_bus()
        .name(&bus)
        .send()
        .await
        .unwrap();
    let topic_arn = sns
        .create_topic()
        .name(format!("bench-outbox-{suffix}"))
        .send()
        .await
        .unwrap()
        .topic_arn
        .unwrap();
    let sink = serve_sink().await;
    let http = reqwest::Client::new();

    println!(
        "outbox deliveries/s per destination kind vs a bare loop of the same call on the same endpoint, {n} messages each (HTTP: a local sink, more messages; AWS: moto at {})",
        endpoint().endpoint_url.unwrap_or_default()
    );
    println!(
        "{}",
        benchmarks::cpus_line("the sender, the sink and the bare loop")
    );
    println!(
        "{:>12} {:>22} {:>14} {:>14} {:>7}",
        "destination", "call", "sender msg/s", "bare msg/s", "ratio"
    );
    let row = |kind: &str, call: &str, sender: f64, bare: f64| {
        println!(
            "{kind:>12} {call:>22} {sender:>14.0} {bare:>14.0} {:>6.2}x",
            sender / bare
        );
    };

    let n_http = http_messages();
    // The bare loop as concurrent as the sender (OUTBOX_CONCURRENCY's default): the same POSTs,
    // that many in flight, nothing else.
    let concurrency = OutboxSettings::routed().http_concurrency;
    let bare_http = || {
        let (http, sink) = (http.clone(), sink.clone());
        async move {
            let all: Vec<(usize, String)> = (0..n_http)
                .map(|i| (i, body(i, &format!("bare_{i}"))))
                .collect();
            let start = Instant::now();
            futures_util::stream::iter(all)
                .map(|(i, body)| {
                    let (http, sink) = (http.clone(), sink.clone());
                    async move {
                        let r = http
                            .post(&sink)
                            .header("Idempotency-Key", format!("bare_{i}"))
                            .header("content-type", "application/json")
                            .body(body)
                            .send()
                            .await
                            .unwrap();
                        assert!(r.status().is_success());
                    }
                })
                .buffer_unordered(concurrency)
                .collect::<Vec<()>>()
                .await;
            n_http as f64 / start.elapsed().as_secs_f64()
        }
    };
    // Pairs, the order alternating (sender first, then bare first), the ratio the median of
    // the pairs' own: one pair on these machines moved from 0.41x to 0.52x between runs.
    let mut pairs = Vec::new();
    for pair in 0..HTTP_PAIRS {
        let http_destination = Destination::http(sink.clone()).unwrap();
        let (sent, bare) = if pair % 2 == 0 {
            let sent = sender_rate(&pool, http_destination, "http", n_http).await;
            (sent, bare_http().await)
        } else {
            let bare = bare_http().await;
            (
                sender_rate(&pool, http_destination, "http", n_http).await,
                bare,
            )
        };
        row(
            "http",
            &format!("POST, {concurrency} at once, pair {}", pair + 1),
            sent,
            bare,
        );
        pairs.push((sent / bare, sent, bare));
    }
    pairs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (_, sent, bare) = pairs[pairs.len() / 2];
    row(
        "http",
        &format!("median of {HTTP_PAIRS}, {n_http} each"),
        sent,
        bare,
    );
    println!(
        "{:>12} limit: the sender at least 0.50x the concurrent bare loop",
        ""
    );
    if std::env::var("BENCH_OUTBOX_KINDS").as_deref() == Ok("http") {
        db.drop().await;
        return;
    }

    let destination = Destination::eventbridge(bus.clone(), "bench.webhooks".into()).unwrap();
    let sent = sender_rate(&pool, destination, "eventbridge", n).await;
    let bare = bare_rate(n, 10, |chunk| {
        let (eventbridge, bus) = (eventbridge.clone(), bus.clone());
        async move {
            let entries = chunk
                .iter()
                .map(|(_, body)| {
                    aws_sdk_eventbridge::types::PutEventsRequestEntry::builder()
                        .event_bus_name(&bus)
                        .source("bench.webhooks")
                        .detail_type("entity.changed")
                        .detail(body)
                        .build()
                })
                .collect();
            let out = eventbridge
                .put_events()
                .set_entries(Some(entries))
                .send()
                .await
                .unwrap();
            assert_eq!(out.failed_entry_count, 0);
        }
    })
    .await;
    row("eventbridge", "PutEvents x10", sent, bare);

    let sent = sender_rate(
        &pool,
        Destination::sqs(sender_queue.clone()).unwrap(),
        "sqs",
        n,
    )
    .await;
    let bare = bare_rate(n, 10, |chunk| {
        let (sqs, queue_url) = (sqs.clone(), queue_url.clone());
        async move {
            let entries = chunk
                .iter()
                .enumerate()
                .map(|(j, (_, body))| {
                    aws_sdk_sqs::types::SendMessageBatchRequestEntry::builder()
                        .id(j.to_string())
                        .message_body(body)
                        .build()
                        .unwrap()
                })
                .collect();
            let out = sqs
                .send_message_batch()
                .queue_url(&queue_url)
                .set_entries(Some(entries))
                .send()
                .await
                .unwrap();
            assert!(out.failed.is_empty());
        }
    })
    .await;
    row("sqs", "SendMessageBatch x10", sent, bare);

    let sent = sender_rate(
        &pool,
        Destination::sns(topic_arn.clone()).unwrap(),
        "sns",
        n,
    )
    .await;
    let bare = bare_rate(n, 10, |chunk| {
        let (sns, topic_arn) = (sns.clone(), topic_arn.clone());
        async move {
            let entries = chunk
                .iter()
                .enumerate()
                .map(|(j, (_, body))| {
                    aws_sdk_sns::types::PublishBatchRequestEntry::builder()
                        .id(j.to_string())
                        .message(body)
                        .build()
                        .unwrap()
                })
                .collect();
            let out = sns
                .publish_batch()
                .topic_arn(&topic_arn)
                .set_publish_batch_request_entries(Some(entries))
                .send()
                .await
                .unwrap();
            assert!(out.failed.unwrap_or_default().is_empty());
        }
    })
    .await;
    row("sns", "PublishBatch x10", sent, bare);

    for url in [&sender_queue, &queue_url] {
        let _ = sqs.delete_queue().queue_url(url).send().await;
    }
    db.drop().await;
}
