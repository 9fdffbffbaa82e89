//! Signature verification over the exact raw request bytes.
//!
//! Each provider scheme has its own file that reads its headers into a [`SignedMessage`]:
//! the bytes signed before the body, the timestamp (when the scheme signs one) and every
//! candidate signature the headers carry. Verification here is the same for all of them:
//! HMAC-SHA256 with each of the source's secrets (current, then previous), compared in
//! constant time against each candidate, then the timestamp window in both directions.

pub mod github;
pub mod shopify;
pub mod slack;
pub mod standard_webhooks;
pub mod stripe;

use std::time::Duration;

use hmac::{Hmac, KeyInit, Mac};
use http::{HeaderMap, HeaderName, HeaderValue};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::domain::{Scheme, SecretVersion};
use crate::secrets::{SecretSet, SigningSecret};

/// Length of an HMAC-SHA256 tag.
pub const MAC_LEN: usize = 32;
/// A signature header longer than this is rejected before any parsing.
const MAX_HEADER_LEN: usize = 8 * 1024;
/// More candidate signatures than this in one delivery is not a rotation, it is an attack.
const MAX_CANDIDATES: usize = 16;

/// What a delivery's headers claim was signed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedMessage {
    /// Unix seconds, for schemes that sign a timestamp.
    pub timestamp: Option<i64>,
    /// Bytes that precede the body in the signed message (`"{t}."` for Stripe, ...).
    pub prefix: Vec<u8>,
    /// Every signature the headers carry, decoded.
    pub candidates: Vec<[u8; MAC_LEN]>,
    /// The headers whose values the signature covers. A value read from any other header (an
    /// event id, say) can be changed by whoever holds one signed delivery.
    pub signed_headers: &'static [&'static str],
}

/// Why a delivery's signature was not accepted. Each variant is a different fix for the
/// operator; the HTTP response is 401 for all of them except [`VerifyError::UnusableSecret`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    #[error("no {header} header")]
    MissingHeader { header: &'static str },
    #[error("malformed {header} header: {reason}")]
    MalformedHeader {
        header: &'static str,
        reason: String,
    },
    #[error("the configured signing secret cannot be used with this scheme: {reason}")]
    UnusableSecret { reason: String },
    #[error(
        "no candidate matches: the body changed after signing or the secret is wrong \
         ({candidates} signature(s) in the headers, {secrets} secret(s) tried)"
    )]
    NoMatch { candidates: usize, secrets: usize },
    #[error(
        "timestamp {} s {} the tolerance of {tolerance_seconds} s",
        outside_by(*age_seconds, *tolerance_seconds),
        if *age_seconds > 0 { "older than" } else { "in the future, beyond" }
    )]
    TimestampOutsideTolerance {
        /// Positive: signed that many seconds ago. Negative: signed in the future.
        age_seconds: i64,
        tolerance_seconds: u64,
        /// The secret the signature matched, if it did (a replayed or delayed delivery).
        signature_matched: Option<SecretVersion>,
    },
}

fn outside_by(age_seconds: i64, tolerance_seconds: u64) -> u64 {
    age_seconds.unsigned_abs().saturating_sub(tolerance_seconds)
}

impl VerifyError {
    /// A short stable label for logs and metrics.
    pub fn reason_code(&self) -> &'static str {
        match self {
            VerifyError::MissingHeader { .. } => "missing_header",
            VerifyError::MalformedHeader { .. } => "malformed_header",
            VerifyError::UnusableSecret { .. } => "unusable_secret",
            VerifyError::NoMatch { .. } => "no_match",
            VerifyError::TimestampOutsideTolerance { age_seconds, .. } if *age_seconds > 0 => {
                "stale_timestamp"
            }
            VerifyError::TimestampOutsideTolerance { .. } => "future_timestamp",
        }
    }
}

/// A verified delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verified {
    pub secret: SecretVersion,
    pub timestamp: Option<i64>,
    /// The headers the signature covers (besides the body).
    pub signed_headers: &'static [&'static str],
}

impl Verified {
    /// Whether a value read from header `name` is covered by the signature.
    pub fn signs_header(&self, name: &str) -> bool {
        self.signed_headers.contains(&name)
    }
}

