//! Standard Webhooks (and Svix, which uses the same scheme under `svix-` header names):
//! `webhook-id`, `webhook-timestamp`, `webhook-signature: v1,<base64> [v1,<base64> ...]`,
//! HMAC-SHA256 over `"{id}.{timestamp}.{body}"`, keyed with the base64 part of a `whsec_` secret.
//!
//! The layout itself is data: `shared/providers/standard_webhooks.toml`.

pub const ID: &str = "webhook-id";
pub const TIMESTAMP: &str = "webhook-timestamp";
pub const SIGNATURE: &str = "webhook-signature";
pub const SVIX_ID: &str = "svix-id";
pub const SVIX_TIMESTAMP: &str = "svix-timestamp";
pub const SVIX_SIGNATURE: &str = "svix-signature";

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::domain::Scheme;
    use crate::secrets::{SecretSet, SigningSecret};
    use crate::signature::verify;

    use http::{HeaderMap, HeaderName, HeaderValue};

    use crate::signature::{SignedMessage, VerifyError};

    fn parse(h: &HeaderMap) -> Result<SignedMessage, VerifyError> {
        crate::signature::parse(Scheme::StandardWebhooks, h)
    }

    fn base64_encode(bytes: &[u8]) -> String {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    /// The test vector published with the Standard Webhooks specification and used by its
    /// reference libraries' tests (standard-webhooks/standard-webhooks, `libraries/*` tests;
    /// the same vector appears in Svix's documentation).
    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const MSG_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const TS: i64 = 1_614_265_330;
    const BODY: &str = r#"{"test": 2432232314}"#;
    const SIGNATURE_VALUE: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    fn headers(prefix: &str, signature: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            HeaderName::try_from(format!("{prefix}-id")).unwrap(),
            HeaderValue::from_static(MSG_ID),
        );
        h.insert(
            HeaderName::try_from(format!("{prefix}-timestamp")).unwrap(),
            HeaderValue::from_str(&TS.to_string()).unwrap(),
        );
        h.insert(
            HeaderName::try_from(format!("{prefix}-signature")).unwrap(),
            HeaderValue::from_str(signature).unwrap(),
        );
        h
    }

    #[test]
    fn specification_known_answer_under_both_header_families() {
        let secrets = SecretSet::new(SECRET, None);
        for prefix in ["webhook", "svix"] {
            let result = verify(
                Scheme::StandardWebhooks,
                &headers(prefix, SIGNATURE_VALUE),
                BODY.as_bytes(),
                &secrets,
                Duration::from_secs(300),
                TS,
            );
            assert!(result.is_ok(), "{prefix}: {result:?}");
        }
        let signed = crate::signature::sign(
            Scheme::StandardWebhooks,
            &SigningSecret::new(SECRET),
            MSG_ID,
            TS,
            BODY.as_bytes(),
        )
        .unwrap();
        assert_eq!(signed[2].1, SIGNATURE_VALUE);
    }

    #[test]
    fn several_entries_and_unknown_versions() {
        let value = format!(
            "v1a,AAAA v1,{} {}",
            base64_encode(&[0u8; 32]),
            SIGNATURE_VALUE
        );
        let secrets = SecretSet::new(SECRET, None);
        assert!(
            verify(
                Scheme::StandardWebhooks,
                &headers("webhook", &value),
                BODY.as_bytes(),
                &secrets,
                Duration::from_secs(300),
                TS
            )
            .is_ok()
        );
        assert_eq!(
            parse(&headers("webhook", "v1a,AAAA")),
            Err(VerifyError::MalformedHeader {
                header: SIGNATURE,
                reason: "no v1 signature".into()
            })
        );
    }

    #[test]
    fn a_secret_that_is_not_base64_is_a_configuration_error() {
        let secrets = SecretSet::new("whsec_not base64!", None);
        let err = verify(
            Scheme::StandardWebhooks,
            &headers("webhook", SIGNATURE_VALUE),
            BODY.as_bytes(),
            &secrets,
            Duration::from_secs(300),
            TS,
        );
        assert!(matches!(err, Err(VerifyError::UnusableSecret { .. })));
    }
}
