//! What providers send besides their events' fields: signed handshakes that are not events
//! (Slack's `url_verification`), the marks a provider puts on its own retries
//! (`X-Slack-Retry-Num`), and the delivery headers worth keeping beside a payload for an operator.
//! Everything here is read from a delivery whose signature already verified.

use http::HeaderMap;
use serde::Deserialize;

use crate::domain::Scheme;

/// The longest challenge answered. Slack's are short tokens; anything longer is not one.
const MAX_CHALLENGE_LEN: usize = 1024;

/// Slack's `X-Slack-Retry-Num`: present, and at least 1, on Slack's redeliveries.
pub const SLACK_RETRY_NUM: &str = "x-slack-retry-num";
/// Slack's `X-Slack-Retry-Reason`: why Slack redelivered (`http_timeout`, `http_error`, ...).
pub const SLACK_RETRY_REASON: &str = "x-slack-retry-reason";

/// The challenge of a signed endpoint handshake, to be answered instead of storing an event.
///
/// Slack will not enable an Events API request URL until it answers a signed
/// `{"type": "url_verification", "challenge": "..."}` with 200 and the challenge. The body has no
/// event id; it is never an event.
pub fn handshake_challenge(scheme: Scheme, body: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Handshake {
        #[serde(rename = "type")]
        kind: Option<String>,
        challenge: Option<String>,
    }
    if scheme != Scheme::Slack {
        return None;
    }
    let handshake: Handshake = serde_json::from_slice(body).ok()?;
    match (handshake.kind.as_deref(), handshake.challenge) {
        (Some("url_verification"), Some(challenge))
            if !challenge.is_empty() && challenge.len() <= MAX_CHALLENGE_LEN =>
        {
            Some(challenge)
        }
        _ => None,
    }
}

/// Whether the provider marks this delivery as its own retry of an earlier attempt (Slack's
/// `X-Slack-Retry-Num`). Providers that retry without saying so (Stripe, Shopify, Standard
/// Webhooks senders) and GitHub (which never retries) answer false.
pub fn is_provider_retry(scheme: Scheme, headers: &HeaderMap) -> bool {
    match scheme {
        Scheme::Slack => headers
            .get(SLACK_RETRY_NUM)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u32>().ok())
            .is_some_and(|n| n > 0),
        _ => false,
    }
}

/// Delivery headers kept beside the payload, besides the signature headers and those the
/// source's fields are read from: what an operator asks of a delivery afterwards.
pub fn kept_headers(scheme: Scheme) -> &'static [&'static str] {
    match scheme {
        Scheme::Slack => &[SLACK_RETRY_NUM, SLACK_RETRY_REASON],
        // The shop event every subscription's webhook of it shares, when it was triggered, and
        // for which shop and API version it was rendered.
        Scheme::Shopify => &[
            "x-shopify-event-id",
            "x-shopify-triggered-at",
            "x-shopify-shop-domain",
            "x-shopify-api-version",
        ],
        // Which hook delivered it (a repository's, an organisation's, an App's).
        Scheme::Github => &[
            "x-github-hook-id",
            "x-github-hook-installation-target-type",
            "x-github-hook-installation-target-id",
        ],
        Scheme::Stripe | Scheme::StandardWebhooks => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn only_a_slack_url_verification_is_a_handshake() {
        let body = br#"{"token":"t","challenge":"abc","type":"url_verification"}"#;
        assert_eq!(
            handshake_challenge(Scheme::Slack, body).as_deref(),
            Some("abc")
        );
        assert_eq!(handshake_challenge(Scheme::Stripe, body), None);
        for not_one in [
            &br#"{"type":"event_callback","challenge":"abc"}"#[..],
            br#"{"type":"url_verification"}"#,
            br#"{"type":"url_verification","challenge":""}"#,
            br#"{"type":"url_verification","challenge":7}"#,
            b"challenge=abc",
        ] {
            assert_eq!(handshake_challenge(Scheme::Slack, not_one), None);
        }
        let long = format!(
            r#"{{"type":"url_verification","challenge":"{}"}}"#,
            "x".repeat(MAX_CHALLENGE_LEN + 1)
        );
        assert_eq!(handshake_challenge(Scheme::Slack, long.as_bytes()), None);
    }

    #[test]
    fn slack_marks_its_retries() {
        let mut headers = HeaderMap::new();
        assert!(!is_provider_retry(Scheme::Slack, &headers));
        headers.insert(SLACK_RETRY_NUM, HeaderValue::from_static("2"));
        assert!(is_provider_retry(Scheme::Slack, &headers));
        assert!(!is_provider_retry(Scheme::Github, &headers));
        headers.insert(SLACK_RETRY_NUM, HeaderValue::from_static("two"));
        assert!(!is_provider_retry(Scheme::Slack, &headers));
    }
}