/// Verifies `body` as delivered with `headers` against the source's secrets.
/// `now_unix` is the current time in Unix seconds.
pub fn verify(
    scheme: Scheme,
    headers: &HeaderMap,
    body: &[u8],
    secrets: &SecretSet,
    tolerance: Duration,
    now_unix: i64,
) -> Result<Verified, VerifyError> {
    let signed = parse(scheme, headers)?;
    let mut matched = None;
    let mut tried = 0;
    for (version, secret) in secrets.candidates() {
        tried += 1;
        let tag = mac(&key(scheme, secret)?, &signed.prefix, body);
        // Compare against every candidate without stopping early on a mismatch.
        let hit = signed
            .candidates
            .iter()
            .fold(subtle::Choice::from(0), |acc, c| acc | tag.ct_eq(c));
        if bool::from(hit) {
            matched = Some(version);
            break;
        }
    }
    if let Some(timestamp) = signed.timestamp {
        let age_seconds = now_unix.saturating_sub(timestamp);
        if age_seconds.unsigned_abs() > tolerance.as_secs() {
            return Err(VerifyError::TimestampOutsideTolerance {
                age_seconds,
                tolerance_seconds: tolerance.as_secs(),
                signature_matched: matched,
            });
        }
    }
    match matched {
        Some(secret) => Ok(Verified {
            secret,
            timestamp: signed.timestamp,
            signed_headers: signed.signed_headers,
        }),
        None => Err(VerifyError::NoMatch {
            candidates: signed.candidates.len(),
            secrets: tried,
        }),
    }
}

/// Reads a scheme's signature headers.
pub fn parse(scheme: Scheme, headers: &HeaderMap) -> Result<SignedMessage, VerifyError> {
    match scheme {
        Scheme::Stripe => stripe::parse(headers),
        Scheme::StandardWebhooks => standard_webhooks::parse(headers),
        Scheme::Github => github::parse(headers),
        Scheme::Shopify => shopify::parse(headers),
        Scheme::Slack => slack::parse(headers),
    }
}

/// Signs `body` the way the provider would: the headers a delivery carries. `message_id` is
/// used by schemes that sign it (Standard Webhooks); `timestamp` by those that sign one.
pub fn sign(
    scheme: Scheme,
    secret: &SigningSecret,
    message_id: &str,
    timestamp: i64,
    body: &[u8],
) -> Result<Vec<(HeaderName, HeaderValue)>, VerifyError> {
    let key = key(scheme, secret)?;
    Ok(match scheme {
        Scheme::Stripe => stripe::sign(&key, timestamp, body),
        Scheme::StandardWebhooks => standard_webhooks::sign(&key, message_id, timestamp, body),
        Scheme::Github => github::sign(&key, body),
        Scheme::Shopify => shopify::sign(&key, body),
        Scheme::Slack => slack::sign(&key, timestamp, body),
    })
}

/// The HMAC key a scheme derives from the configured secret text.
fn key(scheme: Scheme, secret: &SigningSecret) -> Result<Vec<u8>, VerifyError> {
    match scheme {
        Scheme::StandardWebhooks => standard_webhooks::key(secret.expose()),
        _ => Ok(secret.expose().as_bytes().to_vec()),
    }
}

/// The headers a scheme reads, for storing beside the payload and for the `verify` report.
pub fn signature_headers(scheme: Scheme) -> &'static [&'static str] {
    match scheme {
        Scheme::Stripe => &[stripe::SIGNATURE],
        Scheme::StandardWebhooks => &[
            standard_webhooks::ID,
            standard_webhooks::TIMESTAMP,
            standard_webhooks::SIGNATURE,
            standard_webhooks::SVIX_ID,
            standard_webhooks::SVIX_TIMESTAMP,
            standard_webhooks::SVIX_SIGNATURE,
        ],
        Scheme::Github => &[github::SIGNATURE],
        Scheme::Shopify => &[shopify::SIGNATURE],
        Scheme::Slack => &[slack::SIGNATURE, slack::TIMESTAMP],
    }
}

/// The headers that carry a scheme's signature (the MAC itself): with the body, a delivery
/// anyone holding them could post again within the tolerance.
pub fn mac_headers(scheme: Scheme) -> &'static [&'static str] {
    match scheme {
        Scheme::Stripe => &[stripe::SIGNATURE],
        Scheme::StandardWebhooks => &[
            standard_webhooks::SIGNATURE,
            standard_webhooks::SVIX_SIGNATURE,
        ],
        Scheme::Github => &[github::SIGNATURE],
        Scheme::Shopify => &[shopify::SIGNATURE],
        Scheme::Slack => &[slack::SIGNATURE],
    }
}

