//! Providers of the catalogue beyond the five the rest of the suite drives: deliveries as API
//! Gateway hands them to the ingest function (the real HTTP API v2 event shape, bodies
//! base64-encoded), for the schemes that sign the URL they call.

use base64::Engine as _;
use http::StatusCode;
use pipeline_tests::*;
use shared::domain::{FieldLocator, Scheme};
use shared::secrets::{SecretSet, SecretStore, SigningSecret};
use shared::signature::{self, Signing};
use sqlx::PgPool;

const AUTH_TOKEN: &str = "12345";
const HOST: &str = "abc123.execute-api.us-east-1.amazonaws.com";

/// A Twilio status callback: a form post, signed over the URL Twilio called and the sorted
/// parameters (HMAC-SHA1 with the account's auth token).
fn status_callback(url: &str) -> (Vec<(http::HeaderName, http::HeaderValue)>, Vec<u8>) {
    let body = b"AccountSid=AC1&MessageSid=SM1&MessageStatus=delivered&To=%2B15558675310".to_vec();
    let mut headers = signature::sign_request(
        Scheme::Twilio,
        &SigningSecret::new(AUTH_TOKEN),
        &Signing {
            message_id: "",
            timestamp: 0,
            body: &body,
            method: "POST",
            url: Some(url),
        },
    )
    .unwrap();
    headers.push((
        http::HeaderName::from_static("i-twilio-idempotency-token"),
        http::HeaderValue::from_static("idem-1"),
    ));
    (headers, body)
}

/// The event API Gateway (HTTP API, payload format 2.0) sends the ingest function for a POST to
/// `/{stage}/webhooks/{source_id}?{query}` on `HOST`, the body base64-encoded as API Gateway
/// does for form posts.
fn api_gateway_v2_event(
    stage: &str,
    source_id: &str,
    query: &str,
    headers: &[(http::HeaderName, http::HeaderValue)],
    body: &[u8],
) -> lambda_http::Request {
    let mut header_map = serde_json::Map::new();
    header_map.insert("host".into(), HOST.into());
    header_map.insert(
        "content-type".into(),
        "application/x-www-form-urlencoded".into(),
    );
    for (name, value) in headers {
        header_map.insert(name.as_str().into(), value.to_str().unwrap().into());
    }
    let path = format!("/{stage}/webhooks/{source_id}");
    let event = serde_json::json!({
        "version": "2.0",
        "routeKey": "POST /webhooks/{source_id}",
        "rawPath": path,
        "rawQueryString": query,
        "headers": header_map,
        "requestContext": {
            "accountId": "123456789012",
            "apiId": "abc123",
            "domainName": HOST,
            "domainPrefix": "abc123",
            "http": {
                "method": "POST",
                "path": path,
                "protocol": "HTTP/1.1",
                "sourceIp": "54.172.60.0",
                "userAgent": "TwilioProxy/1.1"
            },
            "requestId": "id-1",
            "routeKey": "POST /webhooks/{source_id}",
            "stage": stage,
            "time": "02/Dec/2026:07:00:00 +0000",
            "timeEpoch": 1796194800000_i64
        },
        "pathParameters": { "source_id": source_id },
        "body": base64::engine::general_purpose::STANDARD.encode(body),
        "isBase64Encoded": true
    });
    lambda_http::request::from_str(&event.to_string()).expect("a valid API Gateway v2 event")
}

async fn app_with(pool: PgPool, signed_url: Option<&str>) -> TestApp {
    let mut twilio = source("twilio", TENANT, Scheme::Twilio, "secret/twilio");
    twilio.fields.event_type = FieldLocator::parse("form:MessageStatus").unwrap();
    twilio.signed_url = signed_url.map(str::to_owned);
    TestApp::new(
        pool,
        &[twilio],
        SecretStore::memory([("secret/twilio".to_owned(), SecretSet::new(AUTH_TOKEN, None))]),
    )
    .await
}

async fn status(app: &TestApp, request: lambda_http::Request) -> StatusCode {
    ingest::handler(request, &app.ingestor)
        .await
        .expect("the handler answers every request")
        .status()
}

/// Twilio signs the URL it called: the one reconstructed from the event (host, stage, path and
/// query) verifies, the form body arrives base64-encoded and its fields are read, and the
/// same signature presented for another query is refused.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_twilio_form_post_verifies_against_the_url_api_gateway_received(pool: PgPool) {
    let app = app_with(pool, None).await;
    let url = format!("https://{HOST}/prod/webhooks/twilio?tenant=eu");
    let (headers, body) = status_callback(&url);

    let forged = api_gateway_v2_event("prod", "twilio", "tenant=us", &headers, &body);
    assert_eq!(status(&app, forged).await, StatusCode::UNAUTHORIZED);
    assert!(events(&app.pool).await.is_empty());

    let real = api_gateway_v2_event("prod", "twilio", "tenant=eu", &headers, &body);
    assert_eq!(status(&app, real).await, StatusCode::OK);
    let row = event(&app.pool, TENANT, "idem-1").await.expect("stored");
    assert_eq!(row.event_type, "delivered");
    assert_eq!(row.payload.as_deref(), Some(&body[..]));
}

/// Behind a custom domain the provider signs a URL the request does not arrive at: the
/// source's configured `url` is what verifies, and without it the delivery is refused.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_source_url_stands_in_for_a_custom_domain(pool: PgPool) {
    let configured = "https://hooks.example.com/twilio";
    let (headers, body) = status_callback(configured);

    let without = app_with(pool.clone(), None).await;
    let request = api_gateway_v2_event("prod", "twilio", "", &headers, &body);
    assert_eq!(status(&without, request).await, StatusCode::UNAUTHORIZED);

    let with = app_with(pool, Some(configured)).await;
    let request = api_gateway_v2_event("prod", "twilio", "", &headers, &body);
    assert_eq!(status(&with, request).await, StatusCode::OK);
    assert!(event(&with.pool, TENANT, "idem-1").await.is_some());
}

/// A request as API Gateway hands it over, through the ingest function: status, content type,
/// body.
async fn send(
    app: &TestApp,
    method: &str,
    source_id: &str,
    headers: http::HeaderMap,
    body: &[u8],
) -> (StatusCode, Option<String>, String) {
    use lambda_http::RequestExt as _;
    let mut request = http::Request::builder()
        .method(method)
        .uri(format!("https://{HOST}/webhooks/{source_id}"))
        .body(lambda_http::Body::Binary(body.to_vec()))
        .unwrap();
    *request.headers_mut() = headers;
    let request = request.with_path_parameters(std::collections::HashMap::from([(
        "source_id".to_owned(),
        source_id.to_owned(),
    )]));
    let response = ingest::handler(request, &app.ingestor).await.unwrap();
    let (parts, body) = response.into_parts();
    (
        parts.status,
        parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned()),
        String::from_utf8(body.to_vec()).unwrap(),
    )
}

