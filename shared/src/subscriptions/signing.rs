//! Signed deliveries, the Standard Webhooks way: `webhook-id` (the idempotency key),
//! `webhook-timestamp` (seconds), `webhook-signature` (`v1,<base64 HMAC-SHA256>` over
//! `{id}.{timestamp}.{body}`, keyed with the base64 part of a `whsec_` secret). While a secret
//! is rolled (Secrets Manager's `AWSPREVIOUS`, or the secrets file's `previous`), the header
//! carries a signature by each, space-separated, so a subscriber holding either verifies.

use crate::domain::Scheme;
use crate::secrets::SecretSet;
use crate::signature::{self, standard_webhooks};

/// Why a signing secret cannot sign.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the signing secret cannot sign a Standard Webhooks delivery ({0})")]
pub struct UnusableSecret(String);

/// The `webhook-signature` value: the current secret's signature, then the previous one's.
/// Made by the catalogue's Standard Webhooks layout, the one ingest verifies providers' with.
pub fn signature(
    secrets: &SecretSet,
    id: &str,
    timestamp: i64,
    body: &[u8],
) -> Result<String, UnusableSecret> {
    let mut signatures = Vec::with_capacity(2);
    for (_, secret) in secrets.candidates() {
        let headers = signature::sign(Scheme::StandardWebhooks, secret, id, timestamp, body)
            .map_err(|e| UnusableSecret(e.to_string()))?;
        let value = headers
            .iter()
            .find(|(name, _)| name.as_str() == standard_webhooks::SIGNATURE)
            .and_then(|(_, v)| v.to_str().ok())
            .ok_or_else(|| UnusableSecret("no signature header".into()))?;
        signatures.push(value.to_owned());
    }
    Ok(signatures.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector published with the Standard Webhooks specification (its reference libraries'
    /// tests, standard-webhooks/standard-webhooks `libraries/*`).
    #[test]
    fn the_specification_vector_signs_as_published() {
        let secrets = SecretSet::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", None);
        assert_eq!(
            signature(
                &secrets,
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1_614_265_330,
                br#"{"test": 2432232314}"#
            )
            .unwrap(),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn a_rolled_secret_signs_twice_and_a_bad_one_not_at_all() {
        let secrets = SecretSet::new(
            "whsec_bmV3LXNlY3JldC1mb3ItdGVzdGluZw==",
            Some("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into()),
        );
        let both = signature(
            &secrets,
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1_614_265_330,
            br#"{"test": 2432232314}"#,
        )
        .unwrap();
        let parts: Vec<&str> = both.split(' ').collect();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[1], "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        assert_ne!(parts[0], parts[1]);
        let bad = SecretSet::new("whsec_not base64!", None);
        assert!(signature(&bad, "i", 1, b"").is_err());
    }
}