/// Whether `name` (any case) carries a signature under any scheme.
pub fn is_signature_header(name: &str) -> bool {
    Scheme::ALL
        .iter()
        .flat_map(|s| mac_headers(*s))
        .any(|h| h.eq_ignore_ascii_case(name))
}

/// HMAC-SHA256 over `prefix || body`, without copying the body.
pub fn mac(key: &[u8], prefix: &[u8], body: &[u8]) -> [u8; MAC_LEN] {
    let mut mac =
        <Hmac<Sha256> as KeyInit>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(prefix);
    mac.update(body);
    mac.finalize().into_bytes().into()
}

/// The single value of a header, as text. Absent, repeated, oversized or non-ASCII values are
/// errors, never panics.
fn header<'a>(headers: &'a HeaderMap, name: &'static str) -> Result<&'a str, VerifyError> {
    let mut values = headers.get_all(name).iter();
    let value = values
        .next()
        .ok_or(VerifyError::MissingHeader { header: name })?;
    let extra = values.count();
    if extra > 0 {
        return Err(malformed(name, format!("appears {} times", extra + 1)));
    }
    if value.len() > MAX_HEADER_LEN {
        return Err(malformed(name, format!("{} bytes long", value.len())));
    }
    let text = value
        .to_str()
        .map_err(|_| malformed(name, "contains bytes that are not visible ASCII"))?
        .trim();
    if text.is_empty() {
        return Err(malformed(name, "empty"));
    }
    Ok(text)
}

fn malformed(header: &'static str, reason: impl Into<String>) -> VerifyError {
    VerifyError::MalformedHeader {
        header,
        reason: reason.into(),
    }
}

/// Unix seconds written as 1 to 12 ASCII digits.
fn unix_seconds(header: &'static str, raw: &str) -> Result<i64, VerifyError> {
    if raw.is_empty() || raw.len() > 12 || !raw.bytes().all(|b| b.is_ascii_digit()) {
        return Err(malformed(
            header,
            format!("timestamp {raw:?} is not Unix seconds"),
        ));
    }
    raw.parse()
        .map_err(|_| malformed(header, "timestamp out of range"))
}

fn hex_mac(header: &'static str, raw: &str) -> Result<[u8; MAC_LEN], VerifyError> {
    let mut out = [0u8; MAC_LEN];
    hex::decode_to_slice(raw, &mut out)
        .map_err(|_| malformed(header, "signature is not 64 hexadecimal characters"))?;
    Ok(out)
}

fn base64_mac(header: &'static str, raw: &str) -> Result<[u8; MAC_LEN], VerifyError> {
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(raw)
        .map_err(|_| malformed(header, "signature is not base64"))?;
    bytes
        .try_into()
        .map_err(|_| malformed(header, "signature is not 32 bytes"))
}

