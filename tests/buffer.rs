//! The second buffer end to end: ingest in spillover and queue mode against a PostgreSQL that a
//! proxy makes unreachable, and moto's SQS; the consumer files what was buffered.

use http::StatusCode;
use pipeline_tests::buffer::{buffered_app, new_buffer_queue, peek};
use pipeline_tests::lambda;
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

/// A GitHub delivery whose body names its id: GitHub's id is outside the signature, so the same
/// bytes under two ids would be one body replayed (held, not queued).
fn github(id: &str) -> Delivery {
    delivery(
        Scheme::Github,
        &secret_of(Scheme::Github),
        id,
        now(),
        json!({"delivery": id}),
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
        metrics_endpoint_url: None,
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

    // A source this warm process never read cannot be verified while the database is down:
    // 503 (the provider retries), never a 500, and nothing buffered unverified.
    let app = std::sync::Arc::new(app);
    let cold: Vec<_> = (0..8)
        .map(|n| {
            let app = app.clone();
            tokio::spawn(async move {
                let d = github(&format!("gh-cold-source-{n}"));
                app.post("github", d.headers, &d.body).await
            })
        })
        .collect();
    for reply in cold {
        let reply = reply.await.unwrap();
        assert_eq!(
            reply.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{:?}",
            reply.json
        );
    }

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

/// Files everything the queue holds, as the consumer would, until a round receives nothing.
async fn drain_buffer(app: &TestApp, queue: &BufferQueue) {
    while hookctl::serve::consume_once(&app.pool, queue, 30)
        .await
        .unwrap()
        .received()
        > 0
    {}
}

async fn queued_events(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM event_queue")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_outage_under_a_sender_that_never_retries_loses_nothing(pool: PgPool) {
    let queue = new_buffer_queue(5, 30).await;
    let (app, proxy) = buffered_app(pool, BufferMode::Spillover, queue.clone(), MAX_BODY).await;
    let app = std::sync::Arc::new(app);
    let before = github("gh-before");
    app.post("github", before.headers, &before.body).await;

    proxy.cut();
    let started = chrono::Utc::now();
    // Twenty deliveries at once, on real concurrent requests; none is ever sent again.
    let sends: Vec<_> = (0..20)
        .map(|n| {
            let app = app.clone();
            tokio::spawn(async move {
                let d = github(&format!("gh-outage-{n}"));
                app.post("github", d.headers, &d.body).await
            })
        })
        .collect();
    for send in sends {
        let reply = send.await.unwrap();
        assert_eq!(reply.json, json!({"status": "buffered"}));
    }
    let buffered_by = chrono::Utc::now();
    proxy.restore();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    drain_buffer(&app, &queue).await;

    let rows = events(&app.pool).await;
    assert_eq!(rows.len(), 21, "every delivery landed");
    assert_eq!(
        queued_events(&app.pool).await,
        21,
        "each queued for the drain once: {:?}",
        rows.iter()
            .map(|r| (&r.external_id, &r.status))
            .collect::<Vec<_>>()
    );
    for row in rows
        .iter()
        .filter(|r| r.external_id.starts_with("gh-outage-"))
    {
        assert_eq!(row.delivery_count, 1, "{} exactly once", row.external_id);
        assert_eq!(row.status, "pending");
        assert!(
            row.first_received_at >= started && row.first_received_at <= buffered_by,
            "{}: received at {} (the buffered time), not when it was filed",
            row.external_id,
            row.first_received_at
        );
    }
    assert_eq!(
        queued_events(&app.pool).await,
        21,
        "each queued for the drain once"
    );
    assert!(peek(&queue, queue.queue_url()).await.is_empty());
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_buffered_delivery_and_its_retry_stored_directly_end_as_one_row(pool: PgPool) {
    let queue = new_buffer_queue(5, 30).await;
    let (app, proxy) = buffered_app(pool, BufferMode::Spillover, queue.clone(), MAX_BODY).await;
    let warm = stripe("evt_warm");
    app.post("stripe", warm.headers, &warm.body).await;
    proxy.cut();
    let d = stripe("evt_twice");
    assert_eq!(
        app.post("stripe", d.headers.clone(), &d.body)
            .await
            .outcome(),
        "buffered"
    );
    proxy.restore();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    // The provider's retry arrives directly before the consumer filed the buffered copy.
    assert_eq!(
        app.post("stripe", d.headers.clone(), &d.body)
            .await
            .outcome(),
        "accepted"
    );
    drain_buffer(&app, &queue).await;

    let row = event(&app.pool, TENANT, "evt_twice").await.unwrap();
    assert_eq!(row.delivery_count, 2);
    assert_eq!(row.last_delivery_outcome, "duplicate");
    assert_eq!(row.payload.as_deref(), Some(&d.body[..]));
    assert_eq!(
        queued_events(&app.pool).await,
        2,
        "evt_warm and evt_twice, once each"
    );
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_conflict_across_the_two_paths_is_recorded_as_the_direct_path_records_it(pool: PgPool) {
    let queue = new_buffer_queue(5, 30).await;
    let (app, proxy) = buffered_app(pool, BufferMode::Spillover, queue.clone(), MAX_BODY).await;
    let warm = stripe("evt_warm");
    app.post("stripe", warm.headers, &warm.body).await;
    proxy.cut();
    let first = delivery(
        Scheme::Stripe,
        &secret_of(Scheme::Stripe),
        "evt_changed",
        now(),
        json!({"amount": 1}),
    );
    assert_eq!(
        app.post("stripe", first.headers, &first.body)
            .await
            .outcome(),
        "buffered"
    );
    proxy.restore();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let second = delivery(
        Scheme::Stripe,
        &secret_of(Scheme::Stripe),
        "evt_changed",
        now(),
        json!({"amount": 2}),
    );
    assert_eq!(
        app.post("stripe", second.headers, &second.body)
            .await
            .outcome(),
        "accepted"
    );
    drain_buffer(&app, &queue).await;

    let row = event(&app.pool, TENANT, "evt_changed").await.unwrap();
    assert_eq!((row.delivery_count, row.conflict_count), (2, 1));
    assert_eq!(row.last_delivery_outcome, "conflict");
    let conflicts: Vec<_> = anomalies(&app.pool)
        .await
        .into_iter()
        .filter(|a| a.kind == "digest_conflict")
        .collect();
    assert_eq!(
        conflicts.len(),
        1,
        "one digest_conflict, as the direct path records"
    );
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_consumer_killed_mid_batch_doubles_nothing(pool: PgPool) {
    let queue = new_buffer_queue(5, 30).await;
    let (app, _proxy) = buffered_app(pool, BufferMode::Queue, queue.clone(), MAX_BODY).await;
    for n in 0..4 {
        let d = stripe(&format!("evt_killed_{n}"));
        assert_eq!(
            app.post("stripe", d.headers, &d.body).await.outcome(),
            "buffered"
        );
    }
    // Killed before it filed anything: received, never answered. They reappear after the
    // visibility timeout.
    let url = queue.queue_url().to_owned();
    let taken = queue.receive_from(&url, 10, 1, 0).await.unwrap();
    assert!(!taken.is_empty());
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;

    // Killed after it filed but before SQS deleted the messages: filed again, counted once.
    let messages: Vec<shared::buffer::filing::Message> = queue
        .receive_from(&url, 10, 1, 1)
        .await
        .unwrap()
        .into_iter()
        .map(|m| shared::buffer::filing::Message {
            message_id: m.message_id,
            delivery: m.delivery,
        })
        .collect();
    assert!(!messages.is_empty());
    shared::buffer::consumer::consume(&app.pool, &messages)
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    drain_buffer(&app, &queue).await;

    let rows = events(&app.pool).await;
    assert_eq!(rows.len(), 4);
    for row in &rows {
        assert_eq!(row.delivery_count, 1, "{} counted once", row.external_id);
    }
    assert_eq!(queued_events(&app.pool).await, 4);
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_poison_message_reaches_the_dead_letter_queue_and_an_unfilable_one_an_anomaly(
    pool: PgPool,
) {
    let queue = new_buffer_queue(2, 1).await;
    let (app, _proxy) = buffered_app(pool, BufferMode::Queue, queue.clone(), MAX_BODY).await;
    // A message no build can read (not an envelope).
    queue
        .client()
        .send_message()
        .queue_url(queue.queue_url())
        .message_body("{\"not\": \"a buffered delivery\"}")
        .send()
        .await
        .unwrap();
    // A delivery whose source reads its event id elsewhere by the time the consumer files it
    // (a disabled source no longer makes one: it files what was admitted).
    let d = github("gh-unreadable-meanwhile");
    assert_eq!(
        app.post("github", d.headers, &d.body).await.outcome(),
        "buffered"
    );
    sqlx::query(
        "UPDATE sources SET external_id_from = 'json:/no_such_field' WHERE source_id = 'github'",
    )
    .execute(&app.pool)
    .await
    .unwrap();

    // Through the Lambda's own handler, as the event source mapping invokes it.
    let url = queue.queue_url().to_owned();
    let records: Vec<aws_lambda_events::sqs::SqsMessage> = queue
        .receive_from(&url, 10, 1, 1)
        .await
        .unwrap()
        .into_iter()
        .map(|m| sqs_record(&m))
        .collect();
    assert_eq!(records.len(), 2);
    let poison_id = records
        .iter()
        .find(|r| r.body.as_deref() == Some("{\"not\": \"a buffered delivery\"}"))
        .and_then(|r| r.message_id.clone())
        .unwrap();
    let handles: Vec<(String, String)> = records
        .iter()
        .map(|r| {
            (
                r.message_id.clone().unwrap(),
                r.receipt_handle.clone().unwrap(),
            )
        })
        .collect();
    let mut event = aws_lambda_events::sqs::SqsEvent::default();
    event.records = records;
    let response = ::buffer::handler(
        lambda::invocation(event, std::time::Duration::from_secs(30)),
        &app.pool,
    )
    .await
    .unwrap();
    let failed: Vec<&str> = response
        .batch_item_failures
        .iter()
        .map(|f| f.item_identifier.as_str())
        .collect();
    assert_eq!(
        failed,
        vec![poison_id.as_str()],
        "only the poison message is kept"
    );
    // The event source mapping deletes what the function did not report as failed.
    for (id, handle) in &handles {
        if !failed.contains(&id.as_str()) {
            queue.delete_from(&url, handle).await.unwrap();
        }
    }
    assert_eq!(row_count(&app.pool).await, 0);
    let recorded = anomalies(&app.pool).await;
    assert_eq!(
        recorded.len(),
        1,
        "the unfilable delivery is an ingest anomaly"
    );

    // Handed out again past the receive count, it moves to the dead-letter queue.
    for _ in 0..4 {
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
        let _ = queue.receive_from(&url, 10, 1, 0).await.unwrap();
    }
    let dead = peek(&queue, queue.dead_letter_queue_url().unwrap()).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message_id, poison_id);
    assert!(peek(&queue, &url).await.is_empty());
}

/// A received message as the event source mapping hands it to the function.
fn sqs_record(m: &shared::buffer::queue::Received) -> aws_lambda_events::sqs::SqsMessage {
    let mut record = aws_lambda_events::sqs::SqsMessage::default();
    record.message_id = Some(m.message_id.clone());
    record.receipt_handle = Some(m.receipt_handle.clone());
    match &m.delivery {
        Ok(d) => {
            record.body = Some(d.envelope_json());
            let mut attribute = aws_lambda_events::sqs::SqsMessageAttribute::default();
            attribute.data_type = Some("Binary".into());
            let mut body = aws_lambda_events::encodings::Base64Data::default();
            *body = d.body.clone();
            attribute.binary_value = Some(body);
            record
                .message_attributes
                .insert(shared::buffer::BODY_ATTRIBUTE.into(), attribute);
        }
        Err(_) => record.body = Some(m.message_body.clone()),
    }
    record
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn after_a_spill_the_next_deliveries_go_straight_to_the_buffer(pool: PgPool) {
    let queue = new_buffer_queue(5, 30).await;
    let (app, proxy) = pipeline_tests::buffer::buffered_app_holding(
        pool,
        BufferMode::Spillover,
        queue.clone(),
        MAX_BODY,
        std::time::Duration::from_secs(60),
    )
    .await;
    let warm = stripe("evt_warm");
    app.post("stripe", warm.headers, &warm.body).await;
    proxy.cut();
    let first = stripe("evt_first_in_outage");
    assert_eq!(
        app.post("stripe", first.headers, &first.body)
            .await
            .outcome(),
        "buffered"
    );
    let asked = proxy.attempts();
    for n in 0..10 {
        let d = stripe(&format!("evt_held_{n}"));
        assert_eq!(
            app.post("stripe", d.headers, &d.body).await.outcome(),
            "buffered"
        );
    }
    assert_eq!(
        proxy.attempts(),
        asked,
        "no delivery of the hold asked the database for a connection"
    );
    assert_eq!(peek(&queue, queue.queue_url()).await.len(), 11);
}

/// An SQS endpoint that takes the connection and never answers (no NAT, a black-holed VPC
/// endpoint) costs the provider a 503 inside the ingest function's 10 s timeout, never the
/// timeout itself: the SQS client's attempt and operation timeouts bound the send.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_sqs_that_never_answers_costs_a_503_inside_the_function_timeout(pool: PgPool) {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = silent.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let queue = BufferQueue::connect(&QueueSettings {
        queue_url: format!("http://{address}/000000000000/silent"),
        dead_letter_queue_url: None,
        endpoint: shared::aws::AwsEndpoint {
            endpoint_url: Some(format!("http://{address}")),
            region: Some("us-east-1".into()),
        },
        metrics_endpoint_url: None,
    })
    .await;
    let (app, proxy) = buffered_app(pool, BufferMode::Spillover, queue, MAX_BODY).await;
    let warm = stripe("evt_warm");
    app.post("stripe", warm.headers, &warm.body).await;
    proxy.cut();
    let d = stripe("evt_nowhere_to_go");
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        app.post("stripe", d.headers, &d.body),
    )
    .await
    .expect("answered inside the ingest function's 10 s timeout");
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
}

/// Spillover buffers whatever the database refuses, not only what it calls an outage: a
/// read-only database during a failover (SQLSTATE 25006) and an I/O fault (58030) are answered
/// `buffered` (SQS acknowledged the delivery), never 500; the consumer files them once the
/// database takes writes again.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn spillover_buffers_a_refusal_of_any_error_class(pool: PgPool) {
    let queue = new_buffer_queue(5, 30).await;
    let (app, _proxy) =
        buffered_app(pool.clone(), BufferMode::Spillover, queue.clone(), MAX_BODY).await;
    let mut sent = Vec::new();
    for (code, message) in [
        ("25006", "cannot execute INSERT in a read-only transaction"),
        ("58030", "could not write to file: I/O error"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE OR REPLACE FUNCTION test_refuse() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN RAISE EXCEPTION '{message}' USING ERRCODE = '{code}'; END $$"
        )))
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query(
            "CREATE OR REPLACE TRIGGER test_refuse BEFORE INSERT OR UPDATE ON webhook_events \
             FOR EACH ROW EXECUTE FUNCTION test_refuse()",
        )
        .execute(&pool)
        .await
        .unwrap();
        let d = stripe(&format!("evt_refused_{code}"));
        let reply = app.post("stripe", d.headers.clone(), &d.body).await;
        assert_eq!(
            (reply.status, reply.json.clone()),
            (StatusCode::OK, json!({"status": "buffered"})),
            "SQLSTATE {code}"
        );
        sent.push(d.body);
    }
    assert_eq!(row_count(&pool).await, 0);
    let buffered = peek(&queue, queue.queue_url()).await;
    let mut bodies: Vec<Vec<u8>> = buffered
        .iter()
        .map(|m| {
            m.delivery
                .as_ref()
                .expect("a buffered delivery")
                .body
                .clone()
        })
        .collect();
    bodies.sort();
    sent.sort();
    assert_eq!(bodies, sent, "both refused deliveries are in the buffer");

    sqlx::query("DROP TRIGGER test_refuse ON webhook_events")
        .execute(&pool)
        .await
        .unwrap();
    drain_buffer(&app, &queue).await;
    assert_eq!(
        row_count(&pool).await,
        2,
        "filed once the database takes writes"
    );
}

