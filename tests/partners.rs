//! Partners that do not sign (`auth = "partner"`), through the ingest Lambda's handler with the
//! request context API Gateway's HTTP API gives behind the partner domain's mutual TLS:
//! `http.sourceIp` and `authentication.clientCert` (its PEM and `validity.notAfter`). The local
//! runner's TLS listener is driven end to end in cli/tests/partners.rs.

use std::collections::HashMap;
use std::time::Duration;

use base64::Engine as _;
use http::HeaderMap;
use lambda_http::RequestExt;
use lambda_http::aws_lambda_events::apigw::{
    ApiGatewayV2httpRequestContext, ApiGatewayV2httpRequestContextAuthentication,
    ApiGatewayV2httpRequestContextAuthenticationClientCert,
};
use pipeline_tests::*;
use sha2::Digest as _;
use shared::secrets::{SecretSet, SecretStore};
use sqlx::PgPool;

/// A certificate's bytes as API Gateway passes them, PEM; ingest pins the SHA-256 of the DER.
fn pem(der: &[u8]) -> String {
    format!(
        "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
        base64::engine::general_purpose::STANDARD.encode(der)
    )
}

fn pin(der: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(der))
}

fn partner_source(pins: &[&[u8]], secret_ref: &str, extra: &str) -> shared::sources::Source {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sources.toml");
    let pins: Vec<String> = pins.iter().map(|p| format!("\"{}\"", pin(p))).collect();
    std::fs::write(
        &file,
        format!(
            "[[source]]\nid = \"globex\"\ntenant = \"acme\"\nauth = \"partner\"\n{secret_ref}\
             [source.partner]\nclient_certificates = [{}]\n\
             cidrs = [\"203.0.113.0/24\", \"2001:db8::/32\"]\n{extra}\
             [source.fields]\nevent_type = \"json:/type\"\n",
            pins.join(", ")
        ),
    )
    .unwrap();
    shared::sources::read_sources_file(&file).unwrap().remove(0)
}

/// A POST to `/partners/globex` from `ip` with `certificate` (DER) and its `notAfter` as API
/// Gateway writes it.
async fn post(
    app: &TestApp,
    certificate: Option<&[u8]>,
    ip: Option<&str>,
    headers: HeaderMap,
    body: &[u8],
) -> Reply {
    let mut request = http::Request::builder()
        .method("POST")
        .uri("https://partners.acme.example/partners/globex")
        .body(lambda_http::Body::Binary(body.to_vec()))
        .unwrap();
    *request.headers_mut() = headers;
    let mut context = ApiGatewayV2httpRequestContext::default();
    context.http.method = http::Method::POST;
    context.http.source_ip = ip.map(str::to_owned);
    context.authentication = certificate.map(|der| {
        let mut cert = ApiGatewayV2httpRequestContextAuthenticationClientCert::default();
        cert.client_cert_pem = Some(pem(der));
        cert.subject_dn = Some("CN=globex".into());
        cert.validity.not_after = Some("Aug  5 00:28:21 2120 GMT".into());
        let mut authentication = ApiGatewayV2httpRequestContextAuthentication::default();
        authentication.client_cert = Some(cert);
        authentication
    });
    let request = request
        .with_path_parameters(HashMap::from([(
            "source_id".to_owned(),
            "globex".to_owned(),
        )]))
        .with_request_context(lambda_http::request::RequestContext::ApiGatewayV2(context));
    let response = ingest::handler(request, &app.ingestor).await.unwrap();
    let (parts, body) = response.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        json: serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
    }
}

