//! Every row of the ingest HTTP contract (DESIGN.md), driven through the Lambda handler with
//! constructed API Gateway requests against a fresh database per test.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderValue, StatusCode};
use pipeline_tests::*;
use serde_json::json;
use shared::domain::Scheme;
use shared::ingest::{IngestLimits, Ingestor};
use shared::secrets::{SecretSet, SecretStore};
use shared::sources::{self, SourceRegistry};
use shared::store;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const STRIPE: Scheme = Scheme::Stripe;

fn stripe(id: &str, extra: serde_json::Value) -> Delivery {
    delivery(STRIPE, &secret_of(STRIPE), id, now(), extra)
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_new_event_is_accepted_and_committed_before_the_response(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    // The body claims another tenant: the tenant must come from the source, never the body.
    let d = stripe("evt_accepted", json!({"tenant_id": "mallory"}));

    let reply = app.post("stripe", d.headers.clone(), &d.body).await;

    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.json, json!({"status": "accepted"}));
    let rows = events(&app.pool).await;
    assert_eq!(rows.len(), 1);
    let row = &rows[0];
    assert_eq!(
        (
            row.tenant_id.as_str(),
            row.external_id.as_str(),
            row.source_id.as_str()
        ),
        (TENANT, "evt_accepted", "stripe")
    );
    assert_eq!(
        row.payload.as_deref(),
        Some(&d.body[..]),
        "raw bytes stored exactly"
    );
    assert_eq!(row.payload_sha256, sha256(&d.body));
    assert_eq!(row.event_type, "payment_intent.succeeded");
    assert_eq!(row.entity_id.as_deref(), Some("pi_1"));
    assert_eq!(
        (
            row.status.as_str(),
            row.delivery_count,
            row.verified_with.as_str()
        ),
        ("pending", 1, "current")
    );
    assert_eq!(
        row.headers["stripe-signature"],
        d.headers["stripe-signature"].to_str().unwrap()
    );
    assert!(anomalies(&app.pool).await.is_empty());
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn every_scheme_lands_one_row_with_its_own_id_and_type(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    for scheme in SCHEMES {
        let id = format!("{scheme}-evt-1");
        let d = delivery(scheme, &secret_of(scheme), &id, now(), json!({}));
        let reply = app.post(scheme.as_str(), d.headers, &d.body).await;
        assert_eq!(
            (reply.status, reply.outcome()),
            (StatusCode::OK, "accepted"),
            "{scheme}: {:?}",
            reply.json
        );
        let row = event(&app.pool, TENANT, &id)
            .await
            .unwrap_or_else(|| panic!("{scheme}: no row"));
        assert_eq!(row.source_id, scheme.as_str());
    }
    let types: Vec<String> = events(&app.pool)
        .await
        .into_iter()
        .map(|r| r.event_type)
        .collect();
    assert_eq!(types.len(), 5);
    assert!(
        types.contains(&"issues".to_owned())
            && types.contains(&"orders/updated".to_owned())
            && types.contains(&"message".to_owned())
    );
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_redelivery_with_the_same_digest_is_a_duplicate(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let d = stripe("evt_dup", json!({}));
    assert_eq!(
        app.post("stripe", d.headers.clone(), &d.body)
            .await
            .outcome(),
        "accepted"
    );
    let first = event(&app.pool, TENANT, "evt_dup").await.unwrap();

    let reply = app.post("stripe", d.headers.clone(), &d.body).await;

    assert_eq!(
        (reply.status, reply.json.clone()),
        (StatusCode::OK, json!({"status": "duplicate"}))
    );
    let rows = events(&app.pool).await;
    assert_eq!(rows.len(), 1);
    let row = &rows[0];
    assert_eq!(
        (row.delivery_count, row.last_delivery_outcome.as_str()),
        (2, "duplicate")
    );
    assert!(row.last_seen_at >= first.last_seen_at);
    assert_eq!(row.first_received_at, first.first_received_at);
    assert!(
        anomalies(&app.pool).await.is_empty(),
        "a duplicate is not an anomaly"
    );
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_changed_payload_under_a_pending_id_is_a_conflict_and_takes_the_newer_payload(
    pool: PgPool,
) {
    let app = TestApp::spawn(pool).await;
    let first = stripe("evt_conflict", json!({"amount": 100}));
    app.post("stripe", first.headers.clone(), &first.body).await;
    let second = stripe("evt_conflict", json!({"amount": 999}));

    let reply = app
        .post("stripe", second.headers.clone(), &second.body)
        .await;

    assert_eq!(
        (reply.status, reply.json.clone()),
        (StatusCode::OK, json!({"status": "conflict"}))
    );
    let row = event(&app.pool, TENANT, "evt_conflict").await.unwrap();
    assert_eq!(row.payload.as_deref(), Some(&second.body[..]));
    assert_eq!((row.delivery_count, row.conflict_count), (2, 1));
    assert_eq!(row.superseded_sha256, Some(sha256(&first.body)));
    let found = anomalies(&app.pool).await;
    assert_eq!(found.len(), 1);
    let a = &found[0];
    assert_eq!(
        (
            a.kind.as_str(),
            a.tenant_id.as_str(),
            a.external_id.as_deref()
        ),
        ("digest_conflict", TENANT, Some("evt_conflict"))
    );
    assert_eq!(a.payload_sha256, sha256(&second.body));
    assert_eq!(a.superseded_sha256, Some(sha256(&first.body)));
    assert_eq!(a.payload_replaced, Some(true));
    assert_eq!(
        a.payload, None,
        "the delivered payload is in webhook_events"
    );
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_changed_payload_never_rewrites_a_processed_row(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let first = stripe("evt_done", json!({"amount": 100}));
    app.post("stripe", first.headers.clone(), &first.body).await;
    sqlx::query("UPDATE webhook_events SET status = 'processed', processed_at = now()")
        .execute(&app.pool)
        .await
        .unwrap();
    let second = stripe("evt_done", json!({"amount": 5}));

    let reply = app
        .post("stripe", second.headers.clone(), &second.body)
        .await;

    assert_eq!(reply.outcome(), "conflict");
    let row = event(&app.pool, TENANT, "evt_done").await.unwrap();
    assert_eq!(
        row.payload.as_deref(),
        Some(&first.body[..]),
        "processed payload kept"
    );
    assert_eq!(row.payload_sha256, sha256(&first.body));
    assert_eq!((row.status.as_str(), row.delivery_count), ("processed", 2));
    let found = anomalies(&app.pool).await;
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].payload_replaced, Some(false));
    assert_eq!(
        found[0].payload.as_deref(),
        Some(&second.body[..]),
        "the rejected bytes are kept for forensics"
    );
    assert_eq!(found[0].stored_sha256, Some(sha256(&first.body)));
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_conflicting_older_entity_version_does_not_replace_a_newer_one(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let secret = secret_of(Scheme::Shopify);
    let newer = delivery(
        Scheme::Shopify,
        &secret,
        "wh_1",
        now(),
        json!({"updated_at": "2026-11-30T10:05:00Z"}),
    );
    let older = delivery(
        Scheme::Shopify,
        &secret,
        "wh_1",
        now(),
        json!({"updated_at": "2026-11-30T10:00:00Z"}),
    );
    app.post("shopify", newer.headers.clone(), &newer.body)
        .await;

    assert_eq!(
        app.post("shopify", older.headers.clone(), &older.body)
            .await
            .outcome(),
        "conflict"
    );

    let row = event(&app.pool, TENANT, "wh_1").await.unwrap();
    assert_eq!(row.payload.as_deref(), Some(&newer.body[..]));
    assert_eq!(anomalies(&app.pool).await[0].payload_replaced, Some(false));
}

async fn assert_nothing_stored(pool: &PgPool) {
    assert!(
        events(pool).await.is_empty(),
        "webhook_events must be empty"
    );
    assert!(
        anomalies(pool).await.is_empty(),
        "ingest_anomalies must be empty"
    );
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_forged_signature_is_401_and_stores_nothing(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    for scheme in SCHEMES {
        let forged = delivery(
            scheme,
            &secret_of(Scheme::StandardWebhooks).replace("dGVz", "Zm9y"),
            "evt_forged",
            now(),
            json!({}),
        );
        let reply = app
            .post(scheme.as_str(), forged.headers, &forged.body)
            .await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{scheme}");
        assert_eq!(reply.json, json!({"error": "invalid signature"}));
    }
    // A valid signature over other bytes: the body was tampered with in transit.
    let d = stripe("evt_tampered", json!({"amount": 1}));
    let tampered = String::from_utf8(d.body.clone())
        .unwrap()
        .replace("\"amount\":1", "\"amount\":9");
    assert_eq!(
        app.post("stripe", d.headers, tampered.as_bytes())
            .await
            .status,
        StatusCode::UNAUTHORIZED
    );
    assert_nothing_stored(&app.pool).await;
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn missing_and_malformed_signature_headers_are_401(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let d = stripe("evt_headers", json!({}));
    let mut missing = d.headers.clone();
    missing.remove("stripe-signature");
    assert_eq!(
        app.post("stripe", missing, &d.body).await.status,
        StatusCode::UNAUTHORIZED
    );
    for bad in [
        "",
        "t=",
        "v1=zz",
        "t=1,v1=",
        "\u{00e9}t=1",
        "t=99999999999999999999,v1=00",
    ] {
        let mut headers = d.headers.clone();
        headers.insert(
            "stripe-signature",
            HeaderValue::from_bytes(bad.as_bytes()).unwrap(),
        );
        assert_eq!(
            app.post("stripe", headers, &d.body).await.status,
            StatusCode::UNAUTHORIZED,
            "{bad:?}"
        );
    }
    assert_nothing_stored(&app.pool).await;
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn stale_and_future_timestamps_are_401(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    for scheme in [Scheme::Stripe, Scheme::StandardWebhooks, Scheme::Slack] {
        for at in [now() - 301 - 5, now() + 301 + 5] {
            let d = delivery(scheme, &secret_of(scheme), "evt_time", at, json!({}));
            let reply = app.post(scheme.as_str(), d.headers, &d.body).await;
            assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{scheme} at {at}");
        }
        // Inside the window, in both directions: accepted.
        for (n, at) in [now() - 200, now() + 200].into_iter().enumerate() {
            let d = delivery(
                scheme,
                &secret_of(scheme),
                &format!("evt_ok_{scheme}_{n}"),
                at,
                json!({}),
            );
            assert_eq!(
                app.post(scheme.as_str(), d.headers, &d.body).await.status,
                StatusCode::OK,
                "{scheme}"
            );
        }
    }
    let rows = events(&app.pool).await;
    assert_eq!(rows.len(), 6);
    assert!(rows.iter().all(|r| r.external_id.starts_with("evt_ok_")));
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn unknown_disabled_and_malformed_sources_are_404(pool: PgPool) {
    let mut list = sources_for_every_scheme();
    let mut disabled = source("old-stripe", TENANT, STRIPE, "secret/stripe");
    disabled.enabled = false;
    list.push(disabled);
    let app = TestApp::new(pool, &list, secrets_for_every_scheme()).await;
    let d = stripe("evt_404", json!({}));
    for id in ["nope", "old-stripe", "../stripe", ""] {
        let reply = app.post(id, d.headers.clone(), &d.body).await;
        assert_eq!(
            (reply.status, reply.json.clone()),
            (StatusCode::NOT_FOUND, json!({"error": "unknown source"})),
            "{id:?}"
        );
    }
    assert_nothing_stored(&app.pool).await;
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_signed_but_unreadable_body_is_400_and_recorded_never_queued(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let secret = secret_of(STRIPE);
    let not_json = resign(
        STRIPE,
        &secret,
        "",
        now(),
        HeaderMap::new(),
        b"this is not json".to_vec(),
    );
    let no_id = resign(
        STRIPE,
        &secret,
        "",
        now(),
        HeaderMap::new(),
        br#"{"type":"charge.succeeded"}"#.to_vec(),
    );
    let bad_id = resign(
        STRIPE,
        &secret,
        "",
        now(),
        HeaderMap::new(),
        br#"{"id":["a"],"type":"x"}"#.to_vec(),
    );

    let replies = [
        app.post("stripe", not_json.headers, &not_json.body).await,
        app.post("stripe", no_id.headers, &no_id.body).await,
        app.post("stripe", bad_id.headers, &bad_id.body).await,
    ];

    assert!(
        replies.iter().all(|r| r.status == StatusCode::BAD_REQUEST),
        "{replies:?}"
    );
    assert_eq!(replies[1].json, json!({"error": "no event id at json:/id"}));
    assert!(events(&app.pool).await.is_empty(), "never in the queue");
    let found = anomalies(&app.pool).await;
    let kinds: Vec<&str> = found.iter().map(|a| a.kind.as_str()).collect();
    assert_eq!(
        kinds,
        ["unparseable_payload", "missing_field", "invalid_field"]
    );
    assert_eq!(found[0].payload.as_deref(), Some(&b"this is not json"[..]));
    assert_eq!(found[0].payload_sha256, sha256(b"this is not json"));
    assert!(
        found
            .iter()
            .all(|a| a.tenant_id == TENANT && a.source_id == "stripe")
    );
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_body_over_the_limit_is_413_and_stores_nothing(pool: PgPool) {
    let app = TestApp::with_limits(
        pool,
        &sources_for_every_scheme(),
        secrets_for_every_scheme(),
        Duration::from_secs(30),
        2048,
    )
    .await;
    let padding = "x".repeat(3000);
    let big = stripe("evt_big", json!({"padding": padding}));
    let reply = app.post("stripe", big.headers, &big.body).await;
    assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_nothing_stored(&app.pool).await;

    // Exactly at the limit is accepted.
    let base = stripe("evt_fits", json!({"padding": ""})).body.len();
    let fits = stripe("evt_fits", json!({"padding": "x".repeat(2048 - base)}));
    assert_eq!(fits.body.len(), 2048);
    assert_eq!(
        app.post("stripe", fits.headers, &fits.body).await.status,
        StatusCode::OK
    );
}

/// A pool for a port nothing listens on: every acquire fails quickly.
fn unreachable_pool() -> PgPool {
    let options = PgConnectOptions::new()
        .host("127.0.0.1")
        .port(1)
        .username("postgres");
    PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy_with(options)
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_unreachable_database_is_503_never_2xx(pool: PgPool) {
    sources::apply(&pool, &sources_for_every_scheme())
        .await
        .unwrap();
    let d = stripe("evt_503", json!({}));

    // Sources still cached from a live database, but the event store is unreachable.
    let registry = Arc::new(SourceRegistry::new(pool.clone(), Duration::from_secs(60)));
    let dead_store = Ingestor::new(
        unreachable_pool(),
        registry,
        Arc::new(secrets_for_every_scheme()),
        IngestLimits {
            max_body_bytes: MAX_BODY,
        },
    );
    let reply = post_to(&dead_store, "stripe", d.headers.clone(), &d.body).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.headers["retry-after"], "5");

    // Nothing reachable at all, sources included.
    let dead = Ingestor::new(
        unreachable_pool(),
        Arc::new(SourceRegistry::new(
            unreachable_pool(),
            Duration::from_secs(60),
        )),
        Arc::new(secrets_for_every_scheme()),
        IngestLimits {
            max_body_bytes: MAX_BODY,
        },
    );
    assert_eq!(
        post_to(&dead, "stripe", d.headers.clone(), &d.body)
            .await
            .status,
        StatusCode::SERVICE_UNAVAILABLE
    );

    // A signed-but-unreadable delivery cannot be recorded either: 503, not 400.
    let unreadable = resign(
        STRIPE,
        &secret_of(STRIPE),
        "",
        now(),
        HeaderMap::new(),
        b"{}".to_vec(),
    );
    assert_eq!(
        post_to(&dead_store, "stripe", unreadable.headers, &unreadable.body)
            .await
            .status,
        StatusCode::SERVICE_UNAVAILABLE
    );

    assert_nothing_stored(&pool).await;
}

/// The connection a delivery is stored over may have died since it was last used. One idle for
/// [`store::PING_IF_IDLE_FOR`] or longer is pinged and replaced before a delivery sees it; one
/// that died within that time fails the delivery as an unavailable database (503, nothing
/// stored, never a 2xx) and is discarded, so the provider's retry lands.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_dead_pooled_connection_never_turns_into_a_2xx_and_is_replaced(pool: PgPool) {
    sources::apply(&pool, &sources_for_every_scheme())
        .await
        .unwrap();
    let options = (*pool.connect_options())
        .clone()
        .application_name("ingest_under_test");
    let ingestor = Ingestor::new(
        store::lazy_pool(
            options,
            &store::PoolSettings {
                max_connections: 1,
                acquire_timeout: Duration::from_secs(3),
            },
        ),
        Arc::new(SourceRegistry::new(pool.clone(), Duration::from_secs(60))),
        Arc::new(secrets_for_every_scheme()),
        IngestLimits {
            max_body_bytes: MAX_BODY,
        },
    );
    // Kills the pooled connection once it is back in the pool, and waits until it is gone.
    let kill = || async {
        while ingestor.pool().num_idle() < 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let killed: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = 'ingest_under_test') AS k",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(killed, 1);
        loop {
            let alive: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'ingest_under_test'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            if alive == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let send = |id: &'static str| {
        let d = stripe(id, json!({}));
        let ingestor = &ingestor;
        async move { post_to(ingestor, "stripe", d.headers, &d.body).await }
    };
    assert_eq!(send("evt_first").await.outcome(), "accepted");

    // Killed the moment after its use: the next delivery over it fails, retryably.
    kill().await;
    let reply = send("evt_over_a_dead_connection").await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        event(&pool, TENANT, "evt_over_a_dead_connection")
            .await
            .is_none()
    );
    // The dead connection was discarded: the retry lands over a new one.
    assert_eq!(
        send("evt_over_a_dead_connection").await.outcome(),
        "accepted"
    );

    // Killed, then idle past the threshold: pinged, replaced, and the delivery lands.
    kill().await;
    tokio::time::sleep(store::PING_IF_IDLE_FOR + Duration::from_millis(200)).await;
    assert_eq!(send("evt_after_idle").await.outcome(), "accepted");
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_previous_secret_verifies_during_a_rotation_and_is_recorded(pool: PgPool) {
    let secrets = SecretStore::memory([(
        "secret/stripe".to_owned(),
        SecretSet::new("whsec_new", Some("whsec_old".into())),
    )]);
    let app = TestApp::new(
        pool,
        &[source("stripe", TENANT, STRIPE, "secret/stripe")],
        secrets,
    )
    .await;
    let old = delivery(STRIPE, "whsec_old", "evt_old", now(), json!({}));
    let new = delivery(STRIPE, "whsec_new", "evt_new", now(), json!({}));
    let other = delivery(STRIPE, "whsec_other", "evt_other", now(), json!({}));

    assert_eq!(
        app.post("stripe", old.headers, &old.body).await.status,
        StatusCode::OK
    );
    assert_eq!(
        app.post("stripe", new.headers, &new.body).await.status,
        StatusCode::OK
    );
    assert_eq!(
        app.post("stripe", other.headers, &other.body).await.status,
        StatusCode::UNAUTHORIZED
    );

    assert_eq!(
        event(&app.pool, TENANT, "evt_old")
            .await
            .unwrap()
            .verified_with,
        "previous"
    );
    assert_eq!(
        event(&app.pool, TENANT, "evt_new")
            .await
            .unwrap()
            .verified_with,
        "current"
    );
    assert!(event(&app.pool, TENANT, "evt_other").await.is_none());
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_same_event_id_under_two_tenants_is_two_events(pool: PgPool) {
    let list = [
        source("acme-stripe", "acme", STRIPE, "secret/stripe"),
        source("globex-stripe", "globex", STRIPE, "secret/stripe"),
    ];
    let app = TestApp::new(pool, &list, secrets_for_every_scheme()).await;
    let d = stripe("evt_shared", json!({}));
    assert_eq!(
        app.post("acme-stripe", d.headers.clone(), &d.body)
            .await
            .outcome(),
        "accepted"
    );
    assert_eq!(
        app.post("globex-stripe", d.headers.clone(), &d.body)
            .await
            .outcome(),
        "accepted"
    );
    let tenants: Vec<String> = events(&app.pool)
        .await
        .into_iter()
        .map(|r| r.tenant_id)
        .collect();
    assert_eq!(tenants, ["acme", "globex"]);
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_source_added_at_runtime_is_served_without_a_restart(pool: PgPool) {
    let app = TestApp::with_limits(
        pool,
        &[],
        secrets_for_every_scheme(),
        Duration::from_millis(200),
        MAX_BODY,
    )
    .await;
    let d = stripe("evt_late_source", json!({}));
    assert_eq!(
        app.post("stripe", d.headers.clone(), &d.body).await.status,
        StatusCode::NOT_FOUND
    );

    sources::apply(
        &app.pool,
        &[source("stripe", TENANT, STRIPE, "secret/stripe")],
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;

    assert_eq!(
        app.post("stripe", d.headers.clone(), &d.body)
            .await
            .outcome(),
        "accepted"
    );
    // And disabling it takes effect the same way.
    let mut disabled = source("stripe", TENANT, STRIPE, "secret/stripe");
    disabled.enabled = false;
    sources::apply(&app.pool, &[disabled]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        app.post("stripe", d.headers, &d.body).await.status,
        StatusCode::NOT_FOUND
    );
}

/// API Gateway hands the function the route's `{source_id}` percent-decoded: a NUL byte, a
/// space, a slash or any byte no source id has is an unknown source (404), never a database
/// error (5xx, which the canary would count against the deployment) nor a panic.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_source_id_no_source_can_have_is_404(pool: PgPool) {
    use lambda_http::RequestExt;
    let app = TestApp::spawn(pool).await;
    let d = stripe("evt_nul", json!({}));
    for source_id in [
        "stripe\0",
        "\0",
        "str\0ipe",
        "a b",
        "a/b",
        "strïpe",
        "stripe\u{0}x",
    ] {
        let mut request = http::Request::builder()
            .method("POST")
            .uri("https://example.execute-api.us-east-1.amazonaws.com/webhooks/x")
            .body(lambda_http::Body::Binary(d.body.clone()))
            .unwrap();
        *request.headers_mut() = d.headers.clone();
        let request = request.with_path_parameters(std::collections::HashMap::from([(
            "source_id".to_owned(),
            source_id.to_owned(),
        )]));
        let response = ingest::handler(request, &app.ingestor).await.unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND, "{source_id:?}");
    }
    assert_nothing_stored(&app.pool).await;
}

/// A GitHub webhook is created with content type `application/x-www-form-urlencoded` unless its
/// owner changes it: the body is `payload=<the JSON, URL-encoded>`, and the signature covers
/// those raw form bytes. The event is read from the `payload` field and stored as that JSON:
/// `accepted`, its type and entity read, drained like its JSON twin (the same JSON delivered
/// as JSON under the same id is a duplicate, not a conflict).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_github_form_delivery_is_read_from_its_payload_field(pool: PgPool) {
    let mut github = source("github", TENANT, Scheme::Github, "secret/github");
    github.fields.entity_id = Some(shared::domain::FieldLocator::json("/repository/full_name"));
    let app = TestApp::new(pool.clone(), &[github], secrets_for_every_scheme()).await;
    let json = br#"{"action":"opened","issue":{"number":7},"repository":{"full_name":"acme/api"}}"#;
    let form: Vec<u8> = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("payload", std::str::from_utf8(json).unwrap())
        .finish()
        .into_bytes();
    let signed = |body: &[u8], content_type: &'static str| {
        let mut headers: HeaderMap = shared::signature::sign(
            Scheme::Github,
            &shared::secrets::SigningSecret::new(secret_of(Scheme::Github)),
            "",
            now(),
            body,
        )
        .unwrap()
        .into_iter()
        .collect();
        headers.insert("x-github-delivery", HeaderValue::from_static("d-form-1"));
        headers.insert("x-github-event", HeaderValue::from_static("issues"));
        headers.insert("content-type", HeaderValue::from_static(content_type));
        headers
    };
    let reply = app
        .post(
            "github",
            signed(&form, "application/x-www-form-urlencoded"),
            &form,
        )
        .await;
    assert_eq!(
        (reply.status, reply.outcome()),
        (StatusCode::OK, "accepted"),
        "{:?}",
        reply.json
    );
    let row = event(&pool, TENANT, "d-form-1").await.unwrap();
    assert_eq!(
        (row.event_type.as_str(), row.entity_id.as_deref()),
        ("issues", Some("acme/api"))
    );
    assert_eq!(
        row.payload.as_deref(),
        Some(&json[..]),
        "stored as the JSON"
    );

    // Its JSON twin, as a hook set to application/json sends it.
    let reply = app
        .post("github", signed(json, "application/json"), json)
        .await;
    assert_eq!(reply.outcome(), "duplicate", "{:?}", reply.json);

    let drainer = pipeline_tests::drain::standard_drainer(&pool);
    pipeline_tests::drain::drain_all(&drainer, &pool, Duration::from_secs(10)).await;
    let row = event(&pool, TENANT, "d-form-1").await.unwrap();
    assert_eq!(row.status, "processed");
    assert!(anomalies(&pool).await.is_empty());
}