fn base64_encode(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn check_candidate_count(header: &'static str, n: usize) -> Result<(), VerifyError> {
    if n > MAX_CANDIDATES {
        return Err(malformed(
            header,
            format!("{n} signatures, at most {MAX_CANDIDATES} accepted"),
        ));
    }
    Ok(())
}

fn header_value(text: String) -> HeaderValue {
    HeaderValue::try_from(text).expect("signature headers are ASCII")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NOW: i64 = 1_700_000_000;
    const FIVE_MINUTES: Duration = Duration::from_secs(300);

    fn secrets(current: &str, previous: Option<&str>) -> SecretSet {
        SecretSet::new(current, previous.map(str::to_owned))
    }

    fn signed(scheme: Scheme, secret: &str, ts: i64, body: &[u8]) -> HeaderMap {
        let secret = SigningSecret::new(secret);
        sign(scheme, &secret, "msg_1", ts, body)
            .unwrap()
            .into_iter()
            .collect()
    }

    fn secret_for(scheme: Scheme) -> &'static str {
        match scheme {
            Scheme::StandardWebhooks => "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            _ => "s3cr3t",
        }
    }

    fn signs_timestamp(scheme: Scheme) -> bool {
        matches!(
            scheme,
            Scheme::Stripe | Scheme::StandardWebhooks | Scheme::Slack
        )
    }

    /// What `mac_headers` names is what verification needs: a delivery without those headers
    /// is refused as missing its signature, under every scheme, and the headers are found in
    /// any case.
    #[test]
    fn the_mac_headers_are_the_ones_a_signature_needs() {
        for scheme in Scheme::ALL {
            let secret = secret_for(scheme);
            let mut headers = signed(scheme, secret, NOW, b"{}");
            let names: Vec<String> = headers.keys().map(|n| n.as_str().to_owned()).collect();
            assert!(
                names.iter().any(|n| is_signature_header(n)),
                "{scheme}: {names:?}"
            );
            for name in names.iter().filter(|n| is_signature_header(n)) {
                headers.remove(name.as_str());
            }
            let refused = verify(
                scheme,
                &headers,
                b"{}",
                &secrets(secret, None),
                FIVE_MINUTES,
                NOW,
            );
            assert!(
                matches!(refused, Err(VerifyError::MissingHeader { .. })),
                "{scheme}: {refused:?}"
            );
        }
        assert!(is_signature_header("Stripe-Signature"));
        assert!(!is_signature_header("webhook-id"));
    }

    #[test]
    fn every_scheme_accepts_its_own_signature_and_rejects_a_changed_body() {
        for scheme in Scheme::ALL {
            let secret = secret_for(scheme);
            let headers = signed(scheme, secret, NOW, b"{\"id\":1}");
            let ok = verify(
                scheme,
                &headers,
                b"{\"id\":1}",
                &secrets(secret, None),
                FIVE_MINUTES,
                NOW,
            );
            let verified = ok.unwrap_or_else(|e| panic!("{scheme}: {e}"));
            assert_eq!(
                (verified.secret, verified.timestamp),
                (
                    SecretVersion::Current,
                    signs_timestamp(scheme).then_some(NOW)
                ),
                "{scheme}"
            );
            // Only Standard Webhooks signs its id header; GitHub's and Shopify's are outside.
            assert_eq!(
                verified.signs_header(standard_webhooks::ID),
                scheme == Scheme::StandardWebhooks,
                "{scheme}"
            );
            let changed = verify(
                scheme,
                &headers,
                b"{\"id\":2}",
                &secrets(secret, None),
                FIVE_MINUTES,
                NOW,
            );
            assert!(
                matches!(
                    changed,
                    Err(VerifyError::NoMatch {
                        candidates: 1,
                        secrets: 1
                    })
                ),
                "{scheme}: {changed:?}"
            );
        }
    }

    #[test]
    fn the_previous_secret_is_accepted_and_reported() {
        for scheme in Scheme::ALL {
            let old = secret_for(scheme);
            let new = match scheme {
                Scheme::StandardWebhooks => "whsec_bmV3LXNlY3JldC1mb3ItdGVzdGluZw==",
                _ => "n3w",
            };
            let headers = signed(scheme, old, NOW, b"body");
            let both = secrets(new, Some(old));
            assert_eq!(
                verify(scheme, &headers, b"body", &both, FIVE_MINUTES, NOW)
                    .unwrap()
                    .secret,
                SecretVersion::Previous,
                "{scheme}"
            );
            let only_new = secrets(new, None);
            assert!(
                matches!(
                    verify(scheme, &headers, b"body", &only_new, FIVE_MINUTES, NOW),
                    Err(VerifyError::NoMatch { .. })
                ),
                "{scheme}"
            );
        }
    }

    #[test]
    fn timestamps_outside_the_window_fail_in_both_directions() {
        for scheme in Scheme::ALL.into_iter().filter(|s| signs_timestamp(*s)) {
            let secret = secret_for(scheme);
            let set = secrets(secret, None);
            for (ts, expect_age) in [(NOW - 301, 301), (NOW + 301, -301)] {
                let headers = signed(scheme, secret, ts, b"b");
                let err = verify(scheme, &headers, b"b", &set, FIVE_MINUTES, NOW).unwrap_err();
                assert_eq!(
                    err,
                    VerifyError::TimestampOutsideTolerance {
                        age_seconds: expect_age,
                        tolerance_seconds: 300,
                        signature_matched: Some(SecretVersion::Current)
                    },
                    "{scheme}"
                );
            }
            for ts in [NOW - 300, NOW + 300] {
                let headers = signed(scheme, secret, ts, b"b");
                assert!(
                    verify(scheme, &headers, b"b", &set, FIVE_MINUTES, NOW).is_ok(),
                    "{scheme} at the edge"
                );
            }
        }
    }

    #[test]
    fn timestamp_errors_read_like_a_diagnosis() {
        let stale = VerifyError::TimestampOutsideTolerance {
            age_seconds: 400,
            tolerance_seconds: 300,
            signature_matched: None,
        };
        assert_eq!(
            stale.to_string(),
            "timestamp 100 s older than the tolerance of 300 s"
        );
        assert_eq!(stale.reason_code(), "stale_timestamp");
        let future = VerifyError::TimestampOutsideTolerance {
            age_seconds: -310,
            tolerance_seconds: 300,
            signature_matched: None,
        };
        assert_eq!(
            future.to_string(),
            "timestamp 10 s in the future, beyond the tolerance of 300 s"
        );
    }

    #[test]
    fn missing_and_repeated_headers_are_named() {
        for scheme in Scheme::ALL {
            let err = verify(
                scheme,
                &HeaderMap::new(),
                b"",
                &secrets(secret_for(scheme), None),
                FIVE_MINUTES,
                NOW,
            )
            .unwrap_err();
            assert!(
                matches!(err, VerifyError::MissingHeader { .. }),
                "{scheme}: {err:?}"
            );
        }
        let mut headers = signed(Scheme::Github, "s", NOW, b"b");
        headers.append(github::SIGNATURE, HeaderValue::from_static("sha256=00"));
        let err = verify(
            Scheme::Github,
            &headers,
            b"b",
            &secrets("s", None),
            FIVE_MINUTES,
            NOW,
        )
        .unwrap_err();
        assert_eq!(
            err,
            VerifyError::MalformedHeader {
                header: github::SIGNATURE,
                reason: "appears 2 times".into()
            }
        );
    }

    fn arbitrary_value() -> impl Strategy<Value = HeaderValue> {
        // Bytes a header value can carry: anything but control characters (tab is allowed).
        let header_byte = any::<u8>().prop_map(|b| {
            if (b < 0x20 && b != b'\t') || b == 0x7f {
                b' '
            } else {
                b
            }
        });
        prop_oneof![
            proptest::collection::vec(header_byte, 0..200)
                .prop_map(|v| HeaderValue::from_bytes(&v).expect("control characters were replaced")),
            // Shapes close to real headers: separators, prefixes, digits, hex and base64 text.
            "(t=|v1=|v0=|sha256=|v1,|v1a,| |,|=|[0-9]{0,14}|[0-9a-f]{0,70}|[A-Za-z0-9+/=]{0,50}){0,8}"
                .prop_map(|s| HeaderValue::try_from(s).expect("printable ASCII")),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Whatever the headers hold, verification answers with an error, never a panic, and
        /// never accepts without a real signature.
        #[test]
        fn malformed_headers_never_panic_and_never_verify(
            scheme_index in 0usize..5,
            values in proptest::collection::vec(arbitrary_value(), 6),
            body in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let scheme = Scheme::ALL[scheme_index];
            let mut headers = HeaderMap::new();
            for (name, value) in signature_headers(scheme).iter().zip(values) {
                headers.insert(*name, value);
            }
            let result = verify(scheme, &headers, &body, &secrets(secret_for(scheme), Some("prev")), FIVE_MINUTES, NOW);
            prop_assert!(result.is_err());
            let _ = parse(scheme, &headers);
        }

        /// A valid signature survives any extra, unknown items the scheme allows beside it, and
        /// any single changed body byte defeats it.
        #[test]
        fn one_flipped_body_byte_is_caught(
            scheme_index in 0usize..5,
            body in proptest::collection::vec(any::<u8>(), 1..256),
            at in any::<proptest::sample::Index>(),
            flip in 1u8..=255,
        ) {
            let scheme = Scheme::ALL[scheme_index];
            let secret = secret_for(scheme);
            let headers = signed(scheme, secret, NOW, &body);
            let set = secrets(secret, None);
            prop_assert!(verify(scheme, &headers, &body, &set, FIVE_MINUTES, NOW).is_ok());
            let mut changed = body.clone();
            let i = at.index(changed.len());
            changed[i] ^= flip;
            let is_no_match = matches!(verify(scheme, &headers, &changed, &set, FIVE_MINUTES, NOW), Err(VerifyError::NoMatch { .. }));
            prop_assert!(is_no_match);
        }
    }
}