async fn stored(pool: &PgPool) -> Vec<(String, i32)> {
    sqlx::query_as("SELECT external_id, delivery_count FROM webhook_events ORDER BY external_id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// The pinned certificate from an allowed address (IPv4 or IPv6) is stored, its id the body's
/// digest when the partner names no id header (the same bytes twice are one event), and its
/// certificate recorded with the expiry API Gateway passed. Without an address, from outside
/// the CIDRs (X-Forwarded-For does not count), without a certificate, or with one not pinned,
/// nothing is stored; a certificate un-pinned by `sources apply` is refused on the next request.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_partner_is_admitted_by_its_pinned_certificate_and_addresses_only(pool: PgPool) {
    let source = partner_source(&[b"cert-globex", b"cert-globex-next"], "", "");
    let app = TestApp::with_limits(
        pool.clone(),
        std::slice::from_ref(&source),
        SecretStore::memory([("unused".to_owned(), SecretSet::new("unused", None))]),
        Duration::ZERO,
        MAX_BODY,
    )
    .await;
    let body = br#"{"type":"shipment.sent","id":"sh_1"}"#;
    let json = || {
        let mut h = HeaderMap::new();
        h.insert("content-type", "application/json".parse().unwrap());
        h
    };

    let reply = post(
        &app,
        Some(b"cert-globex"),
        Some("203.0.113.7"),
        json(),
        body,
    )
    .await;
    assert_eq!(reply.status, 200, "{:?}", reply.json);
    let again = post(
        &app,
        Some(b"cert-globex-next"),
        Some("2001:db8::9"),
        json(),
        body,
    )
    .await;
    assert_eq!(again.json, serde_json::json!({"status": "duplicate"}));
    let digest = hex::encode(sha2::Sha256::digest(body));
    assert_eq!(stored(&pool).await, [(digest, 2)]);
    let (not_after, subject): (chrono::DateTime<chrono::Utc>, String) =
        sqlx::query_as("SELECT not_after, subject FROM partner_certificates WHERE sha256 = $1")
            .bind(sha2::Sha256::digest(b"cert-globex").to_vec())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (not_after.to_rfc3339().as_str(), subject.as_str()),
        ("2120-08-05T00:28:21+00:00", "CN=globex")
    );

    let other = br#"{"type":"shipment.sent","id":"sh_2"}"#;
    let mut forwarded = json();
    forwarded.insert("x-forwarded-for", "203.0.113.7".parse().unwrap());
    for (certificate, ip, headers, status, reason) in [
        (
            Some(&b"cert-globex"[..]),
            None,
            json(),
            403,
            "address_not_allowed",
        ),
        (
            Some(&b"cert-globex"[..]),
            Some("198.51.100.7"),
            forwarded,
            403,
            "address_not_allowed",
        ),
        (
            None,
            Some("203.0.113.7"),
            json(),
            401,
            "no_client_certificate",
        ),
        (
            Some(&b"cert-other"[..]),
            Some("203.0.113.7"),
            json(),
            403,
            "certificate_not_pinned",
        ),
    ] {
        let reply = post(&app, certificate, ip, headers, other).await;
        assert_eq!(reply.status, status, "{reason}: {:?}", reply.json);
        assert_eq!(reply.json["error"], reason);
    }
    assert_eq!(
        stored(&pool).await.len(),
        1,
        "nothing of the refused stored"
    );

    // Un-pinned: the next request is refused (the sources cache here reads every request).
    let rotated = partner_source(&[b"cert-globex-next"], "", "");
    shared::sources::apply(&pool, &[rotated]).await.unwrap();
    let revoked = post(
        &app,
        Some(b"cert-globex"),
        Some("203.0.113.7"),
        json(),
        other,
    )
    .await;
    assert_eq!(revoked.status, 403, "{:?}", revoked.json);
    assert_eq!(revoked.json["error"], "certificate_not_pinned");
}