fn signed(scheme: Scheme, secret: &str, id: &str, body: &[u8]) -> http::HeaderMap {
    signature::sign(scheme, &SigningSecret::new(secret), id, now(), body)
        .unwrap()
        .into_iter()
        .collect()
}

/// The endpoint checks of Zoom, Twitch and Okta (a GET) are answered as each provider requires
/// and store nothing; the same sources' events are stored; a GET that is not a handshake is a
/// 405, and one that is not signed a 401.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn handshakes_are_answered_and_never_stored(pool: PgPool) {
    let sources = [
        source("zoom", TENANT, Scheme::Zoom, "secret/zoom"),
        source("twitch", TENANT, Scheme::Twitch, "secret/twitch"),
        source("okta", TENANT, Scheme::Okta, "secret/okta"),
    ];
    let secrets = SecretStore::memory([
        (
            "secret/zoom".to_owned(),
            SecretSet::new("zoom-catalogue-secret-token", None),
        ),
        (
            "secret/twitch".to_owned(),
            SecretSet::new("twitch-secret", None),
        ),
        ("secret/okta".to_owned(), SecretSet::new("okta-token", None)),
    ]);
    let app = TestApp::new(pool, &sources, secrets).await;

    let body = br#"{"event":"endpoint.url_validation","payload":{"plainToken":"qgg8vlvZRS6UYooatFL8Aw"},"event_ts":1654503849680}"#;
    let headers = signed(Scheme::Zoom, "zoom-catalogue-secret-token", "", body);
    let (status, content_type, reply) = send(&app, "POST", "zoom", headers, body).await;
    assert_eq!(
        (status, content_type.as_deref()),
        (StatusCode::OK, Some("application/json"))
    );
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&reply).unwrap(),
        serde_json::json!({"plainToken": "qgg8vlvZRS6UYooatFL8Aw", "encryptedToken": "c37c6c4c0915b150208dea1135958fe6fe1b53e9231b3717c74d0fc5e17057d1"})
    );

    let body = br#"{"challenge":"pogchamp-kappa-360noscope-vohiyo","subscription":{"id":"f1c2a387","type":"channel.follow"}}"#;
    let mut headers = signed(Scheme::Twitch, "twitch-secret", "msg-challenge", body);
    set(
        &mut headers,
        "twitch-eventsub-message-type",
        "webhook_callback_verification",
    );
    let (status, content_type, reply) = send(&app, "POST", "twitch", headers, body).await;
    assert_eq!(
        (status, content_type.as_deref(), reply.as_str()),
        (
            StatusCode::OK,
            Some("text/plain"),
            "pogchamp-kappa-360noscope-vohiyo"
        )
    );

    let mut headers = http::HeaderMap::new();
    set(&mut headers, "authorization", "okta-token");
    set(
        &mut headers,
        "x-okta-verification-challenge",
        "X1yhHw7OLDbz6Mu2ivr3FQ",
    );
    let (status, _, reply) = send(&app, "GET", "okta", headers.clone(), b"").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&reply).unwrap(),
        serde_json::json!({"verification": "X1yhHw7OLDbz6Mu2ivr3FQ"})
    );
    set(&mut headers, "authorization", "not-the-token");
    let (status, _, _) = send(&app, "GET", "okta", headers, b"").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(
        events(&app.pool).await.is_empty(),
        "a handshake is never an event"
    );

    // The same sources' events are stored; a verified GET that is no handshake is refused.
    let body = br#"{"eventType":"com.okta.event_hook","eventId":"okta-evt-1","data":{"events":[{"uuid":"u1","eventType":"user.session.start"}]}}"#;
    let mut headers = http::HeaderMap::new();
    set(&mut headers, "authorization", "okta-token");
    let (status, _, reply) = send(&app, "POST", "okta", headers.clone(), body).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    let (status, _, _) = send(&app, "GET", "okta", headers, b"").await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    let body =
        br#"{"subscription":{"id":"f1c2a387","type":"channel.follow"},"event":{"user_id":"1337"}}"#;
    let mut headers = signed(Scheme::Twitch, "twitch-secret", "msg-1", body);
    set(&mut headers, "twitch-eventsub-message-type", "notification");
    set(
        &mut headers,
        "twitch-eventsub-subscription-type",
        "channel.follow",
    );
    let (status, _, reply) = send(&app, "POST", "twitch", headers, body).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    let ids: Vec<String> = events(&app.pool)
        .await
        .into_iter()
        .map(|e| e.external_id)
        .collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
    // Okta's event is the element of data.events (its uuid), not the delivery's eventId.
    assert!(
        ids.contains(&"u1".to_owned()) && ids.contains(&"msg-1".to_owned()),
        "{ids:?}"
    );
}

/// A provider not in the catalogue, declared in a sources file: stored, read back through the
/// sources cache, and its deliveries verified with the declared layout (a tampered one refused).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_declared_signature_verifies_deliveries_with_no_rust(pool: PgPool) {
    let dir = std::env::temp_dir().join(format!("declared-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sources.toml");
    std::fs::write(
        &path,
        r#"
[[source]]
id = "acme-billing"
tenant = "acme"
scheme = "declared"
secret_ref = "secret/acme"
[source.signature]
kind = "hmac"
hash = "sha512"
secret = "base64"
header = "x-acme-signature"
encoding = "base64"
items = { separator = ",", pair = "=", signature = "v2", timestamp = "ts" }
signed = ["{timestamp}", ".", "{header:x-acme-delivery}", ".", "{body}"]
timestamp = { item = true, format = "unix_ms", tolerance_seconds = 60 }
signed_headers = ["x-acme-delivery"]
[source.fields]
external_id = "header:x-acme-delivery"
event_type = "json:/kind"
"#,
    )
    .unwrap();
    let declared = shared::sources::read_sources_file(&path).unwrap();
    let spec = declared[0].signature.expect("a declared layout");
    let secret = "c2VjcmV0LWtleS1mb3ItYWNtZQ==";
    let app = TestApp::new(
        pool,
        &declared,
        SecretStore::memory([("secret/acme".to_owned(), SecretSet::new(secret, None))]),
    )
    .await;

    let body = br#"{"kind":"invoice.paid","amount":42}"#;
    let headers: http::HeaderMap = signature::sign_with(
        spec,
        &SigningSecret::new(secret),
        &Signing {
            message_id: "acme-dlv-1",
            timestamp: now(),
            body,
            method: "POST",
            url: None,
        },
    )
    .unwrap()
    .into_iter()
    .collect();
    assert!(
        headers["x-acme-signature"]
            .to_str()
            .unwrap()
            .starts_with("ts=")
    );

    let (status, _, reply) = send(&app, "POST", "acme-billing", headers.clone(), body).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    let row = event(&app.pool, "acme", "acme-dlv-1")
        .await
        .expect("stored");
    assert_eq!(row.event_type, "invoice.paid");

    let tampered = br#"{"kind":"invoice.paid","amount":43}"#;
    let (status, _, _) = send(&app, "POST", "acme-billing", headers, tampered).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(events(&app.pool).await.len(), 1);
    std::fs::remove_dir_all(&dir).ok();
}

