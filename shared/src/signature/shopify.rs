//! Shopify: `X-Shopify-Hmac-Sha256: <base64>`, HMAC-SHA256 of the body keyed with the app's
//! client secret. Only the body is signed: no timestamp, and none of the `X-Shopify-*` headers
//! (webhook id, event id, topic, triggered-at), so a signed body can be replayed under fresh ids
//! (see the GitHub module and `store::webhook_events`).
//!
//! The layout itself is data: `shared/providers/shopify.toml`.

pub const SIGNATURE: &str = "x-shopify-hmac-sha256";

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::domain::Scheme;
    use crate::secrets::SecretSet;
    use crate::signature::verify;

    use http::{HeaderMap, HeaderValue};

    use crate::signature::VerifyError;

    /// From Shopify's official Ruby library tests: shopify-api-ruby
    /// `test/webhooks/registry_test.rb` signs the body `{}` with the test context's
    /// `api_secret_key` (`API_SECRET_KEY`, set in `test/test_helper.rb`) and sends
    /// `Base64(HMAC-SHA256)` as `x-shopify-hmac-sha256`. The expected value below was computed
    /// independently with `printf '{}' | openssl dgst -sha256 -hmac API_SECRET_KEY -binary | base64`.
    #[test]
    fn shopify_library_known_answer() {
        let mut headers = HeaderMap::new();
        headers.insert(
            SIGNATURE,
            HeaderValue::from_static("+ihUB5l+D7QrohDEi/6NcBcJRyKssyWqos13LmnsBbs="),
        );
        let secrets = SecretSet::new("API_SECRET_KEY", None);
        assert!(
            verify(
                Scheme::Shopify,
                &headers,
                b"{}",
                &secrets,
                Duration::from_secs(300),
                0
            )
            .is_ok()
        );
        // The library's failure case: a header that is not a signature.
        headers.insert(SIGNATURE, HeaderValue::from_static("invalid"));
        assert!(matches!(
            verify(
                Scheme::Shopify,
                &headers,
                b"{}",
                &secrets,
                Duration::from_secs(300),
                0
            ),
            Err(VerifyError::MalformedHeader { .. })
        ));
    }
}
