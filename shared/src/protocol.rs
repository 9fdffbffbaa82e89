//! What providers send besides their events' fields: signed handshakes that are not events
//! (Slack's `url_verification`, Zoom's `endpoint.url_validation`, Twitch's callback
//! verification, Discord's PING, Okta's one-time GET, Xero's intent to receive: the catalogue
//! entry's `handshake.kind`), the marks a provider puts on its own retries
//! (`X-Slack-Retry-Num`), and the delivery headers worth keeping beside a payload for an operator.
//! Everything here is read from a delivery whose signature already verified, but WooCommerce's
//! ping, which is sent unsigned ([`unsigned_handshake`]).

use hmac::{Hmac, KeyInit, Mac};
use http::HeaderMap;
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::Sha256;

use crate::catalogue::{HandshakeKind, Provider};
use crate::domain::Scheme;
use crate::secrets::SigningSecret;

/// Twitch's message type header: `webhook_callback_verification` on its challenge.
pub const TWITCH_MESSAGE_TYPE: &str = "twitch-eventsub-message-type";
/// Okta's one-time verification challenge, sent on a GET.
pub const OKTA_CHALLENGE: &str = "x-okta-verification-challenge";

/// The answer to a provider's check of the endpoint, sent instead of storing anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandshakeReply {
    pub status: u16,
    /// The body's content type; `None` with an empty body.
    pub content_type: Option<&'static str>,
    pub body: String,
}

impl HandshakeReply {
    fn json(value: Value) -> Self {
        Self {
            status: 200,
            content_type: Some("application/json"),
            body: value.to_string(),
        }
    }

    /// A status with no body (Discord's 204).
    pub fn empty(status: u16) -> Self {
        Self {
            status,
            content_type: None,
            body: String::new(),
        }
    }
}

/// A verified delivery that is the provider checking the endpoint, answered as the provider
/// requires; `None` for an event. `secret` is the one the delivery verified with (Zoom's answer
/// is keyed with it).
pub fn handshake(
    scheme: Scheme,
    method: &str,
    headers: &HeaderMap,
    body: &[u8],
    secret: &SigningSecret,
) -> Option<HandshakeReply> {
    handshake_of(scheme.provider(), method, headers, body, secret)
}

/// [`handshake`] for an entry, as loaded (a draft `hookctl providers check` reads, too).
pub fn handshake_of(
    provider: &Provider,
    method: &str,
    headers: &HeaderMap,
    body: &[u8],
    secret: &SigningSecret,
) -> Option<HandshakeReply> {
    let challenge = |value: Option<&Value>| {
        value
            .and_then(Value::as_str)
            .filter(|c| !c.is_empty() && c.len() <= MAX_CHALLENGE_LEN)
            .map(str::to_owned)
    };
    let json_body = || serde_json::from_slice::<Value>(body).ok();
    match provider.handshake.kind {
        HandshakeKind::None => None,
        HandshakeKind::SlackUrlVerification => slack_challenge(body)
            .map(|challenge| HandshakeReply::json(json!({ "challenge": challenge }))),
        HandshakeKind::ZoomUrlValidation => {
            let v = json_body()?;
            if v.get("event")?.as_str()? != "endpoint.url_validation" {
                return None;
            }
            let plain = challenge(v.pointer("/payload/plainToken"))?;
            let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.expose().as_bytes())
                .expect("HMAC takes any key length");
            mac.update(plain.as_bytes());
            let encrypted = hex::encode(mac.finalize().into_bytes());
            Some(HandshakeReply::json(
                json!({ "plainToken": plain, "encryptedToken": encrypted }),
            ))
        }
        HandshakeKind::TwitchCallbackVerification => {
            let kind = headers.get(TWITCH_MESSAGE_TYPE)?.to_str().ok()?.trim();
            if kind != "webhook_callback_verification" {
                return None;
            }
            let challenge = challenge(json_body()?.get("challenge"))?;
            Some(HandshakeReply {
                status: 200,
                content_type: Some("text/plain"),
                body: challenge,
            })
        }
        HandshakeKind::DiscordPing => {
            // A Webhook Events PING (type 0): acknowledged with 204. An interactions endpoint's
            // PING (type 1 with no event) is not answered: an interaction needs the application's
            // own reply, which a receiver cannot give, so the Developer Portal refuses this URL
            // as an interactions endpoint instead of users seeing every command fail.
            let v = json_body()?;
            (v.get("type")?.as_u64()? == 0).then(|| HandshakeReply::empty(204))
        }
        HandshakeKind::OktaVerification => {
            if method != "GET" {
                return None;
            }
            let value = headers.get(OKTA_CHALLENGE)?.to_str().ok()?.trim();
            let verification = challenge(Some(&Value::String(value.to_owned())))?;
            Some(HandshakeReply::json(
                json!({ "verification": verification }),
            ))
        }
        HandshakeKind::XeroIntentToReceive => {
            let v = json_body()?;
            v.get("events")?
                .as_array()?
                .is_empty()
                .then(|| HandshakeReply::empty(200))
        }
        // Answered before the signature ([`unsigned_handshake`]): a signed request is an event.
        HandshakeKind::WoocommercePing
        | HandshakeKind::MandrillHead
        | HandshakeKind::GraphValidationToken => None,
    }
}

