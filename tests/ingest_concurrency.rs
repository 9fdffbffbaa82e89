//! Concurrent deliveries of one event, through the handler, over several connection pools: the
//! database, not the process, must make them land exactly once.

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use pipeline_tests::*;
use serde_json::json;
use shared::domain::Scheme;
use shared::ingest::{IngestLimits, Ingestor};
use shared::sources::{self, SourceRegistry};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const COPIES: usize = 20;
const POOLS: usize = 3;

/// `POOLS` independent ingest instances (as separate Lambda environments would be), each with
/// its own pool of real connections.
async fn instances(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) -> (sqlx::PgPool, Vec<Arc<Ingestor>>) {
    let admin = pool_options
        .clone()
        .max_connections(2)
        .connect_with(connect.clone())
        .await
        .unwrap();
    sources::apply(&admin, &sources_for_every_scheme())
        .await
        .unwrap();
    let mut list = Vec::new();
    for _ in 0..POOLS {
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .min_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(connect.clone())
            .await
            .unwrap();
        let registry = Arc::new(SourceRegistry::new(pool.clone(), Duration::from_secs(60)));
        list.push(Arc::new(Ingestor::new(
            pool,
            registry,
            Arc::new(secrets_for_every_scheme()),
            IngestLimits {
                max_body_bytes: MAX_BODY,
            },
        )));
    }
    (admin, list)
}

async fn send_all(instances: &[Arc<Ingestor>], deliveries: Vec<Delivery>) -> Vec<Reply> {
    let barrier = Arc::new(tokio::sync::Barrier::new(deliveries.len()));
    let tasks: Vec<_> = deliveries
        .into_iter()
        .enumerate()
        .map(|(i, d)| {
            let ingestor = instances[i % instances.len()].clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                post_to(&ingestor, "stripe", d.headers, &d.body).await
            })
        })
        .collect();
    let mut replies = Vec::new();
    for task in tasks {
        replies.push(task.await.unwrap());
    }
    replies
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn twenty_concurrent_copies_land_once_with_twenty_deliveries(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (admin, instances) = instances(pool_options, connect).await;
    let fixture = delivery(
        Scheme::Stripe,
        &secret_of(Scheme::Stripe),
        "evt_storm",
        now(),
        json!({"amount": 4200}),
    );
    let copies = (0..COPIES)
        .map(|_| Delivery {
            headers: fixture.headers.clone(),
            body: fixture.body.clone(),
        })
        .collect();

    let replies = send_all(&instances, copies).await;

    assert!(
        replies.iter().all(|r| r.status == StatusCode::OK),
        "{replies:?}"
    );
    let accepted = replies.iter().filter(|r| r.outcome() == "accepted").count();
    let duplicate = replies
        .iter()
        .filter(|r| r.outcome() == "duplicate")
        .count();
    assert_eq!((accepted, duplicate), (1, COPIES - 1));
    let rows = events(&admin).await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].delivery_count, COPIES as i32);
    assert_eq!(rows[0].payload.as_deref(), Some(&fixture.body[..]));
    assert!(anomalies(&admin).await.is_empty());
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn concurrent_conflicting_payloads_land_once_and_every_conflict_is_recorded(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (admin, instances) = instances(pool_options, connect).await;
    let secret = secret_of(Scheme::Stripe);
    // Four different payloads under one id, five copies each.
    let deliveries = (0..COPIES)
        .map(|i| {
            delivery(
                Scheme::Stripe,
                &secret,
                "evt_contested",
                now(),
                json!({"variant": i % 4}),
            )
        })
        .collect();

    let replies = send_all(&instances, deliveries).await;

    assert!(
        replies.iter().all(|r| r.status == StatusCode::OK),
        "{replies:?}"
    );
    let count = |o: &str| replies.iter().filter(|r| r.outcome() == o).count();
    assert_eq!(count("accepted"), 1);
    assert_eq!(
        count("accepted") + count("duplicate") + count("conflict"),
        COPIES
    );
    let rows = events(&admin).await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].delivery_count, COPIES as i32);
    assert_eq!(rows[0].conflict_count as usize, count("conflict"));
    // Every conflicting delivery is recorded, on one row per (event, delivered body) that
    // counts them: at most one per variant, never one per request.
    let (recorded, rows): (i64, i64) = sqlx::query_as(
        "SELECT COALESCE(sum(seen_count), 0)::bigint, count(*) FROM ingest_anomalies \
         WHERE kind = 'digest_conflict'",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(
        recorded as usize,
        count("conflict"),
        "every conflicting delivery counted"
    );
    assert!((1..=4).contains(&rows), "{rows} rows for four variants");
    assert_eq!(anomalies(&admin).await.len() as i64, rows);
}
