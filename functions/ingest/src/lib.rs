//! The ingest Lambda's handler: an API Gateway request in, an HTTP response out. All the work
//! is `shared::ingest`; this file reads the request and maps the outcome to a status, in one
//! `match`.

use std::net::IpAddr;

use lambda_http::http::{StatusCode, header};
use lambda_http::request::RequestContext;
use lambda_http::{Body, Request, RequestExt, Response};
use shared::ingest::{Delivery, IngestError, Ingestor, Received};
use shared::signature::VerifyError;

/// Handles `POST /webhooks/{source_id}` (and the `GET` a provider that verifies its endpoint
/// that way sends). Never fails: every outcome is an HTTP response.
pub async fn handler(
    request: Request,
    ingestor: &Ingestor,
) -> Result<Response<Body>, lambda_http::Error> {
    let params = request.path_parameters();
    let source_id = params.first("source_id").unwrap_or_default();
    // lambda_http builds the URI from the API Gateway event: the Host header (or the domain
    // name), the raw path with its stage, and the raw query string.
    let url = request.uri().to_string();
    let certificate = client_certificate(&request);
    let result = ingestor
        .receive(Delivery {
            source_id,
            headers: request.headers(),
            body: request.body().as_ref(),
            method: request.method().as_str(),
            url: Some(&url),
            source_ip: source_ip(&request),
            client_certificate: certificate.as_ref(),
        })
        .await;
    let response = respond(result);
    if response.status().is_server_error() {
        shared::metrics::ingest_5xx();
    }
    Ok(response)
}

/// The address the request came from: API Gateway's `requestContext.http.sourceIp`, the peer
/// its edge saw (the local runner sets it from the TCP peer). Never `X-Forwarded-For` or any
/// other header: the sender writes those. `None` when the context has none, or not an address.
pub fn source_ip(request: &Request) -> Option<IpAddr> {
    let Some(RequestContext::ApiGatewayV2(context)) = request.request_context_ref() else {
        return None;
    };
    context.http.source_ip.as_deref()?.trim().parse().ok()
}

/// The client certificate of a request that came over the partner domain's mutual TLS: API
/// Gateway's `requestContext.authentication.clientCert` (its PEM, subject and
/// `validity.notAfter`), which it sets only after verifying the chain against the truststore.
/// `None` for any other request, and for a PEM that does not read (logged: a partner source
/// then refuses the request as without a certificate).
pub fn client_certificate(request: &Request) -> Option<shared::partners::ClientCertificate> {
    let Some(RequestContext::ApiGatewayV2(context)) = request.request_context_ref() else {
        return None;
    };
    let cert = context.authentication.as_ref()?.client_cert.as_ref()?;
    let pem = cert.client_cert_pem.as_deref()?;
    let not_after = cert
        .validity
        .not_after
        .as_deref()
        .and_then(shared::partners::parse_not_after);
    match shared::partners::ClientCertificate::from_pem(pem, not_after, cert.subject_dn.clone()) {
        Ok(certificate) => Some(certificate),
        Err(error) => {
            tracing::warn!(%error, "the client certificate API Gateway passed does not read");
            None
        }
    }
}