/// Mid-rotation (day 60: the secret token was rolled, the old one is still the previous), Zoom
/// may sign its URL validation with either: the answer is keyed with the one that verified, so
/// Zoom's own check of `encryptedToken` passes for both.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_handshake_signed_with_the_previous_secret_is_answered_with_it(pool: PgPool) {
    let sources = [source("zoom", TENANT, Scheme::Zoom, "secret/zoom")];
    let secrets = SecretStore::memory([(
        "secret/zoom".to_owned(),
        SecretSet::new(
            "zoom-rolled-secret",
            Some("zoom-catalogue-secret-token".to_owned()),
        ),
    )]);
    let app = TestApp::new(pool, &sources, secrets).await;
    let body = br#"{"event":"endpoint.url_validation","payload":{"plainToken":"qgg8vlvZRS6UYooatFL8Aw"},"event_ts":1654503849680}"#;
    let headers = signed(Scheme::Zoom, "zoom-catalogue-secret-token", "", body);
    let (status, _, reply) = send(&app, "POST", "zoom", headers, body).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&reply).unwrap()["encryptedToken"],
        "c37c6c4c0915b150208dea1135958fe6fe1b53e9231b3717c74d0fc5e17057d1"
    );
    assert!(events(&app.pool).await.is_empty());
}

/// The sources a sources file with `toml` gives, read as `hookctl sources apply` reads one.
fn sources_file(name: &str, toml: &str) -> Vec<shared::sources::Source> {
    let file = std::env::temp_dir().join(format!("{name}-{}.toml", std::process::id()));
    std::fs::write(&file, toml).unwrap();
    let sources = shared::sources::read_sources_file(&file);
    std::fs::remove_file(&file).ok();
    sources.unwrap()
}

/// An app with one source of `scheme`, under `id`, signing with `secret`.
async fn one_source(pool: PgPool, id: &str, scheme: Scheme, secret: &str) -> TestApp {
    let secret_ref = format!("secret/{id}");
    TestApp::new(
        pool,
        &[source(id, TENANT, scheme, &secret_ref)],
        SecretStore::memory([(secret_ref.clone(), SecretSet::new(secret, None))]),
    )
    .await
}

