//! Shopify: `X-Shopify-Hmac-Sha256: <base64>`, HMAC-SHA256 of the body keyed with the app's
//! client secret. Only the body is signed: no timestamp, and none of the `X-Shopify-*` headers
//! (webhook id, event id, topic, triggered-at), so a signed body can be replayed under fresh ids
//! (see the GitHub module and `store::webhook_events`).

use http::{HeaderMap, HeaderName, HeaderValue};

use super::{SignedMessage, VerifyError, base64_encode, base64_mac, header, header_value, mac};

pub const SIGNATURE: &str = "x-shopify-hmac-sha256";

pub(super) fn parse(headers: &HeaderMap) -> Result<SignedMessage, VerifyError> {
    let value = header(headers, SIGNATURE)?;
    Ok(SignedMessage {
        timestamp: None,
        prefix: Vec::new(),
        candidates: vec![base64_mac(SIGNATURE, value)?],
        signed_headers: &[],
    })
}

pub(super) fn sign(key: &[u8], body: &[u8]) -> Vec<(HeaderName, HeaderValue)> {
    vec![(
        HeaderName::from_static(SIGNATURE),
        header_value(base64_encode(&mac(key, b"", body))),
    )]
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::domain::Scheme;
    use crate::secrets::SecretSet;
    use crate::signature::verify;

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