/// In queue mode the consumer claims what ingest would have: the envelope carries the digest of
/// the signed string, so a Mailgun token replayed over forged event data is held as a replay
/// when filed from the buffer too, and one event is queued.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_consumer_claims_the_signed_string_as_ingest_does(pool: PgPool) {
    let queue = new_buffer_queue(5, 30).await;
    let (app, _proxy) = buffered_app(pool, BufferMode::Queue, queue.clone(), MAX_BODY).await;
    let key = secret_of(Scheme::Mailgun);
    let mut headers = http::HeaderMap::new();
    headers.insert("content-type", "application/json".parse().unwrap());
    let at = now();
    for (id, event) in [("mg-1", "delivered"), ("mg-forged", "clicked")] {
        let body = mailgun_body(&key, at, "token-1", id, event);
        let reply = app.post("mailgun", headers.clone(), &body).await;
        assert_eq!(reply.json, json!({"status": "buffered"}));
    }
    let buffered = peek(&queue, queue.queue_url()).await;
    assert!(
        buffered.iter().all(|m| m
            .delivery
            .as_ref()
            .unwrap()
            .envelope
            .signed_digest
            .is_some()),
        "the envelope carries the signed string's digest"
    );
    drain_buffer(&app, &queue).await;
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT external_id, status FROM webhook_events ORDER BY external_id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(
        rows,
        vec![
            ("mg-1".to_owned(), "pending".to_owned()),
            ("mg-forged".to_owned(), "processed".to_owned())
        ]
    );
    assert_eq!(queued_events(&app.pool).await, 1);
}