/// A provider's check of the endpoint that carries no signature, answered before any is
/// verified; `None` for everything else (verified, then [`handshake`] or an event). `url` is
/// the URL the request arrived at, query included.
/// - WooCommerce's ping: a POST whose body is `webhook_id=<n>` and which carries no signature
///   header.
/// - Mandrill's URL check: a HEAD with no body.
/// - Microsoft Graph's validation: a request with no body and a `validationToken` query
///   parameter, answered with the token as `text/plain`.
///
/// Nothing of them is stored, and the answer says nothing a 404 for an unknown source does
/// not (Graph's echoes what the request sent).
pub fn unsigned_handshake(
    scheme: Scheme,
    method: &str,
    headers: &HeaderMap,
    body: &[u8],
    url: Option<&str>,
) -> Option<HandshakeReply> {
    unsigned_handshake_of(scheme.provider(), method, headers, body, url)
}

/// [`unsigned_handshake`] for an entry, as loaded.
pub fn unsigned_handshake_of(
    provider: &Provider,
    method: &str,
    headers: &HeaderMap,
    body: &[u8],
    url: Option<&str>,
) -> Option<HandshakeReply> {
    match provider.handshake.kind {
        HandshakeKind::MandrillHead => {
            (method == "HEAD" && body.is_empty()).then(|| HandshakeReply::empty(200))
        }
        HandshakeKind::GraphValidationToken => {
            let query = url?.split_once('?')?.1;
            let token = url::form_urlencoded::parse(query.as_bytes())
                .find(|(name, _)| name == GRAPH_VALIDATION_TOKEN)?
                .1;
            (method == "POST"
                && body.is_empty()
                && !token.is_empty()
                && token.len() <= MAX_CHALLENGE_LEN)
                .then(|| HandshakeReply {
                    status: 200,
                    content_type: Some("text/plain"),
                    body: token.into_owned(),
                })
        }
        HandshakeKind::WoocommercePing if method == "POST" => {
            let signed = provider
                .signatures
                .iter()
                .filter_map(|spec| spec.header.as_deref())
                .any(|name| headers.contains_key(name));
            let id = body.strip_prefix(b"webhook_id=")?;
            (!signed && (1..=20).contains(&id.len()) && id.iter().all(u8::is_ascii_digit))
                .then(|| HandshakeReply::empty(200))
        }
        _ => None,
    }
}

/// Microsoft Graph's query parameter on its validation request.
pub const GRAPH_VALIDATION_TOKEN: &str = "validationToken";

/// A signed message that is not an event ([`crate::catalogue::NoticeSpec`]): its kind, and
/// what it is about and says, as its entry reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    pub kind: String,
    pub subject: Option<String>,
    pub detail: Option<String>,
}

/// The notice a verified delivery is, by its entry's `notices`; `None` for an event. Read
/// after the signature verified, like a handshake.
pub fn notice(scheme: Scheme, headers: &HeaderMap, body: &[u8]) -> Option<Notice> {
    let spec = scheme.provider().notices.iter().find(|n| {
        headers
            .get(n.header.as_str())
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim() == n.equals)
    })?;
    let json = serde_json::from_slice::<Value>(body).ok();
    let read = |pointer: &Option<String>| {
        let value = json.as_ref()?.pointer(pointer.as_deref()?)?;
        let text = match value {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        Some(text.chars().take(MAX_CHALLENGE_LEN).collect())
    };
    Some(Notice {
        kind: spec.kind.clone(),
        subject: read(&spec.subject),
        detail: read(&spec.detail),
    })
}

/// The longest challenge answered (and the longest notice field kept). Slack's are short tokens; anything longer is not one.
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
    if scheme.provider().handshake.kind != HandshakeKind::SlackUrlVerification {
        return None;
    }
    slack_challenge(body)
}

