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