/// Adyen signs eight values of a notification item, not the body. An event id read from the
/// whole body (its digest) let anyone holding one signed notification post it again with an
/// unsigned field changed (`reason`, `eventDate`) and have it stored as a new event with the
/// same payment, type and amount: a second capture downstream. The id is read from signed
/// values (pspReference, eventCode, success), so such a copy is the same event: a digest
/// conflict, counted and recorded, with no second event and no change to the stored payload.
/// The item is the event (each item its own, its JSON the payload): white space around it is
/// no change at all, a duplicate.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_adyen_notification_changed_outside_its_signature_is_the_same_event(pool: PgPool) {
    let adyen = Scheme::Adyen.provider();
    let vector = &adyen.vectors[0];
    assert!(vector.valid);
    let app = one_source(pool, "adyen", Scheme::Adyen, &vector.secret).await;
    let body = vector.body.clone().unwrap();
    let reply = app
        .post("adyen", http::HeaderMap::new(), body.as_bytes())
        .await;
    assert_eq!(
        (reply.status, reply.outcome()),
        (StatusCode::OK, "accepted"),
        "{:?}",
        reply.json
    );
    let item = serde_json::to_vec(
        &serde_json::from_str::<serde_json::Value>(&body).unwrap()["notificationItems"][0],
    )
    .unwrap();

    for (changed, outcome) in [
        (
            body.replace(r#""reason":"reason""#, r#""reason":"replayed""#),
            "conflict",
        ),
        (
            body.replace("1970-01-01T00:00:00.000Z", "2026-12-03T00:00:00.000Z"),
            "conflict",
        ),
        (body.replace(r#"{"live""#, r#"{ "live""#), "duplicate"),
    ] {
        let reply = app
            .post("adyen", http::HeaderMap::new(), changed.as_bytes())
            .await;
        assert_eq!(
            (reply.status, reply.outcome()),
            (StatusCode::OK, outcome),
            "{changed}: {:?}",
            reply.json
        );
    }
    let stored = events(&app.pool).await;
    assert_eq!(stored.len(), 1, "one notification, one event");
    assert_eq!(
        (
            stored[0].event_type.as_str(),
            stored[0].delivery_count,
            stored[0].conflict_count
        ),
        ("CAPTURE", 4, 2)
    );
    // Nor does such a copy replace the pending event's payload: its changed bytes are outside
    // the signature, so they are recorded beside it, never taken.
    assert_eq!(stored[0].status, "pending");
    assert_eq!(stored[0].payload.as_deref(), Some(item.as_slice()));
    let recorded = anomalies(&app.pool).await;
    assert_eq!(recorded.len(), 2, "{recorded:?}");
    assert!(
        recorded.iter().all(|a| a.kind == "digest_conflict"
            && a.payload_replaced == Some(false)
            && a.payload.is_some()),
        "{recorded:?}"
    );
    // The same item with its signed values changed is another event (re-signed by the key).
    let refund = body.replace(r#""eventCode":"CAPTURE""#, r#""eventCode":"REFUND""#);
    let reply = app
        .post("adyen", http::HeaderMap::new(), refund.as_bytes())
        .await;
    assert_eq!(
        reply.status,
        StatusCode::UNAUTHORIZED,
        "eventCode is signed"
    );
}

/// WooCommerce pings a webhook's URL, unsigned, with `webhook_id=<n>` when the webhook is saved
/// or activated, and shows the admin an error unless the answer is 200. The ping is answered
/// 200 and stores nothing; any other unsigned request is still refused, and an order event
/// (as WooCommerce sends it: signed body, delivery id and topic headers, `date_modified_gmt`
/// without an offset) is stored.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn woocommerces_unsigned_ping_is_answered_and_its_events_are_stored(pool: PgPool) {
    let app = one_source(pool, "woo", Scheme::Woocommerce, "woo-secret").await;
    let mut ping = http::HeaderMap::new();
    set(
        &mut ping,
        "user-agent",
        "WooCommerce/9.4.2 Hookshot (WordPress/6.7)",
    );
    let (status, _, reply) = send(&app, "POST", "woo", ping.clone(), b"webhook_id=17").await;
    assert_eq!((status, reply.as_str()), (StatusCode::OK, ""));
    let (status, _, _) = send(&app, "POST", "woo", ping, br#"{"id":17}"#).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "only the ping goes unsigned"
    );
    assert!(events(&app.pool).await.is_empty());
    assert!(anomalies(&app.pool).await.is_empty());

    let body = br#"{"id":727,"status":"processing","date_modified_gmt":"2026-12-03T10:15:42","total":"29.35"}"#;
    let mut headers = signed(Scheme::Woocommerce, "woo-secret", "", body);
    set(&mut headers, "x-wc-webhook-delivery-id", "d41d8cd98f");
    set(&mut headers, "x-wc-webhook-topic", "order.updated");
    let (status, _, reply) = send(&app, "POST", "woo", headers, body).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    let stored = event(&app.pool, TENANT, "d41d8cd98f").await.unwrap();
    // The version is date_modified_gmt, read as UTC.
    assert_eq!(
        (
            stored.event_type.as_str(),
            stored.entity_id.as_deref(),
            stored.entity_version
        ),
        ("order.updated", Some("727"), Some(1_796_292_942_000_000))
    );
}

/// Asserts that `replayed` was held as a replay of `original`: the original pending and
/// queued, the copy processed with no effect expected, one `replayed_body` anomaly.
async fn assert_held_as_replay(pool: &PgPool, original: &str, replayed: &str) {
    let (rows, queued, replays) = replay_state(pool).await;
    assert_eq!(
        rows,
        vec![
            (original.to_owned(), "pending".to_owned(), None),
            (
                replayed.to_owned(),
                "processed".to_owned(),
                Some("nothing".to_owned())
            ),
        ],
        "the copy is held: processed, never an effect"
    );
    assert_eq!(
        (queued, replays),
        (1, 1),
        "one event queued, the replay recorded"
    );
}

/// What one replay-guard test reads back: the events (id, status, what it expects), how many
/// are queued, and the replay anomalies.
async fn replay_state(pool: &PgPool) -> (Vec<(String, String, Option<String>)>, i64, i64) {
    let rows = sqlx::query_as(
        "SELECT external_id, status, expects FROM webhook_events ORDER BY first_received_at, external_id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM event_queue")
        .fetch_one(pool)
        .await
        .unwrap();
    let replays: i64 =
        sqlx::query_scalar("SELECT count(*) FROM ingest_anomalies WHERE kind = 'replayed_body'")
            .fetch_one(pool)
            .await
            .unwrap();
    (rows, queued, replays)
}

/// Twilio signs the URL and the *decoded, sorted* form fields, and its id is an unsigned header:
/// a captured status callback re-posted with its fields reordered and a trailing `&`, under a
/// fresh idempotency token, is the same signed string. The replay guard claims that string, not
/// the raw bytes: `duplicate`, held as a replay, one event queued.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_reencoded_twilio_form_under_another_token_is_a_replay(pool: PgPool) {
    let url = "https://hooks.example.com/twilio";
    let app = app_with(pool.clone(), Some(url)).await;
    let post = |body: &'static [u8], token: &'static str| {
        let mut headers = http::HeaderMap::new();
        let signed = signature::sign_request(
            Scheme::Twilio,
            &SigningSecret::new(AUTH_TOKEN),
            &Signing {
                message_id: "",
                timestamp: 0,
                body,
                method: "POST",
                url: Some(url),
            },
        )
        .unwrap();
        headers.extend(signed);
        headers.insert("i-twilio-idempotency-token", token.parse().unwrap());
        headers.insert(
            "content-type",
            "application/x-www-form-urlencoded".parse().unwrap(),
        );
        (headers, body)
    };
    let (first, body) = post(b"a=1&b=2&MessageStatus=delivered", "idem-1");
    let reply = app.post("twilio", first.clone(), body).await;
    assert_eq!(reply.outcome(), "accepted", "{:?}", reply.json);

    // The captured signature, over other bytes of the same form.
    let replayed: &[u8] = b"b=2&MessageStatus=delivered&a=1&";
    let mut headers = first.clone();
    headers.insert("i-twilio-idempotency-token", "idem-2".parse().unwrap());
    let reply = app.post("twilio", headers, replayed).await;
    assert_eq!(
        (reply.status, reply.outcome()),
        (StatusCode::OK, "duplicate"),
        "{:?}",
        reply.json
    );
    assert_held_as_replay(&pool, "idem-1", "idem-2").await;

    // A different form under a third token is a new event.
    let (other, body) = post(b"a=1&b=3&MessageStatus=delivered", "idem-3");
    assert_eq!(app.post("twilio", other, body).await.outcome(), "accepted");
}

/// Mailgun signs a timestamp and a token, not the event data, and tells receivers to refuse a
/// token seen before. A captured delivery whose event data (and so its event id) is changed
/// within the timestamp window is refused as a replay of the token: `duplicate`, held, one
/// event queued.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_mailgun_token_seen_before_is_a_replay_whatever_the_event_data(pool: PgPool) {
    const KEY: &str = "key-3ax6xnjp29jd6fds4gc373sgvjxteol0";
    let app = TestApp::new(
        pool.clone(),
        &[source("mailgun", TENANT, Scheme::Mailgun, "secret/mailgun")],
        SecretStore::memory([("secret/mailgun".to_owned(), SecretSet::new(KEY, None))]),
    )
    .await;
    let (at, token) = (now(), "5egbgr1vjgqxtrnp65xfznchgdccwh5d6i09vijqi3whgowmn6");
    let body = |id: &str, event: &str| mailgun_body(KEY, at, token, id, event);
    let mut headers = http::HeaderMap::new();
    headers.insert("content-type", "application/json".parse().unwrap());

    let reply = app
        .post(
            "mailgun",
            headers.clone(),
            &body("Ase7i2zsRYeDXztHGENqRA", "delivered"),
        )
        .await;
    assert_eq!(reply.outcome(), "accepted", "{:?}", reply.json);
    // The same delivery again: its own token, its own id: a duplicate, nothing more.
    let reply = app
        .post(
            "mailgun",
            headers.clone(),
            &body("Ase7i2zsRYeDXztHGENqRA", "delivered"),
        )
        .await;
    assert_eq!(reply.outcome(), "duplicate");
    // The captured token over forged event data.
    let reply = app
        .post("mailgun", headers, &body("forged-event-id", "clicked"))
        .await;
    assert_eq!(
        (reply.status, reply.outcome()),
        (StatusCode::OK, "duplicate"),
        "{:?}",
        reply.json
    );
    assert_held_as_replay(&pool, "Ase7i2zsRYeDXztHGENqRA", "forged-event-id").await;
}

