//! The HTTP destination: one POST per message, with the `Idempotency-Key` header and, when its
//! route names a signing secret, the Standard Webhooks headers (`webhook-id`,
//! `webhook-timestamp`, `webhook-signature`; `subscriptions::signing`).

use std::time::Duration;

use super::{Delivery, Outgoing};
use crate::store::outbox::OutboxMessage;
use crate::subscriptions::signing;

pub(super) fn client(request_timeout: Duration) -> Result<reqwest::Client, reqwest::Error> {
    // Never follow a redirect: reqwest would turn a 301/302/303 POST into a bodiless GET,
    // and the 200 of the page it lands on (a login page, the same path with a trailing
    // slash) would mark the message delivered while nothing arrived.
    reqwest::Client::builder()
        .timeout(request_timeout)
        .redirect(crate::redirects::never())
        .build()
}

/// What an effect's POST carries: its action, event and payload (serialised from the message,
/// not from a copy of its payload; the fields in the order `json!` writes them).
#[derive(serde::Serialize)]
struct EffectBody<'a> {
    action: &'a str,
    event_id: &'a str,
    payload: &'a serde_json::Value,
    tenant_id: &'a str,
}

pub(super) fn body_of(message: &OutboxMessage) -> String {
    serde_json::to_string(&EffectBody {
        action: &message.action,
        event_id: &message.external_id,
        payload: &message.payload,
        tenant_id: &message.tenant_id,
    })
    .unwrap_or_default()
}

pub(super) async fn post(
    http: &reqwest::Client,
    url: reqwest::Url,
    o: &Outgoing<'_>,
    timeout: Duration,
) -> Delivery {
    let message = o.message;
    let body = o.body.as_bytes();
    let mut request = http
        .post(url)
        .header("Idempotency-Key", &message.idempotency_key)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .timeout(timeout);
    if let Some(secrets) = &o.signing {
        let timestamp = chrono::Utc::now().timestamp();
        match signing::signature(secrets, &message.idempotency_key, timestamp, body) {
            Ok(signature) => {
                request = request
                    .header("webhook-id", &message.idempotency_key)
                    .header("webhook-timestamp", timestamp.to_string())
                    .header("webhook-signature", signature);
            }
            // Nothing is sent unsigned to a route that asks for signatures.
            Err(e) => return Delivery::Refused(format!("not sent: {e}")),
        }
    }
    let sent = request.body(body.to_vec()).send().await;
    match sent {
        Ok(response) if response.status().is_success() => Delivery::Delivered,
        Ok(response) if response.status().is_redirection() => {
            // Permanent: the target sends every message to the same place (single sign-on,
            // a moved URL), and retrying cannot change that. The message waits, failed,
            // for an operator who fixes the target URL and resends it.
            Delivery::Refused(crate::redirects::reason("target", &response))
        }
        Ok(response) => {
            let status = response.status();
            let why = format!("target answered {status}");
            if status.as_u16() == 410 {
                Delivery::Gone(why)
            } else if status.is_server_error() || status.as_u16() == 408 || status.as_u16() == 429 {
                Delivery::Transient(why)
            } else {
                Delivery::Refused(why)
            }
        }
        Err(error) => Delivery::Transient(format!("request failed: {error}")),
    }
}
