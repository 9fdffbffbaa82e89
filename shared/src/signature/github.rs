//! GitHub: `X-Hub-Signature-256: sha256=<hex>`, HMAC-SHA256 of the body keyed with the
//! webhook secret. Only the body is signed: no timestamp, and neither `X-GitHub-Delivery` nor
//! `X-GitHub-Event`. Delivery-id dedup therefore does not catch replays: whoever holds one signed
//! delivery can send its body again, at any time, under any fresh delivery id (and any event
//! type). What catches those is the store: a body whose id came from outside the signature is
//! stored once per source, and the same bytes under another id are answered `duplicate` and
//! recorded as `replayed_body` (see `store::webhook_events`).
//!
//! The layout itself is data: `shared/providers/github.toml`.

pub const SIGNATURE: &str = "x-hub-signature-256";

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::domain::Scheme;
    use crate::secrets::SecretSet;
    use crate::signature::verify;

    use http::{HeaderMap, HeaderName, HeaderValue};

    use crate::secrets::SigningSecret;
    use crate::signature::{SignedMessage, VerifyError};

    fn parse(h: &HeaderMap) -> Result<SignedMessage, VerifyError> {
        crate::signature::parse(Scheme::Github, h)
    }

    fn sign(key: &[u8], body: &[u8]) -> Vec<(HeaderName, HeaderValue)> {
        let secret = SigningSecret::new(String::from_utf8(key.to_vec()).unwrap());
        crate::signature::sign(Scheme::Github, &secret, "", 0, body).unwrap()
    }

    /// Known answer from GitHub's documentation, "Validating webhook deliveries" → "Testing the
    /// webhook payload validation": secret `It's a Secret to Everybody`, payload
    /// `Hello, World!`.
    #[test]
    fn github_documentation_known_answer() {
        let mut headers = HeaderMap::new();
        headers.insert(
            SIGNATURE,
            HeaderValue::from_static(
                "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
            ),
        );
        let secrets = SecretSet::new("It's a Secret to Everybody", None);
        assert!(
            verify(
                Scheme::Github,
                &headers,
                b"Hello, World!",
                &secrets,
                Duration::from_secs(300),
                0
            )
            .is_ok()
        );
        assert_eq!(
            sign(b"It's a Secret to Everybody", b"Hello, World!")[0].1,
            headers[SIGNATURE]
        );
    }

    #[test]
    fn the_old_sha1_header_shape_is_malformed() {
        let mut headers = HeaderMap::new();
        headers.insert(SIGNATURE, HeaderValue::from_static("sha1=0123"));
        assert_eq!(
            parse(&headers),
            Err(VerifyError::MalformedHeader {
                header: SIGNATURE,
                reason: "does not start with sha256=".into()
            })
        );
    }
}