/// Admission already happened: a delivery answered `200 buffered` whose source is disabled
/// before the consumer files it is filed all the same (the provider will not send it again),
/// never only kept as an anomaly no command files. Queue mode: deliver, disable, consume,
/// enable, consume: one event, no anomaly.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_buffered_delivery_is_filed_though_its_source_was_disabled_since(pool: PgPool) {
    let queue = new_buffer_queue(5, 30).await;
    let (app, _proxy) = buffered_app(pool, BufferMode::Queue, queue.clone(), MAX_BODY).await;
    let d = stripe("evt_admitted");
    let reply = app.post("stripe", d.headers.clone(), &d.body).await;
    assert_eq!(reply.json, json!({"status": "buffered"}));

    let enabled = |on: bool| {
        let pool = app.pool.clone();
        async move {
            sqlx::query("UPDATE sources SET enabled = $1 WHERE source_id = 'stripe'")
                .bind(on)
                .execute(&pool)
                .await
                .unwrap();
        }
    };
    enabled(false).await;
    drain_buffer(&app, &queue).await;
    enabled(true).await;
    drain_buffer(&app, &queue).await;

    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT external_id, status FROM webhook_events")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(
        rows,
        vec![("evt_admitted".to_owned(), "pending".to_owned())]
    );
    assert_eq!(queued_events(&app.pool).await, 1);
    assert!(anomalies(&app.pool).await.is_empty());
    assert!(peek(&queue, queue.queue_url()).await.is_empty());
}

