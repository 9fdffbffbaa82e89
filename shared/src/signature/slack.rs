//! Slack: `X-Slack-Signature: v0=<hex>` and `X-Slack-Request-Timestamp: <unix>`, HMAC-SHA256
//! keyed with the signing secret over `"v0:{timestamp}:{body}"`.
//!
//! The layout itself is data: `shared/providers/slack.toml`.

pub const SIGNATURE: &str = "x-slack-signature";
pub const TIMESTAMP: &str = "x-slack-request-timestamp";

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::domain::Scheme;
    use crate::secrets::SecretSet;
    use crate::signature::verify;

    use http::{HeaderMap, HeaderName, HeaderValue};

    use crate::secrets::SigningSecret;

    fn sign(key: &[u8], ts: i64, body: &[u8]) -> Vec<(HeaderName, HeaderValue)> {
        let secret = SigningSecret::new(String::from_utf8(key.to_vec()).unwrap());
        crate::signature::sign(Scheme::Slack, &secret, "", ts, body).unwrap()
    }

    /// Known answer from Slack's documentation, "Verifying requests from Slack" (the
    /// walkthrough's signing secret, timestamp, slash-command body and resulting signature).
    #[test]
    fn slack_documentation_known_answer() {
        let body = "token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c";
        let mut headers = HeaderMap::new();
        headers.insert(TIMESTAMP, HeaderValue::from_static("1531420618"));
        headers.insert(
            SIGNATURE,
            HeaderValue::from_static(
                "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503",
            ),
        );
        let secrets = SecretSet::new("8f742231b10e8888abcd99yyyzzz85a5", None);
        let result = verify(
            Scheme::Slack,
            &headers,
            body.as_bytes(),
            &secrets,
            Duration::from_secs(300),
            1_531_420_618 + 60,
        );
        assert_eq!(result.unwrap().timestamp, Some(1_531_420_618));
        assert_eq!(
            sign(
                b"8f742231b10e8888abcd99yyyzzz85a5",
                1_531_420_618,
                body.as_bytes()
            )[1]
            .1,
            headers[SIGNATURE]
        );
    }
}