/// The one place an ingest outcome becomes an HTTP status (see the contract in DESIGN.md).
fn respond(result: Result<Received, IngestError>) -> Response<Body> {
    let (status, body) = match &result {
        // A provider that wants an empty answer of its own (Discord's Webhook Events: 204).
        Ok(
            Received::Stored(shared::ingest::Receipt {
                acknowledge: Some(status),
                ..
            })
            | Received::Buffered {
                acknowledge: Some(status),
                ..
            },
        ) => return handshake(&shared::protocol::HandshakeReply::empty(*status)),
        // A batch says what became of its elements, each stored as its own event.
        Ok(Received::Stored(receipt)) => (
            StatusCode::OK,
            match &receipt.elements {
                Some(counts) => serde_json::json!({
                    "status": receipt.outcome.as_str(),
                    "elements": counts,
                }),
                None => serde_json::json!({ "status": receipt.outcome.as_str() }),
            },
        ),
        // Durable in SQS, not yet in PostgreSQL: still a 200 (Slack and Twilio want exactly
        // 200), and the body says which store holds it.
        Ok(Received::Buffered { .. }) => {
            (StatusCode::OK, serde_json::json!({ "status": "buffered" }))
        }
        Ok(Received::Handshake(reply)) => return handshake(reply),
        // Kept for the operator; the provider wants a 2xx and nothing more.
        Ok(Received::Notice { .. }) => {
            return handshake(&shared::protocol::HandshakeReply::empty(204));
        }
        Err(IngestError::UnknownSource) => (StatusCode::NOT_FOUND, error("unknown source")),
        Err(IngestError::MethodNotAllowed) => (
            StatusCode::METHOD_NOT_ALLOWED,
            error("only POST delivers an event"),
        ),
        Err(IngestError::PayloadTooLarge { limit, .. }) => (
            StatusCode::PAYLOAD_TOO_LARGE,
            error(&format!("body exceeds {limit} bytes")),
        ),
        Err(IngestError::TooManyEvents { count, limit }) => (
            StatusCode::PAYLOAD_TOO_LARGE,
            error(&format!(
                "a batch of {count} events exceeds {limit}: send at most {limit} a request"
            )),
        ),
        Err(IngestError::Signature(VerifyError::UnusableSecret { .. })) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            error("signing secret misconfigured"),
        ),
        // The reason is logged for the operator; the caller learns only that it failed.
        Err(IngestError::Signature(_)) => (StatusCode::UNAUTHORIZED, error("invalid signature")),
        Err(IngestError::Unreadable(e)) => (StatusCode::BAD_REQUEST, error(&e.to_string())),
        // Signed, but from outside the provider's published addresses, to a source that
        // enforces them: the reason is kept for the operator (`hookctl refused`).
        Err(IngestError::OutsideProviderRanges { .. }) => {
            (StatusCode::FORBIDDEN, error("address not allowed"))
        }
        // A partner refused by its rules: the reason (no certificate, not pinned, an address
        // outside its CIDRs, the timestamp) is the caller's to fix, and is kept for the operator.
        Err(IngestError::Partner(refusal)) => (
            StatusCode::from_u16(refusal.status()).unwrap_or(StatusCode::FORBIDDEN),
            error(refusal.reason_code()),
        ),
        Err(IngestError::Secret(e)) if e.is_misconfiguration() => (
            StatusCode::INTERNAL_SERVER_ERROR,
            error("signing secret misconfigured"),
        ),
        Err(IngestError::Secret(_)) => (StatusCode::SERVICE_UNAVAILABLE, error("try again later")),
        Err(IngestError::Store(e)) if e.is_retryable() => {
            (StatusCode::SERVICE_UNAVAILABLE, error("try again later"))
        }
        Err(IngestError::Store(_)) => (StatusCode::INTERNAL_SERVER_ERROR, error("internal error")),
        Err(IngestError::Unavailable { .. }) => {
            (StatusCode::SERVICE_UNAVAILABLE, error("try again later"))
        }
    };
    let mut response = Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json");
    if status == StatusCode::SERVICE_UNAVAILABLE {
        response = response.header(header::RETRY_AFTER, "5");
    }
    response
        .body(Body::Text(body.to_string()))
        .expect("static response parts are valid")
}

/// A provider's endpoint check, answered exactly as that provider requires: its status, its
/// content type, its body (Slack accepts the challenge as JSON as well as plain text).
fn handshake(reply: &shared::protocol::HandshakeReply) -> Response<Body> {
    let mut response =
        Response::builder().status(StatusCode::from_u16(reply.status).unwrap_or(StatusCode::OK));
    if let Some(content_type) = reply.content_type {
        response = response.header(header::CONTENT_TYPE, content_type);
    }
    response
        .body(Body::Text(reply.body.clone()))
        .expect("a status, a static content type and a text body make a valid response")
}

fn error(message: &str) -> serde_json::Value {
    serde_json::json!({ "error": message })
}