/// A buffered delivery the consumer cannot read (its source's field map changed meanwhile) is
/// kept as an anomaly with its payload and headers; once the map is fixed, `file_kept` (hookctl
/// buffer file-kept) files it as ingest would have, once, attributed, and the unfiled-buffered
/// check stops counting it. A kept delivery of an earlier release (its source disabled
/// meanwhile, no headers kept) files the same way; an anomaly that keeps no delivery is refused.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_kept_delivery_is_filed_by_the_operator_once_its_source_reads_it(pool: PgPool) {
    use shared::operator::{OperatorRequest, OperatorResponse, handle};
    let queue = new_buffer_queue(5, 30).await;
    let (app, _proxy) = buffered_app(pool, BufferMode::Queue, queue.clone(), MAX_BODY).await;
    let pool = app.pool.clone();
    let d = github("gh-kept");
    assert_eq!(
        app.post("github", d.headers.clone(), &d.body)
            .await
            .outcome(),
        "buffered"
    );
    let event_type_from = |locator: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query("UPDATE sources SET event_type_from = $1 WHERE source_id = 'github'")
                .bind(locator)
                .execute(&pool)
                .await
                .unwrap();
        }
    };
    event_type_from("json:/no_such_field").await;
    drain_buffer(&app, &queue).await;
    assert_eq!(row_count(&pool).await, 0);
    let anomaly_id: i64 = sqlx::query_scalar(
        "SELECT anomaly_id FROM ingest_anomalies WHERE kind = 'missing_field' \
         AND detail LIKE 'buffered delivery %' AND headers ? 'x-github-delivery'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let checks = |pool: PgPool| async move {
        shared::anomaly::run_once(&pool, &Default::default(), "test")
            .await
            .unwrap()
            .breaches
    };
    let breaches = checks(pool.clone()).await;
    assert!(
        breaches.contains(&"unfilable_buffered_deliveries_last_day".to_owned()),
        "{breaches:?}"
    );
    assert!(
        !breaches.contains(&"unreadable_deliveries_last_hour".to_owned()),
        "{breaches:?}"
    );

    let registry = shared::effects::EffectRegistry::standard();
    let file = |anomaly_id: i64| OperatorRequest::FileKept {
        anomaly_id,
        actor: Some("alice".into()),
        reason: Some("field map fixed".into()),
    };
    let refused = handle(&pool, &registry, file(anomaly_id))
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("still cannot read"),
        "{refused}"
    );

    event_type_from("header:x-github-event").await;
    let OperatorResponse::KeptFiled { filed_kept } =
        handle(&pool, &registry, file(anomaly_id)).await.unwrap()
    else {
        panic!("not a filed answer")
    };
    assert_eq!(
        (filed_kept.external_id.as_str(), filed_kept.outcome.as_str()),
        ("gh-kept", "accepted")
    );
    let rows: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT external_id, event_type, status FROM webhook_events ORDER BY external_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        vec![(
            "gh-kept".to_owned(),
            "issues".to_owned(),
            "pending".to_owned()
        )]
    );
    assert_eq!(queued_events(&pool).await, 1);
    let breaches = checks(pool.clone()).await;
    assert!(
        !breaches.contains(&"unfilable_buffered_deliveries_last_day".to_owned()),
        "{breaches:?}"
    );
    let again = handle(&pool, &registry, file(anomaly_id))
        .await
        .unwrap_err();
    assert!(
        again
            .to_string()
            .contains("filed already, as event gh-kept"),
        "{again}"
    );
    let recorded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operator_actions WHERE action = 'file_kept' AND actor = 'alice'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(recorded, 1);

    // What an earlier release kept when the source was disabled meanwhile: no headers.
    let older = stripe("evt_kept_by_an_older_release");
    let older_id: i64 = sqlx::query_scalar(
        "INSERT INTO ingest_anomalies (tenant_id, source_id, kind, payload_sha256, payload, detail) \
         VALUES ($1, 'stripe', 'buffered_source_unavailable', sha256($2), $2, 'disabled meanwhile') \
         RETURNING anomaly_id",
    )
    .bind(TENANT)
    .bind(&older.body)
    .fetch_one(&pool)
    .await
    .unwrap();
    let OperatorResponse::KeptFiled { filed_kept } =
        handle(&pool, &registry, file(older_id)).await.unwrap()
    else {
        panic!("not a filed answer")
    };
    assert_eq!(filed_kept.external_id, "evt_kept_by_an_older_release");

    // An anomaly that keeps no delivery in place of an event.
    let conflict_id: i64 = sqlx::query_scalar(
        "INSERT INTO ingest_anomalies (tenant_id, source_id, kind, payload_sha256, detail) \
         VALUES ($1, 'stripe', 'digest_conflict', sha256('x'), 'a conflict') RETURNING anomaly_id",
    )
    .bind(TENANT)
    .fetch_one(&pool)
    .await
    .unwrap();
    let refused = handle(&pool, &registry, file(conflict_id))
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("keeps no delivery"),
        "{refused}"
    );
}