/// The challenge of Slack's `url_verification` body.
fn slack_challenge(body: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Handshake {
        #[serde(rename = "type")]
        kind: Option<String>,
        challenge: Option<String>,
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

/// One known answer of an entry's handshake, answered.
#[derive(Debug, Clone)]
pub struct HandshakeCheck {
    pub index: usize,
    pub source: String,
    /// `None` when the answer is the one recorded; else what differs.
    pub mismatch: Option<String>,
}

/// Answers every known answer of `provider`'s handshake as ingest answers a request whose
/// signature verified (WooCommerce's ping, which carries none, as ingest answers it before
/// verifying), and compares the answer with the one recorded: the status, the content type,
/// and the body (as JSON when it is `application/json`). The catalogue test checks every
/// entry's; `hookctl providers check` a draft's.
pub fn check_handshakes(provider: &Provider) -> Vec<HandshakeCheck> {
    provider
        .handshake
        .vectors
        .iter()
        .enumerate()
        .map(|(index, v)| {
            let mismatch = (|| {
                let headers = crate::catalogue::vector_headers(&v.headers)?;
                let body = v.body.as_bytes();
                let secret = SigningSecret::new(v.secret.clone());
                let reply =
                    unsigned_handshake_of(provider, &v.method, &headers, body, v.url.as_deref())
                        .or_else(|| handshake_of(provider, &v.method, &headers, body, &secret))
                        .ok_or("not answered as a handshake: it would be stored as an event")?;
                let expected = &v.answer;
                if reply.status != expected.status
                    || reply.content_type != expected.content_type.as_deref()
                {
                    return Err(format!(
                        "answered {} {:?}, recorded {} {:?}",
                        reply.status, reply.content_type, expected.status, expected.content_type
                    ));
                }
                let same_body = if reply.content_type == Some("application/json") {
                    let (got, want) = (
                        serde_json::from_str::<Value>(&reply.body),
                        serde_json::from_str::<Value>(&expected.body),
                    );
                    matches!((got, want), (Ok(g), Ok(w)) if g == w)
                } else {
                    reply.body == expected.body
                };
                if !same_body {
                    return Err(format!(
                        "answered the body {:?}, recorded {:?}",
                        reply.body, expected.body
                    ));
                }
                Ok(())
            })()
            .err();
            HandshakeCheck {
                index,
                source: v.source.clone(),
                mismatch,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {

    /// Every entry's handshake is answered as its known answers record (an entry with a
    /// handshake has at least one: the loader refuses it without).
    #[test]
    fn every_handshake_answers_as_its_known_answers_record() {
        let mut answered = 0;
        for (scheme, p) in crate::catalogue::providers() {
            for check in check_handshakes(p) {
                assert!(
                    check.mismatch.is_none(),
                    "{scheme} handshake vector {} ({}): {}",
                    check.index,
                    check.source,
                    check.mismatch.unwrap_or_default()
                );
                answered += 1;
            }
        }
        assert!(answered >= 7, "only {answered} known answers");
    }
    use super::*;
    use http::HeaderValue;

    fn answer(
        scheme: Scheme,
        method: &str,
        headers: &HeaderMap,
        body: &str,
    ) -> Option<HandshakeReply> {
        handshake(
            scheme,
            method,
            headers,
            body.as_bytes(),
            &SigningSecret::new("zoom-catalogue-secret-token"),
        )
    }

    /// Each handshake the catalogue names, answered as its provider documents, and an event of
    /// the same provider left alone.
    #[test]
    fn every_catalogue_handshake_is_answered_as_its_provider_requires() {
        let none = HeaderMap::new();
        // WooCommerce's ping, as WC_Webhook::deliver_ping sends it: unsigned, its body the
        // webhook's id. Answered before any signature; a signed request is an event.
        let woo = |method: &str, headers: &HeaderMap, body: &str| {
            unsigned_handshake(Scheme::Woocommerce, method, headers, body.as_bytes(), None)
        };
        assert_eq!(
            woo("POST", &none, "webhook_id=42"),
            Some(HandshakeReply::empty(200))
        );
        let mut signed = HeaderMap::new();
        signed.insert("x-wc-webhook-signature", HeaderValue::from_static("c2ln"));
        for (method, headers, body) in [
            ("POST", &signed, "webhook_id=42"),
            ("GET", &none, "webhook_id=42"),
            ("POST", &none, "webhook_id="),
            ("POST", &none, "webhook_id=42&x=1"),
            ("POST", &none, "webhook_id=4 2"),
            ("POST", &none, r#"{"id":42}"#),
            ("POST", &none, "webhook_id=123456789012345678901"),
        ] {
            assert_eq!(woo(method, headers, body), None, "{method} {body}");
        }
        assert_eq!(
            unsigned_handshake(Scheme::Github, "POST", &none, b"webhook_id=42", None),
            None
        );
        assert_eq!(
            answer(Scheme::Woocommerce, "POST", &signed, "webhook_id=42"),
            None
        );
        // Zoom: the known answer recorded in shared/providers/zoom.toml (HMAC-SHA256 of the
        // plain token with the secret token, hex).
        let zoom = answer(
            Scheme::Zoom,
            "POST",
            &none,
            r#"{"event":"endpoint.url_validation","payload":{"plainToken":"qgg8vlvZRS6UYooatFL8Aw"},"event_ts":1654503849680}"#,
        )
        .unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&zoom.body).unwrap(),
            json!({"plainToken": "qgg8vlvZRS6UYooatFL8Aw", "encryptedToken": "c37c6c4c0915b150208dea1135958fe6fe1b53e9231b3717c74d0fc5e17057d1"})
        );
        assert_eq!(
            answer(
                Scheme::Zoom,
                "POST",
                &none,
                r#"{"event":"meeting.started","payload":{}}"#
            ),
            None
        );

        let mut twitch = HeaderMap::new();
        twitch.insert(
            TWITCH_MESSAGE_TYPE,
            HeaderValue::from_static("webhook_callback_verification"),
        );
        let body = r#"{"challenge":"pogchamp-kappa-360noscope-vohiyo","subscription":{"type":"channel.follow"}}"#;
        assert_eq!(
            answer(Scheme::Twitch, "POST", &twitch, body),
            Some(HandshakeReply {
                status: 200,
                content_type: Some("text/plain"),
                body: "pogchamp-kappa-360noscope-vohiyo".into()
            })
        );
        twitch.insert(
            TWITCH_MESSAGE_TYPE,
            HeaderValue::from_static("notification"),
        );
        assert_eq!(answer(Scheme::Twitch, "POST", &twitch, body), None);

        // An interactions endpoint's PING is not answered (interactions are not handled).
        assert_eq!(
            answer(
                Scheme::Discord,
                "POST",
                &none,
                r#"{"id":"1","type":1,"application_id":"2","version":1}"#,
            ),
            None
        );
        assert_eq!(
            answer(
                Scheme::Discord,
                "POST",
                &none,
                r#"{"version":1,"application_id":"2","type":0}"#
            )
            .unwrap()
            .status,
            204
        );
        assert_eq!(
            answer(
                Scheme::Discord,
                "POST",
                &none,
                r#"{"version":1,"type":1,"event":{"type":"APPLICATION_AUTHORIZED"}}"#
            ),
            None
        );
        assert_eq!(
            answer(Scheme::Discord, "POST", &none, r#"{"id":"1","type":2}"#),
            None
        );

        let mut okta = HeaderMap::new();
        okta.insert(
            OKTA_CHALLENGE,
            HeaderValue::from_static("X1yhHw7OLDbz6Mu2ivr3FQ"),
        );
        let verification = answer(Scheme::Okta, "GET", &okta, "").unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&verification.body).unwrap(),
            json!({"verification": "X1yhHw7OLDbz6Mu2ivr3FQ"})
        );
        assert_eq!(
            answer(Scheme::Okta, "POST", &okta, r#"{"eventId":"e1"}"#),
            None
        );

        let itr = answer(Scheme::Xero, "POST", &none, r#"{"events":[],"firstEventSequence":0,"lastEventSequence":0,"entropy":"S0m3r4Nd0mt3xt"}"#).unwrap();
        assert_eq!((itr.status, itr.body.as_str()), (200, ""));
        assert_eq!(
            answer(
                Scheme::Xero,
                "POST",
                &none,
                r#"{"events":[{"resourceId":"r"}],"firstEventSequence":1}"#
            ),
            None
        );

        assert_eq!(
            answer(
                Scheme::Stripe,
                "POST",
                &none,
                r#"{"type":"url_verification","challenge":"c"}"#
            ),
            None
        );
        let slack = answer(
            Scheme::Slack,
            "POST",
            &none,
            r#"{"type":"url_verification","challenge":"c"}"#,
        )
        .unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&slack.body).unwrap(),
            json!({"challenge": "c"})
        );
    }

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
