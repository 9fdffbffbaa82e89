//! The local runner, spawned in-process on an ephemeral port and driven over real HTTP, the way
//! a developer's `curl` would.

use std::sync::Arc;

use pipeline_tests::*;
use serde_json::json;
use shared::domain::Scheme;
use sqlx::PgPool;

async fn spawn_runner(app: &TestApp, max_body: usize) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let runner = hookctl::serve::Runner {
        ingestor: Arc::clone(&app.ingestor),
        registry: Arc::new(shared::effects::EffectRegistry::standard()),
        buffer: None,
    };
    let router = hookctl::serve::router(runner, max_body);
    tokio::spawn(hookctl::serve::serve(listener, router));
    format!("http://{address}")
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_signed_post_over_http_lands_a_row(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let base = spawn_runner(&app, MAX_BODY).await;
    let client = reqwest::Client::new();
    let d = delivery(
        Scheme::Github,
        &secret_of(Scheme::Github),
        "72d3162e-cc78-11e3-81ab-4c9367dc0958",
        now(),
        json!({}),
    );

    let send = |headers: http::HeaderMap, body: Vec<u8>| {
        client
            .post(format!("{base}/webhooks/github"))
            .headers(headers)
            .body(body)
            .send()
    };
    let first = send(d.headers.clone(), d.body.clone()).await.unwrap();
    let second = send(d.headers.clone(), d.body.clone()).await.unwrap();

    assert_eq!(first.status(), 200);
    assert_eq!(
        first.json::<serde_json::Value>().await.unwrap(),
        json!({"status": "accepted"})
    );
    assert_eq!(
        second.json::<serde_json::Value>().await.unwrap(),
        json!({"status": "duplicate"})
    );
    let row = event(&app.pool, TENANT, "72d3162e-cc78-11e3-81ab-4c9367dc0958")
        .await
        .unwrap();
    assert_eq!((row.event_type.as_str(), row.delivery_count), ("issues", 2));
    assert_eq!(row.payload.as_deref(), Some(&d.body[..]));

    let forged = client
        .post(format!("{base}/webhooks/github"))
        .headers(d.headers.clone())
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), 401);
    let unknown = client
        .post(format!("{base}/webhooks/gitlab"))
        .headers(d.headers)
        .body(d.body)
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    assert_eq!(
        client
            .get(format!("{base}/health"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
        "ok"
    );
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_oversized_post_over_http_is_413(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let base = spawn_runner(&app, 1024).await;
    let d = delivery(
        Scheme::Github,
        &secret_of(Scheme::Github),
        "big",
        now(),
        json!({"pad": "x".repeat(4096)}),
    );
    let reply = reqwest::Client::new()
        .post(format!("{base}/webhooks/github"))
        .headers(d.headers)
        .body(d.body)
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 413);
    assert!(events(&app.pool).await.is_empty());
}

/// The whole local pipeline: ingest over HTTP, the drain and the outbox on their timer, the
/// outbox delivering to the runner's own sink.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_local_pipeline_takes_a_payment_from_post_to_delivered_fulfilment(pool: PgPool) {
    let app = pipeline_tests::drain::app(pool.clone()).await;
    pipeline_tests::drain::create_order(&pool, "ord-1", "REF-1", 2500, "eur").await;
    let base = spawn_runner(&app, MAX_BODY).await;
    let drainer = pipeline_tests::drain::standard_drainer(&pool);
    let sender = shared::outbox::OutboxSender::new(
        pool.clone(),
        shared::outbox::OutboxSettings::new(format!("{base}/outbox-sink")),
    )
    .unwrap();
    let _pipeline = hookctl::serve::spawn_pipeline(
        Arc::new(drainer),
        Some(Arc::new(sender)),
        std::time::Duration::from_millis(50),
    );

    let d = pipeline_tests::drain::payment("evt_local", "ord-1", "REF-1", 2500, "eur");
    let reply = reqwest::Client::new()
        .post(format!("{base}/webhooks/stripe"))
        .headers(d.headers)
        .body(d.body)
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 200);

    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let delivered: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox WHERE status = 'delivered' AND action = 'fulfil_order'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if delivered == 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < give_up,
            "fulfilment not delivered"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(
        event(&pool, TENANT, "evt_local").await.unwrap().status,
        "processed"
    );
    let state: String = sqlx::query_scalar("SELECT state FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(state, "paid");

    let listed: serde_json::Value = reqwest::Client::new()
        .post(format!("{base}/operator"))
        .body(r#"{"action":"list_dead_letters"}"#)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed, serde_json::json!({"dead_letters": []}));
}

/// Sends `head` (a request line and headers, without the blank line) and a small JSON body
/// over a fresh TCP connection; returns what came back, empty if the runner dropped it.
async fn raw_exchange(base: &str, head: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = base.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let mut request = head.to_vec();
    request.extend_from_slice(
        b"\r\nHost: localhost\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
    );
    stream.write_all(&request).await.unwrap();
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer).await;
    String::from_utf8_lossy(&answer).into_owned()
}

/// A route segment no source id can be (a NUL byte, escaped or raw; a space; a slash) is
/// answered 4xx, as API Gateway would answer it, never with a dropped connection.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_route_no_source_can_have_is_answered_not_dropped(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let base = spawn_runner(&app, MAX_BODY).await;
    for head in [
        &b"POST /webhooks/github%00 HTTP/1.1"[..],
        b"POST /webhooks/%00 HTTP/1.1",
        b"POST /webhooks/a%20b HTTP/1.1",
        b"POST /webhooks/a%2Fb HTTP/1.1",
        b"POST /webhooks/gith\0ub HTTP/1.1",
    ] {
        let answer = raw_exchange(&base, head).await;
        let status = answer.get(..12).unwrap_or_default();
        assert!(
            status == "HTTP/1.1 404" || status == "HTTP/1.1 400",
            "{:?} answered {answer:?}",
            String::from_utf8_lossy(head)
        );
    }
    // The runner still serves.
    let answer = raw_exchange(&base, b"POST /webhooks/gitlab HTTP/1.1").await;
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer:?}");
    assert_eq!(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM webhook_events")
            .fetch_one(&app.pool)
            .await
            .unwrap(),
        0
    );
}
