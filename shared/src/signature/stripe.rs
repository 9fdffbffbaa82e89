//! Stripe: `Stripe-Signature: t=<unix>,v1=<hex>[,v1=<hex>...][,v0=...]`, HMAC-SHA256 keyed with
//! the endpoint secret (`whsec_...`, used as-is) over `"{t}.{body}"`. Several `v1` entries appear
//! while an endpoint secret is being rolled; any one matching is enough.
//!
//! The layout itself is data: `shared/providers/stripe.toml`.

pub const SIGNATURE: &str = "stripe-signature";

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::domain::{Scheme, SecretVersion};
    use crate::secrets::SecretSet;
    use crate::signature::verify;

    use http::{HeaderMap, HeaderName, HeaderValue};

    use crate::secrets::SigningSecret;
    use crate::signature::{SignedMessage, VerifyError};

    fn parse(h: &HeaderMap) -> Result<SignedMessage, VerifyError> {
        crate::signature::parse(Scheme::Stripe, h)
    }

    fn sign(key: &[u8], ts: i64, body: &[u8]) -> Vec<(HeaderName, HeaderValue)> {
        let secret = SigningSecret::new(String::from_utf8(key.to_vec()).unwrap());
        crate::signature::sign(Scheme::Stripe, &secret, "", ts, body).unwrap()
    }

    /// Known answer from Stripe's official .NET SDK tests: stripe-dotnet
    /// `src/StripeTests/Services/Events/EventUtilityTest.cs` (secret `webhook_secret`,
    /// timestamp 1533204620) with its fixture `src/StripeTests/Resources/event_test_signature.json`,
    /// reproduced byte for byte below (it ends with a newline).
    const FIXTURE: &str = "{\n  \"id\": \"evt_123\",\n  \"object\": \"event\",\n  \"account\": \"acct_123\",\n  \"api_version\": \"2017-05-25\",\n  \"created\": 1533204620,\n  \"data\": {\n    \"object\": {\n      \"id\": \"cus_123\",\n      \"object\": \"customer\",\n      \"created\": 123456789,\n      \"email\": \"test@stripe.com\",\n      \"livemode\": false,\n      \"metadata\": {}\n    }\n  },\n  \"livemode\": false,\n  \"pending_webhooks\": 1,\n  \"request\": {\n    \"id\": \"req_123\",\n    \"idempotency_key\": \"idempotency-key-123\"\n  },\n  \"type\": \"customer.created\"\n}\n";
    const HEADER: &str = "t=1533204620,v1=2220f87ef101a04665f11cdf770523143f875572008577fa0f20882ddb9cc3c7,v0=63f3a72374a733066c4be69ed7f8e5ac85c22c9f0a6a612ab9a025a9e4ee7eef";

    fn headers(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(SIGNATURE, HeaderValue::from_str(value).unwrap());
        h
    }

    #[test]
    fn stripe_sdk_known_answer() {
        let secrets = SecretSet::new("webhook_secret", None);
        let now = 1_533_204_620 + 100; // as the SDK test: 100 s after signing, tolerance 300 s
        let ok = verify(
            Scheme::Stripe,
            &headers(HEADER),
            FIXTURE.as_bytes(),
            &secrets,
            Duration::from_secs(300),
            now,
        );
        assert_eq!(ok.unwrap().secret, SecretVersion::Current);
        // The SDK's RejectOutdatedTimestamp case: 400 s later.
        let late = verify(
            Scheme::Stripe,
            &headers(HEADER),
            FIXTURE.as_bytes(),
            &secrets,
            Duration::from_secs(300),
            1_533_204_620 + 400,
        );
        assert!(matches!(
            late,
            Err(VerifyError::TimestampOutsideTolerance {
                age_seconds: 400,
                ..
            })
        ));
        // The SDK's RejectIncorrectSignature case: the JSON was changed.
        let changed = format!("{FIXTURE}this_changes_the_json");
        let err = verify(
            Scheme::Stripe,
            &headers(HEADER),
            changed.as_bytes(),
            &secrets,
            Duration::from_secs(300),
            now,
        );
        assert!(matches!(
            err,
            Err(VerifyError::NoMatch { candidates: 1, .. })
        ));
        // Signing reproduces the published v1 value.
        let signed = sign(b"webhook_secret", 1_533_204_620, FIXTURE.as_bytes());
        assert!(HEADER.starts_with(signed[0].1.to_str().unwrap()));
    }

    #[test]
    fn any_of_several_v1_signatures_may_match() {
        let good = "2220f87ef101a04665f11cdf770523143f875572008577fa0f20882ddb9cc3c7";
        let other = "0".repeat(64);
        let value = format!("t=1533204620,v1={other},v1={good}");
        let secrets = SecretSet::new("webhook_secret", None);
        assert!(
            verify(
                Scheme::Stripe,
                &headers(&value),
                FIXTURE.as_bytes(),
                &secrets,
                Duration::from_secs(300),
                1_533_204_620
            )
            .is_ok()
        );
    }

    #[test]
    fn malformed_shapes_are_named() {
        let cases = [
            (
                "v1=0000000000000000000000000000000000000000000000000000000000000000",
                "no t= timestamp",
            ),
            ("t=1533204620", "no v1= signature"),
            ("t=1533204620,t=1533204620,v1=00", "more than one t="),
            ("t=soon,v1=00", "timestamp \"soon\" is not Unix seconds"),
            (
                "t=1533204620,v1=xyz",
                "signature is not 64 hexadecimal characters",
            ),
            ("t=1533204620,garbage", "item \"garbage\" is not key=value"),
        ];
        for (value, reason) in cases {
            assert_eq!(
                parse(&headers(value)),
                Err(VerifyError::MalformedHeader {
                    header: SIGNATURE,
                    reason: reason.into()
                }),
                "{value}"
            );
        }
    }
}