/// A HubSpot request as HubSpot sends it: v3 (HMAC with a timestamp) beside the v1 signature
/// it keeps for compatibility (a plain SHA-256 of secret and body), signed at `at`.
fn hubspot_request(url: &str, body: &[u8], at: i64) -> http::HeaderMap {
    let layouts = &Scheme::Hubspot.provider().signatures;
    let named = |name: &str| {
        layouts
            .iter()
            .find(|l| l.name.as_deref() == Some(name))
            .unwrap()
    };
    let signing = Signing {
        message_id: "",
        timestamp: at,
        body,
        method: "POST",
        url: Some(url),
    };
    let secret = SigningSecret::new(AUTH_TOKEN);
    let mut headers = http::HeaderMap::new();
    for layout in ["v3", "v1"] {
        headers.extend(signature::sign_with(named(layout), &secret, &signing).unwrap());
    }
    headers.insert("content-type", "application/json".parse().unwrap());
    headers
}

/// The sender never picks the weakest signature: a request carrying HubSpot's v3 is verified
/// with v3, and v1 (no timestamp, a plain digest) is accepted only by a source whose `layouts`
/// names it. Captured with a valid v1, its v3 headers removed, an hour later: refused.
#[test]
fn a_request_stripped_of_its_stronger_signature_is_refused() {
    let url = "https://hooks.example.com/hubspot";
    let body = br#"[{"eventId":1,"subscriptionId":2,"portalId":3,"subscriptionType":"contact.creation","attemptNumber":0,"objectId":4}]"#;
    let at = 1_700_000_000;
    let headers = hubspot_request(url, body, at);
    let secrets = SecretSet::new(AUTH_TOKEN, None);
    let verify = |headers: &http::HeaderMap, now: i64, accepted: Option<&[String]>| {
        signature::verify_accepting(
            Scheme::Hubspot,
            accepted,
            &signature::Request {
                headers,
                body,
                method: "POST",
                url: Some(url),
            },
            &secrets,
            std::time::Duration::from_secs(300),
            now,
        )
    };
    let verified = verify(&headers, at + 10, None).expect("as sent: v3 verifies");
    assert!(
        verified.timestamp.is_some(),
        "verified with v3, which signs a timestamp"
    );

    let mut stripped = headers.clone();
    stripped.remove("x-hubspot-signature-v3");
    stripped.remove("x-hubspot-request-timestamp");
    let refused = verify(&stripped, at + 3600, None).unwrap_err();
    assert_eq!(refused.reason_code(), "missing_header", "{refused}");

    // A source that opts in to v1 accepts it alone ...
    let with_v1 = ["v3".to_owned(), "v1".to_owned()];
    verify(&stripped, at + 3600, Some(&with_v1)).expect("v1 accepted when named");
    // ... and still verifies a request that carries v3 with v3: stale an hour later.
    let stale = verify(&headers, at + 3600, Some(&with_v1)).unwrap_err();
    assert_eq!(stale.reason_code(), "stale_timestamp", "{stale}");
}

/// Through ingest: a HubSpot source refuses a v1-only request by default (401) and accepts it
/// when its `layouts` names v1; a sources file naming a layout the provider lacks is refused
/// with the names it has.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_source_pins_the_layouts_it_accepts(pool: PgPool) {
    let url = "https://hooks.example.com/hubspot";
    let mut strict = source("hubspot", TENANT, Scheme::Hubspot, "secret/hubspot");
    strict.signed_url = Some(url.to_owned());
    let mut lenient = strict.clone();
    lenient.source_id = shared::domain::SourceId::parse("hubspot-v1").unwrap();
    lenient.layouts = Some(vec!["v3".into(), "v1".into()]);
    let app = TestApp::new(
        pool,
        &[strict, lenient],
        SecretStore::memory([(
            "secret/hubspot".to_owned(),
            SecretSet::new(AUTH_TOKEN, None),
        )]),
    )
    .await;
    let body = br#"[{"eventId":7,"subscriptionId":2,"portalId":3,"subscriptionType":"contact.creation","attemptNumber":0,"objectId":4}]"#;
    let mut v1_only = hubspot_request(url, body, now());
    v1_only.remove("x-hubspot-signature-v3");
    v1_only.remove("x-hubspot-request-timestamp");
    let refused = app.post("hubspot", v1_only.clone(), body).await;
    assert_eq!(
        refused.status,
        StatusCode::UNAUTHORIZED,
        "{:?}",
        refused.json
    );
    let accepted = app.post("hubspot-v1", v1_only, body).await;
    assert_eq!(accepted.outcome(), "accepted", "{:?}", accepted.json);

    let spec: shared::sources::SourceSpec =
        toml::from_str("id='h'\ntenant='t'\nscheme='hubspot'\nsecret_ref='x'\nlayouts=['v4']\n")
            .unwrap();
    let error = spec.into_source().unwrap_err();
    assert_eq!(
        error,
        "layouts: hubspot has no layout \"v4\" (its named layouts: v3, v1, v2)"
    );
}

/// Discord's Webhook Events have no top-level id (every one was answered 400) and must be
/// acknowledged with 204 and an empty body (a JSON receipt is not what Discord accepts). A
/// signed Webhook Event is stored under its body's digest, its type read from `/event/type`,
/// answered 204; Discord's retry (the same body, a fresh signature timestamp) is the same
/// event. A PING is answered 204 and stores nothing; an interaction, which needs the
/// application's own reply, is not handled: 400, and its endpoint's PING is not answered.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_discord_webhook_event_is_stored_and_answered_204(pool: PgPool) {
    use ring::signature::KeyPair as _;
    use sha2::Digest as _;
    let seed = sha2::Sha256::digest(b"discord catalogue vector");
    let key = ring::signature::Ed25519KeyPair::from_seed_unchecked(&seed).unwrap();
    let public = hex::encode(key.public_key().as_ref());
    let app = one_source(pool.clone(), "discord", Scheme::Discord, &public).await;
    let post = |body: &'static [u8], at: i64| {
        let timestamp = at.to_string();
        let mut signed = timestamp.as_bytes().to_vec();
        signed.extend_from_slice(body);
        let mut headers = http::HeaderMap::new();
        set(
            &mut headers,
            "x-signature-ed25519",
            &hex::encode(key.sign(&signed).as_ref()),
        );
        set(&mut headers, "x-signature-timestamp", &timestamp);
        set(&mut headers, "content-type", "application/json");
        app.post("discord", headers, body)
    };
    let event: &[u8] = br#"{"version":1,"application_id":"1200000000000000000","type":1,"event":{"type":"APPLICATION_AUTHORIZED","timestamp":"2026-12-05T08:00:00.000000","data":{"integration_type":0,"user":{"id":"80351110224678912"}}}}"#;
    let reply = post(event, now()).await;
    assert_eq!(
        (reply.status, &reply.json),
        (StatusCode::NO_CONTENT, &serde_json::Value::Null),
        "an empty 204, as Discord requires"
    );
    let id = hex::encode(sha2::Sha256::digest(event));
    let row = pipeline_tests::event(&pool, TENANT, &id)
        .await
        .expect("stored");
    assert_eq!(row.event_type, "APPLICATION_AUTHORIZED");

    // Discord's retry: the same body, signed again.
    assert_eq!(post(event, now() + 1).await.status, StatusCode::NO_CONTENT);
    let row = pipeline_tests::event(&pool, TENANT, &id).await.unwrap();
    assert_eq!((row.delivery_count, events(&pool).await.len()), (2, 1));

    let ping: &[u8] = br#"{"version":1,"application_id":"1200000000000000000","type":0}"#;
    assert_eq!(post(ping, now()).await.status, StatusCode::NO_CONTENT);
    let command: &[u8] = br#"{"id":"1300000000000000000","type":2,"application_id":"1200000000000000000","data":{"name":"hello"}}"#;
    assert_eq!(post(command, now()).await.status, StatusCode::BAD_REQUEST);
    let interaction_ping: &[u8] = br#"{"id":"1300000000000000001","type":1,"application_id":"1200000000000000000","version":1}"#;
    assert_eq!(
        post(interaction_ping, now()).await.status,
        StatusCode::BAD_REQUEST,
        "an interactions endpoint's PING is not answered"
    );
    assert_eq!(events(&pool).await.len(), 1);
}