/// A Microsoft Graph batch buffered in queue mode: the SQS message holds the notifications
/// without their clientState (the secret itself), and the consumer files each as its event.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_buffered_graph_batch_carries_no_client_state(pool: PgPool) {
    let queue = new_buffer_queue(5, 30).await;
    let (app, _proxy) = buffered_app(pool, BufferMode::Queue, queue.clone(), MAX_BODY).await;
    let client_state = secret_of(Scheme::MicrosoftGraph);
    let notification = |id: &str| {
        json!({"id": id, "subscriptionId": "s-1", "clientState": client_state,
               "subscriptionExpirationDateTime": "2026-12-08T10:00:00Z", "changeType": "updated",
               "resource": format!("Users/u-1/Events/{id}"), "tenantId": "t-1"})
    };
    let body =
        serde_json::to_vec(&json!({"value": [notification("e-1"), notification("e-2")]})).unwrap();
    let mut headers = http::HeaderMap::new();
    set(&mut headers, "content-type", "application/json");
    let reply = app.post("graph", headers, &body).await;
    assert_eq!(reply.json, json!({"status": "buffered"}));
    let buffered = peek(&queue, queue.queue_url()).await;
    assert_eq!(buffered.len(), 1, "one message for the request");
    let carried = &buffered[0].delivery.as_ref().unwrap().body;
    let carried_text = String::from_utf8_lossy(carried);
    assert!(carried_text.contains("e-2"), "{carried_text}");
    assert!(!carried_text.contains(&client_state), "{carried_text}");

    drain_buffer(&app, &queue).await;
    let stored = events(&app.pool).await;
    assert_eq!(stored.len(), 2);
    for event in stored {
        let payload = String::from_utf8(event.payload.unwrap()).unwrap();
        assert!(!payload.contains(&client_state), "{payload}");
    }
}
