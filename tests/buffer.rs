//! The second buffer end to end: ingest in spillover and queue mode against a PostgreSQL that a
//! proxy makes unreachable, and moto's SQS; the consumer files what was buffered.

use http::StatusCode;
use pipeline_tests::buffer::{buffered_app, new_buffer_queue, peek};
use pipeline_tests::*;
use serde_json::json;
use shared::buffer::{BufferMode, BufferQueue, QueueSettings};
use shared::domain::Scheme;
use sqlx::PgPool;

fn stripe(id: &str) -> Delivery {
    delivery(
        Scheme::Stripe,
        &secret_of(Scheme::Stripe),
        id,
        now(),
        json!({}),
    )
}

fn github(id: &str) -> Delivery {
    delivery(
        Scheme::Github,
        &secret_of(Scheme::Github),
        id,
        now(),
        json!({}),
    )
}

async fn row_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM webhook_events")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A queue at an address nothing listens on: every send fails.
async fn unreachable_queue() -> BufferQueue {
    BufferQueue::connect(&QueueSettings {
        queue_url: "http://127.0.0.1:9/000000000000/nowhere".into(),
        dead_letter_queue_url: None,
        endpoint: shared::aws::AwsEndpoint {
            endpoint_url: Some("http://127.0.0.1:9".into()),
            region: Some("us-east-1".into()),
        },
    })
    .await
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn spillover_buffers_what_the_database_cannot_take(pool: PgPool) {
    let queue = new_buffer_queue(5, 30).await;
    let (app, proxy) = buffered_app(pool, BufferMode::Spillover, queue.clone(), MAX_BODY).await;
    let first = stripe("evt_before");
    let reply = app.post("stripe", first.headers, &first.body).await;
    assert_eq!(
        reply.json,
        json!({"status": "accepted"}),
        "stored directly while up"
    );

    proxy.cut();
    let during: Vec<Delivery> = (0..5).map(|n| stripe(&format!("evt_during_{n}"))).collect();
    for d in &during {
        let reply = app.post("stripe", d.headers.clone(), &d.body).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.json, json!({"status": "buffered"}));
    }
    assert_eq!(
        row_count(&app.pool).await,
        1,
        "nothing reached the database"
    );

    let buffered = peek(&queue, queue.queue_url()).await;
    assert_eq!(buffered.len(), 5);
    let mut bodies: Vec<Vec<u8>> = buffered
        .iter()
        .map(|m| {
            let d = m.delivery.as_ref().expect("a buffered delivery");
            assert_eq!(d.envelope.source_id, "stripe");
            assert_eq!(d.envelope.verified_with, "current");
            assert!(d.envelope.headers.contains_key("stripe-signature"));
            assert!(d.envelope.received_at_micros > 0);
            d.body.clone()
        })
        .collect();
    bodies.sort();
    let mut sent: Vec<Vec<u8>> = during.iter().map(|d| d.body.clone()).collect();
    sent.sort();
    assert_eq!(bodies, sent, "the raw bytes, exactly");
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_503_only_when_neither_store_took_the_delivery(pool: PgPool) {
    let (app, proxy) = buffered_app(
        pool,
        BufferMode::Spillover,
        unreachable_queue().await,
        MAX_BODY,
    )
    .await;
    let warm = stripe("evt_warm");
    app.post("stripe", warm.headers, &warm.body).await;
    proxy.cut();
    let d = stripe("evt_lost_nowhere");
    let reply = app.post("stripe", d.headers, &d.body).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.headers["retry-after"], "5");

    proxy.restore();
    let reply = app
        .post(
            "stripe",
            stripe("evt_back").headers,
            &stripe("evt_back").body,
        )
        .await;
    assert_eq!(reply.status, StatusCode::OK);
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn database_mode_buffers_nothing(pool: PgPool) {
    let queue = new_buffer_queue(5, 30).await;
    let (app, proxy) = buffered_app(pool, BufferMode::Database, queue.clone(), MAX_BODY).await;
    let warm = stripe("evt_warm");
    app.post("stripe", warm.headers, &warm.body).await;
    proxy.cut();
    let d = stripe("evt_refused");
    let reply = app.post("stripe", d.headers, &d.body).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(peek(&queue, queue.queue_url()).await.is_empty());
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn queue_mode_sends_every_verified_delivery_to_sqs(pool: PgPool) {
    let queue = new_buffer_queue(5, 30).await;
    let (app, _proxy) = buffered_app(pool, BufferMode::Queue, queue.clone(), MAX_BODY).await;
    let d = github("gh-delivery-1");
    let reply = app.post("github", d.headers.clone(), &d.body).await;
    assert_eq!(reply.json, json!({"status": "buffered"}));
    assert_eq!(
        row_count(&app.pool).await,
        0,
        "the consumer stores it, not ingest"
    );

    // What fails verification is never buffered.
    let mut forged = d.headers.clone();
    set(
        &mut forged,
        "x-hub-signature-256",
        &format!("sha256={}", "0".repeat(64)),
    );
    let reply = app.post("github", forged, &d.body).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);

    // A signed body the field map cannot read is answered 400 and recorded directly, as in
    // database mode.
    let unreadable = resign(
        Scheme::Stripe,
        &secret_of(Scheme::Stripe),
        "evt_x",
        now(),
        stripe("evt_x").headers,
        b"not json".to_vec(),
    );
    let reply = app
        .post("stripe", unreadable.headers, &unreadable.body)
        .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(anomalies(&app.pool).await.len(), 1);

    let buffered = peek(&queue, queue.queue_url()).await;
    assert_eq!(buffered.len(), 1, "only the verified, readable delivery");
    let envelope = &buffered[0].delivery.as_ref().unwrap().envelope;
    assert_eq!(envelope.headers["x-github-delivery"], "gh-delivery-1");
    assert!(
        envelope.signed_headers.is_empty(),
        "GitHub signs no header: the consumer must know the id is outside the signature"
    );
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_body_too_large_for_one_message_is_never_truncated(pool: PgPool) {
    let big = |id: &str| {
        delivery(
            Scheme::Stripe,
            &secret_of(Scheme::Stripe),
            id,
            now(),
            json!({"padding": "x".repeat(shared::buffer::SQS_MAX_MESSAGE_BYTES)}),
        )
    };
    let limit = 2 * shared::buffer::SQS_MAX_MESSAGE_BYTES;

    // Queue mode: stored directly instead.
    let queue = new_buffer_queue(5, 30).await;
    let (app, proxy) = buffered_app(pool, BufferMode::Queue, queue.clone(), limit).await;
    let d = big("evt_big");
    let reply = app.post("stripe", d.headers.clone(), &d.body).await;
    assert_eq!(reply.json, json!({"status": "accepted"}));
    assert_eq!(
        event(&app.pool, TENANT, "evt_big")
            .await
            .unwrap()
            .payload
            .unwrap(),
        d.body
    );

    // Spillover with the database down: 503 (the provider retries), never a truncated copy.
    drop(proxy);
    let (app, proxy) = buffered_app(app.pool, BufferMode::Spillover, queue.clone(), limit).await;
    let warm = stripe("evt_warm");
    app.post("stripe", warm.headers, &warm.body).await;
    proxy.cut();
    let d = big("evt_big_during");
    let reply = app.post("stripe", d.headers, &d.body).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(peek(&queue, queue.queue_url()).await.is_empty());

    // The largest body that fits one message is buffered whole.
    let fits = shared::buffer::SQS_MAX_MESSAGE_BYTES - 4096;
    let d = delivery(
        Scheme::Stripe,
        &secret_of(Scheme::Stripe),
        "evt_fits",
        now(),
        json!({"padding": "x".repeat(fits - 200)}),
    );
    let reply = app.post("stripe", d.headers, &d.body).await;
    assert_eq!(
        reply.json,
        json!({"status": "buffered"}),
        "{} bytes",
        d.body.len()
    );
    let buffered = peek(&queue, queue.queue_url()).await;
    assert_eq!(buffered[0].delivery.as_ref().unwrap().body, d.body);
}