/// Intercom counts its attempts inside the signed body (`delivery_attempts`): its retry is other
/// bytes under the same id. The entry names that field volatile, so attempt 2 after attempt 1
/// is a duplicate and the anomaly checks see no integrity breach; the stored bytes are attempt
/// 1's. A changed event under the same id is still a conflict.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_intercom_retry_is_a_duplicate_not_an_integrity_alarm(pool: PgPool) {
    let app = one_source(
        pool.clone(),
        "intercom",
        Scheme::Intercom,
        "intercom-secret",
    )
    .await;
    let notification = |attempts: u32, email: &str| {
        serde_json::to_vec(&serde_json::json!({
            "type": "notification_event", "id": "notif_ccd8a4d0", "topic": "contact.user.created",
            "app_id": "a86dr8yl", "created_at": 1700000000, "first_sent_at": 1700000000,
            "delivery_attempts": attempts,
            "data": {"type": "notification_event_data", "item": {"type": "contact", "email": email}}
        }))
        .unwrap()
    };
    let post = |body: Vec<u8>| {
        let headers = signed(Scheme::Intercom, "intercom-secret", "", &body);
        let app = &app;
        async move { app.post("intercom", headers, &body).await }
    };
    let first = notification(1, "ada@example.com");
    assert_eq!(post(first.clone()).await.outcome(), "accepted");
    assert_eq!(
        post(notification(2, "ada@example.com")).await.outcome(),
        "duplicate"
    );
    let row = pipeline_tests::event(&pool, TENANT, "notif_ccd8a4d0")
        .await
        .unwrap();
    assert_eq!((row.delivery_count, row.conflict_count), (2, 0));
    assert_eq!(row.payload.as_deref(), Some(first.as_slice()));
    let report = shared::anomaly::run_once(&pool, &Default::default(), "test")
        .await
        .unwrap();
    let integrity: Vec<&String> = report
        .breaches
        .iter()
        .filter(|b| b.contains("conflict"))
        .collect();
    assert!(integrity.is_empty(), "{:?}", report.breaches);

    assert_eq!(
        post(notification(3, "eve@example.com")).await.outcome(),
        "conflict"
    );
}

/// Xero sends no event id (the id is the body's digest) and a fresh `entropy` on every request:
/// its retry was a second event. The entry names `entropy` volatile, so the id is the digest of
/// the body without it: the retry is the same event, a duplicate.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_xero_retry_with_new_entropy_is_the_same_event(pool: PgPool) {
    let app = one_source(pool.clone(), "xero", Scheme::Xero, "xero-webhooks-key").await;
    let delivery = |entropy: &str| {
        serde_json::to_vec(&serde_json::json!({
            "events": [{"resourceUrl": "https://api.xero.com/api.xro/2.0/Invoices/r1", "resourceId": "r1",
                        "eventDateUtc": "2026-12-05T08:00:00.000", "eventType": "UPDATE", "eventCategory": "INVOICE",
                        "tenantId": "t1", "tenantType": "ORGANISATION"}],
            "firstEventSequence": 7, "lastEventSequence": 7, "entropy": entropy
        }))
        .unwrap()
    };
    for (entropy, outcome) in [
        ("QNRDIYSFTUQKJBWOPMEP", "accepted"),
        ("ZYXWVUTSRQPONMLKJIHG", "duplicate"),
    ] {
        let body = delivery(entropy);
        let headers = signed(Scheme::Xero, "xero-webhooks-key", "", &body);
        let reply = app.post("xero", headers, &body).await;
        assert_eq!(reply.outcome(), outcome, "{:?}", reply.json);
    }
    assert_eq!(events(&pool).await.len(), 1);
}

