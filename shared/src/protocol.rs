//! What providers send besides their events' fields: signed handshakes that are not events
//! (Slack's `url_verification`), the marks a provider puts on its own retries
//! (`X-Slack-Retry-Num`), and the delivery headers worth keeping beside a payload for an operator.
//! Everything here is read from a delivery whose signature already verified.

use http::HeaderMap;
use serde::Deserialize;

use crate::catalogue::HandshakeKind;
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
    if scheme.provider().handshake.kind != HandshakeKind::SlackUrlVerification {
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

/// Whether the provider marks this delivery as its own retry of an earlier attempt (the
/// catalogue's `retries.marks_retries`: Slack's `X-Slack-Retry-Num`, at least 1 on a
/// redelivery). Providers that retry without saying so (Stripe, Shopify, Standard Webhooks
/// senders) and GitHub (which never retries) answer false.
pub fn is_provider_retry(scheme: Scheme, headers: &HeaderMap) -> bool {
    let mark = &scheme.provider().retries.marks_retries;
    !mark.is_empty()
        && headers
            .get(mark.as_str())
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u32>().ok())
            .is_some_and(|n| n > 0)
}

/// Delivery headers kept beside the payload, besides the signature headers and those the
/// source's fields are read from: what an operator asks of a delivery afterwards (the
/// catalogue's `kept_headers`).
pub fn kept_headers(scheme: Scheme) -> impl Iterator<Item = &'static str> {
    scheme.provider().kept_headers.iter().map(String::as_str)
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
