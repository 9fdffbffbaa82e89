//! The HTTP destination: one POST per message, with the `Idempotency-Key` header.

use std::time::Duration;

use super::Delivery;
use crate::store::outbox::OutboxMessage;

pub(super) fn client(request_timeout: Duration) -> Result<reqwest::Client, reqwest::Error> {
    // Never follow a redirect: reqwest would turn a 301/302/303 POST into a bodiless GET,
    // and the 200 of the page it lands on (a login page, the same path with a trailing
    // slash) would mark the message delivered while nothing arrived.
    reqwest::Client::builder()
        .timeout(request_timeout)
        .redirect(crate::redirects::never())
        .build()
}

pub(super) async fn post(
    http: &reqwest::Client,
    url: &str,
    message: &OutboxMessage,
    timeout: Duration,
) -> Delivery {
    let body = serde_json::json!({
        "action": message.action,
        "tenant_id": message.tenant_id,
        "event_id": message.external_id,
        "payload": message.payload,
    });
    let sent = http
        .post(url)
        .header("Idempotency-Key", &message.idempotency_key)
        .timeout(timeout)
        .json(&body)
        .send()
        .await;
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
            if status.is_server_error() || status.as_u16() == 408 || status.as_u16() == 429 {
                Delivery::Transient(why)
            } else {
                Delivery::Refused(why)
            }
        }
        Err(error) => Delivery::Transient(format!("request failed: {error}")),
    }
}