/// Xero numbers a webhook subscription's events: a request's `firstEventSequence` is its first
/// element's number, the others following in order. Each element is stored with its own
/// number, and a source with `[source.gaps] strategy = "sequence"` and no provider API (Xero
/// serves no event by its number) has its missing numbers found per element by the backfill
/// pass: never fetched (nothing to fetch from, and "backfill now" says so), closed when the
/// number arrives, or settled by a tombstone, the watermark then passing them.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_xero_sequence_is_numbered_per_element_and_its_gaps_found_without_an_api(pool: PgPool) {
    use shared::backfill::{BackfillSettings, Backfiller};
    use shared::store::gaps;
    let sources = sources_file(
        "xero-gaps",
        &format!(
            "[[source]]\nid = 'xero'\ntenant = '{TENANT}'\nscheme = 'xero'\nsecret_ref = 'secret/xero'\n\
             [source.gaps]\nstrategy = 'sequence'\nid_template = 'xero-seq-{{seq}}'\ngrace_seconds = 0\n"
        ),
    );
    let secrets = || {
        SecretStore::memory([(
            "secret/xero".to_owned(),
            SecretSet::new("xero-webhooks-key", None),
        )])
    };
    let app = TestApp::new(pool.clone(), &sources, secrets()).await;
    let post = |first: i64, resources: &[&str]| {
        let events: Vec<serde_json::Value> = resources
            .iter()
            .map(|r| {
                serde_json::json!({"resourceUrl": format!("https://api.xero.com/api.xro/2.0/Contacts/{r}"),
                    "resourceId": r, "eventDateUtc": "2026-12-06T08:00:00.000", "eventType": "UPDATE",
                    "eventCategory": "CONTACT", "tenantId": "t1", "tenantType": "ORGANISATION"})
            })
            .collect();
        let last = first + resources.len() as i64 - 1;
        let body = serde_json::to_vec(&serde_json::json!({"events": events,
            "firstEventSequence": first, "lastEventSequence": last, "entropy": format!("E{first}")}))
        .unwrap();
        let headers = signed(Scheme::Xero, "xero-webhooks-key", "", &body);
        let app = &app;
        async move { app.post("xero", headers, &body).await }
    };
    let numbered = |pool: PgPool| async move {
        sqlx::query_as::<_, (String, Option<i64>)>(
            "SELECT entity_id, provider_sequence FROM webhook_events WHERE source_id = 'xero' \
             ORDER BY provider_sequence",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    let open = |pool: PgPool| async move {
        sqlx::query_as::<_, (String, Option<i64>)>(
            "SELECT external_id, sequence FROM gap_candidates WHERE source_id = 'xero' \
             AND status = 'open' ORDER BY sequence",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    let backfiller = Backfiller::new(
        pool.clone(),
        std::sync::Arc::new(secrets()),
        BackfillSettings::default(),
    );

    // 5, 6, 7 in one request; 10, 11 in the next: 8 and 9 never came.
    assert_eq!(post(5, &["c5", "c6", "c7"]).await.outcome(), "accepted");
    assert_eq!(post(10, &["c10", "c11"]).await.outcome(), "accepted");
    let stored = numbered(pool.clone()).await;
    let expected: Vec<(String, Option<i64>)> = [5, 6, 7, 10, 11]
        .iter()
        .map(|n| (format!("c{n}"), Some(*n)))
        .collect();
    assert_eq!(stored, expected, "each element its own number, in order");

    // The first pass numbers the missing ones; nothing is fetched and nothing fails.
    let first = backfill_pass(&backfiller).await;
    assert_eq!(
        (first.new_candidates, first.fetched, first.errors),
        (2, 0, 0),
        "{first:?}"
    );
    assert_eq!(
        open(pool.clone()).await,
        vec![
            ("xero-seq-8".to_owned(), Some(8)),
            ("xero-seq-9".to_owned(), Some(9))
        ]
    );
    assert_eq!(
        gaps::request_backfill(&pool, TENANT, "xero", "xero-seq-8")
            .await
            .unwrap(),
        gaps::BackfillAsk::NoProviderApi,
        "nothing to fetch it from"
    );

    // Number 8 comes late (with a redelivered 7 beside it): its gap closes as arrived.
    assert_eq!(post(7, &["c7", "c8"]).await.outcome(), "accepted");
    let second = backfill_pass(&backfiller).await;
    assert_eq!(
        (second.arrived_late, second.new_candidates),
        (1, 0),
        "{second:?}"
    );
    assert_eq!(
        open(pool.clone()).await,
        vec![("xero-seq-9".to_owned(), Some(9))]
    );
    let stored: i64 =
        sqlx::query_scalar("SELECT count(*) FROM webhook_events WHERE source_id = 'xero'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(stored, 6, "7 stored once");

    // Number 9 never comes: an operator tombstones it, and the watermark passes it.
    assert!(
        gaps::tombstone(
            &pool,
            TENANT,
            "xero",
            "xero-seq-9",
            Some(9),
            "re-read contacts from Xero",
            "operator:test"
        )
        .await
        .unwrap()
    );
    backfill_pass(&backfiller).await;
    assert!(open(pool.clone()).await.is_empty());
    assert_eq!(
        gaps::watermark(&pool, "xero")
            .await
            .unwrap()
            .map(|w| w.contiguous_through),
        Some(11)
    );

    // Day 60: the events drained, and retention past the identity horizon takes all six. The
    // numbers it took are not gaps again; the sequence goes on from the watermark, and a number
    // missing after it is found as before.
    let drainer = drain::standard_drainer(&pool);
    drain::drain_all(&drainer, &pool, std::time::Duration::from_secs(10)).await;
    sqlx::query("UPDATE outbox SET status = 'delivered', delivered_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(retention_past_the_horizon(&pool).await, 6);
    let after = backfill_pass(&backfiller).await;
    assert_eq!(after.new_candidates, 0, "{after:?}");
    assert!(open(pool.clone()).await.is_empty());
    assert_eq!(post(12, &["c12"]).await.outcome(), "accepted");
    assert_eq!(post(14, &["c14"]).await.outcome(), "accepted");
    let later = backfill_pass(&backfiller).await;
    assert_eq!(later.new_candidates, 1, "{later:?}");
    assert_eq!(
        open(pool.clone()).await,
        vec![("xero-seq-13".to_owned(), Some(13))]
    );
}

/// Okta's admin names the header an event hook sends its secret in; a source whose hook uses
/// another than `authorization` names it in its sources file, and that header alone admits its
/// deliveries and its verification GET: the catalogue's `authorization` does not, for this
/// source (stored and read back as the source's own layout).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_okta_source_reads_its_secret_from_the_header_its_admin_named(pool: PgPool) {
    let sources = sources_file(
        "okta-named",
        &format!(
            "[[source]]\nid = 'okta-named'\ntenant = '{TENANT}'\nscheme = 'okta'\n\
             secret_ref = 'secret/okta'\nsignature_header = 'X-Okta-Hook-Secret'\n"
        ),
    );
    let secrets =
        SecretStore::memory([("secret/okta".to_owned(), SecretSet::new("okta-token", None))]);
    let app = TestApp::new(pool, &sources, secrets).await;

    let body = br#"{"eventType":"com.okta.event_hook","eventId":"okta-evt-named","data":{"events":[{"uuid":"u1","eventType":"user.session.start"}]}}"#;
    let mut usual = http::HeaderMap::new();
    set(&mut usual, "authorization", "okta-token");
    let (status, _, _) = send(&app, "POST", "okta-named", usual, body).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "the usual header admits it"
    );

    let mut named = http::HeaderMap::new();
    set(&mut named, "x-okta-hook-secret", "okta-token");
    let (status, _, reply) = send(&app, "POST", "okta-named", named.clone(), body).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    let mut wrong = http::HeaderMap::new();
    set(&mut wrong, "x-okta-hook-secret", "not-the-token");
    let (status, _, _) = send(&app, "POST", "okta-named", wrong, body).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    set(
        &mut named,
        "x-okta-verification-challenge",
        "X1yhHw7OLDbz6Mu2ivr3FQ",
    );
    let (status, _, reply) = send(&app, "GET", "okta-named", named, b"").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&reply).unwrap(),
        serde_json::json!({"verification": "X1yhHw7OLDbz6Mu2ivr3FQ"})
    );
    let stored: Vec<String> = events(&app.pool)
        .await
        .into_iter()
        .map(|e| e.external_id)
        .collect();
    // The element of data.events, under its uuid.
    assert_eq!(stored, ["u1"]);
}

/// Twitch's `revocation` says the subscription was revoked; it is no event of the broadcaster.
/// Signed like any message, it is answered 204 (Twitch wants a 2xx), no event is stored, and it
/// is kept for the operator with what it is about and why, where the day's check counts it. A
/// forged one is refused like any delivery.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_twitch_revocation_is_kept_as_a_notice_not_stored_as_an_event(pool: PgPool) {
    let sources = [source("twitch", TENANT, Scheme::Twitch, "secret/twitch")];
    let secrets = SecretStore::memory([(
        "secret/twitch".to_owned(),
        SecretSet::new("twitch-secret", None),
    )]);
    let app = TestApp::new(pool, &sources, secrets).await;
    let body = br#"{"subscription":{"id":"f1c2a387-161a-49f9-a165-0f21d7a4e1c4","status":"authorization_revoked","type":"channel.follow","version":"2","cost":1,"condition":{"broadcaster_user_id":"12826"},"transport":{"method":"webhook","callback":"https://example.com/webhooks/callback"},"created_at":"2019-11-16T10:11:12.634234626Z"}}"#;
    let revoked = |secret: &str| {
        let mut headers = signed(Scheme::Twitch, secret, "msg-revoked", body);
        set(&mut headers, "twitch-eventsub-message-type", "revocation");
        set(
            &mut headers,
            "twitch-eventsub-subscription-type",
            "channel.follow",
        );
        headers
    };

    let (status, _, _) = send(&app, "POST", "twitch", revoked("not-the-secret"), body).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, reply) = send(&app, "POST", "twitch", revoked("twitch-secret"), body).await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{reply}");

    assert!(
        events(&app.pool).await.is_empty(),
        "a revocation is no event"
    );
    type Kept = (String, Option<String>, Option<String>, Vec<u8>);
    let kept: Vec<Kept> = sqlx::query_as(
        "SELECT kind, subject, detail, payload FROM provider_notices WHERE source_id = 'twitch'",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        kept,
        [(
            "revocation".to_owned(),
            Some("channel.follow".to_owned()),
            Some("authorization_revoked".to_owned()),
            body.to_vec()
        )]
    );
    let check = shared::store::anomaly::GLOBAL_CHECKS
        .iter()
        .find(|c| c.name == "provider_notices_last_day")
        .expect("the check exists");
    let value: f64 = sqlx::query_scalar(check.sql)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert!(value > check.high.unwrap_or(f64::MAX), "{value}: breaches");
}