/// A partner's id header, its timestamp window and its bearer token, each refused when it does
/// not hold; and the sources file refuses a partner table that would admit nobody or that
/// mixes in a signature.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_partners_id_header_timestamp_and_token_are_checked(pool: PgPool) {
    let source = partner_source(
        &[b"cert-globex", b"cert-globex-next"],
        "secret_ref = \"partners/globex\"\n",
        "token_header = \"authorization\"\nevent_id_header = \"x-partner-event-id\"\n\
         timestamp_header = \"x-partner-timestamp\"\n",
    );
    let app = TestApp::with_limits(
        pool.clone(),
        std::slice::from_ref(&source),
        // The token is being rotated: tok-1 is the new one, tok-0 still accepted.
        SecretStore::memory([(
            "partners/globex".to_owned(),
            SecretSet::new("tok-1", Some("tok-0".into())),
        )]),
        Duration::ZERO,
        MAX_BODY,
    )
    .await;
    let headers = |id: Option<&str>, at: i64, token: &str| {
        let mut h = HeaderMap::new();
        if let Some(id) = id {
            h.insert("x-partner-event-id", id.parse().unwrap());
        }
        h.insert("x-partner-timestamp", at.to_string().parse().unwrap());
        h.insert("authorization", format!("Bearer {token}").parse().unwrap());
        h
    };
    let body = br#"{"type":"invoice.sent"}"#;
    let now = shared::ingest::unix_now();
    let send = |h| post(&app, Some(b"cert-globex"), Some("203.0.113.7"), h, body);
    assert_eq!(send(headers(Some("inv-1"), now, "tok-1")).await.status, 200);
    assert_eq!(
        send(headers(Some("inv-2"), now - 3600, "tok-1"))
            .await
            .status,
        401
    );
    assert_eq!(send(headers(Some("inv-3"), now, "tok-2")).await.status, 401);
    assert_eq!(
        send(headers(Some("inv-4"), now, "tok-0")).await.status,
        200,
        "during a rotation"
    );
    // A pinned certificate whose request is refused (a wrong token) is not recorded as seen.
    let refused = post(
        &app,
        Some(b"cert-globex-next"),
        Some("203.0.113.7"),
        headers(Some("inv-5"), now, "tok-2"),
        body,
    )
    .await;
    assert_eq!(refused.status, 401);
    let recorded: Vec<Vec<u8>> = sqlx::query_scalar("SELECT sha256 FROM partner_certificates")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(recorded, [sha2::Sha256::digest(b"cert-globex").to_vec()]);
    let no_id = send(headers(None, now, "tok-1")).await;
    assert_eq!(no_id.status, 400, "{:?}", no_id.json);
    assert_eq!(
        stored(&pool).await,
        [("inv-1".to_owned(), 1), ("inv-4".to_owned(), 1)]
    );

    let dir = tempfile::tempdir().unwrap();
    let refused = |text: &str| {
        let file = dir.path().join("s.toml");
        std::fs::write(&file, text).unwrap();
        shared::sources::read_sources_file(&file)
            .unwrap_err()
            .to_string()
    };
    let head = "[[source]]\nid = \"p\"\ntenant = \"t\"\nauth = \"partner\"\n";
    let fields = "[source.fields]\nevent_type = \"json:/type\"\n";
    assert!(
        refused(&format!(
            "{head}[source.partner]\nclient_certificates = []\ncidrs = [\"10.0.0.0/8\"]\n{fields}"
        ))
        .contains("admit nobody")
    );
    assert!(
        refused(&format!(
            "{head}[source.partner]\nclient_certificates = [\"{}\"]\ncidrs = [\"10.0.0.0/33\"]\n{fields}",
            pin(b"x")
        ))
        .contains("not an IPv4 or IPv6 CIDR")
    );
    assert!(
        refused(&format!(
            "[[source]]\nid = \"p\"\ntenant = \"t\"\nauth = \"partner\"\nscheme = \"stripe\"\n\
             [source.partner]\nclient_certificates = [\"{}\"]\ncidrs = [\"10.0.0.0/8\"]\n{fields}",
            pin(b"x")
        ))
        .contains("names no scheme")
    );
    assert!(refused(&format!("{head}{fields}")).contains("needs a [source.partner] table"));
}