/// Day 60: a provider that keeps sending notices (a callback revoked again and again) never
/// grows the table past the newest `KEPT_PER_SOURCE` of each source; another source's are left.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn provider_notices_keep_the_newest_hundred_of_each_source(pool: PgPool) {
    use shared::store::provider_notices::{KEPT_PER_SOURCE, NewNotice, record};
    let notice = |source_id: &'static str| NewNotice {
        tenant_id: TENANT,
        source_id,
        kind: "revocation",
        subject: Some("channel.follow"),
        detail: Some("notification_failures_exceeded"),
        payload: b"{}",
    };
    record(&pool, &notice("other")).await.unwrap();
    let mut last = 0;
    for _ in 0..KEPT_PER_SOURCE + 5 {
        last = record(&pool, &notice("twitch")).await.unwrap();
    }
    let (kept, newest, others): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE source_id = 'twitch'), \
                max(notice_id) FILTER (WHERE source_id = 'twitch'), \
                count(*) FILTER (WHERE source_id = 'other') FROM provider_notices",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((kept, newest, others), (KEPT_PER_SOURCE, last, 1));
}

/// A shared token (Okta's event hooks send it in `Authorization`, or the header the admin
/// named) is the secret itself: it is checked and never kept, neither in an event's headers
/// nor in a batch's kept request.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_shared_token_is_checked_and_never_stored(pool: PgPool) {
    let app = one_source(pool, "okta", Scheme::Okta, "okta-shared-token-value").await;
    let body = br#"{"eventType":"com.okta.event_hook","eventId":"okta-evt-2","data":{"events":[{"uuid":"u7","eventType":"user.session.start"},{"uuid":"u8","eventType":"user.session.end"}]}}"#;
    let mut headers = http::HeaderMap::new();
    set(&mut headers, "authorization", "okta-shared-token-value");
    set(&mut headers, "content-type", "application/json");
    let (status, _, reply) = send(&app, "POST", "okta", headers, body).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    let stored = events(&app.pool).await;
    assert_eq!(stored.len(), 2);
    for event in &stored {
        assert!(
            !event
                .headers
                .to_string()
                .contains("okta-shared-token-value"),
            "{}",
            event.headers
        );
        assert_eq!(event.headers["content-type"], "application/json");
    }
    let kept: Vec<serde_json::Value> = sqlx::query_scalar("SELECT headers FROM batch_requests")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(kept.len(), 1);
    assert!(
        !kept[0].to_string().contains("okta-shared-token-value"),
        "{}",
        kept[0]
    );
}

/// A token sent inside the body (Figma's `passcode`) is checked like a token header and kept
/// nowhere: the stored payload is the event without it; a wrong passcode is refused.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_token_inside_the_body_is_checked_and_never_stored(pool: PgPool) {
    let passcode = "figma-passcode-31d7";
    let app = one_source(pool, "figma", Scheme::Figma, passcode).await;
    let event = |passcode: &str| {
        serde_json::to_vec(&serde_json::json!({
            "event_type": "FILE_UPDATE", "passcode": passcode, "file_key": "k1",
            "file_name": "Design", "timestamp": "2026-12-05T10:00:00Z", "webhook_id": "42",
        }))
        .unwrap()
    };
    let mut headers = http::HeaderMap::new();
    set(&mut headers, "content-type", "application/json");
    let (status, _, reply) = send(
        &app,
        "POST",
        "figma",
        headers.clone(),
        &event("figma-passcode-31d8"),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{reply}");
    let (status, _, reply) = send(&app, "POST", "figma", headers, &event(passcode)).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    let stored = events(&app.pool).await;
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].event_type, "FILE_UPDATE");
    assert_eq!(stored[0].entity_id.as_deref(), Some("k1"));
    let payload: serde_json::Value =
        serde_json::from_slice(stored[0].payload.as_deref().unwrap()).unwrap();
    assert_eq!(
        payload,
        serde_json::json!({"event_type": "FILE_UPDATE", "file_key": "k1", "file_name": "Design",
                           "timestamp": "2026-12-05T10:00:00Z", "webhook_id": "42"})
    );
}
