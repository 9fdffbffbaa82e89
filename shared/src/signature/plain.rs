//! The catalogue's commonest layout, verified without the general reading: an HMAC of the body
//! alone, written in hex after a literal prefix in one header, with no timestamp: GitHub's and
//! Bitbucket's `sha256=<hex>`, Intercom's `sha1=<hex>`, and any layout a source declares in
//! that shape ([`applies`] says which).
//!
//! It answers only when the header holds exactly the prefix and the MAC's hex digits, once. Then
//! the general reading would take that one candidate and compare it with the same MACs, so the
//! answer is the same: the secret that made it, or no match after every secret. Anything else
//! (no header, a repeated one, spaces, another length, a secret that cannot key an HMAC) is
//! left to the general reading, which reports the error. The module's tests hold the two
//! answers equal on every catalogue entry of this shape and on altered copies of each.
//!
//! Why it exists: the general reading keeps what other layouts need (several candidates for a
//! rotation, the list of signed parts, a timestamp), and that bookkeeping was about half the
//! instructions the catalogue spent around the MAC (`./scripts/bench signature-instructions`,
//! HMAC-SHA256: 1026 before, 515 with this), enough to hold it over 1.10x the raw library call
//! at 1 KiB (issue 22). A delivery that fails here fails without a second MAC: the answer is
//! final whenever this module gives one.

use super::{MAX_HEADER_LEN, Request, Verified, VerifyError, hash_of, hex_into, hmac, key, same};
use crate::catalogue::{Encoding, Kind, Part, SignatureSpec};
use crate::secrets::SecretSet;

/// The longest MAC (SHA-512's).
const LONGEST_MAC: usize = 64;

/// Whether `spec` is the plain layout: worked out once per layout.
fn applies(spec: &SignatureSpec) -> bool {
    *spec.plain.get_or_init(|| plain(spec))
}

fn plain(spec: &SignatureSpec) -> bool {
    spec.kind == Kind::Hmac
        && spec.header.is_some()
        && spec.items.is_none()
        && spec.versions.is_none()
        && spec.timestamp.is_none()
        && spec.body_sha256_query.is_none()
        && matches!(spec.signed.as_slice(), [Part::Body])
        && spec.encoding() == Encoding::Hex
        // ASCII, and no space or tab first: a value that is the prefix and hex digits is then
        // one the general reading takes as it is (no byte it refuses, nothing it trims).
        && spec.prefix.is_ascii()
        && !spec.prefix.starts_with([' ', '\t'])
}

/// The answer of the general reading, when `spec` is the plain layout and the delivery carries
/// its signature exactly as the layout writes it; `None` otherwise.
pub(super) fn verify(
    spec: &'static SignatureSpec,
    request: &Request<'_>,
    secrets: &SecretSet,
) -> Option<Result<Verified, VerifyError>> {
    if !applies(spec) {
        return None;
    }
    let name = spec.header_name.get(spec.header.as_deref()?)?;
    let mut values = request.headers.get_all(name).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return None;
    };
    if value.len() > MAX_HEADER_LEN {
        return None;
    }
    let encoded = value.as_bytes().strip_prefix(spec.prefix.as_bytes())?;
    let hash = hash_of(spec);
    let mut claimed = [0u8; LONGEST_MAC];
    let claimed = claimed.get_mut(..hash.output_len())?;
    hex_into(encoded, claimed)?;
    let mut tried = 0;
    for (version, secret) in secrets.candidates() {
        tried += 1;
        let key = key(spec.secret, secret).ok()?;
        if hmac(hash, &key, request.body, |tag| {
            bool::from(same(tag, claimed))
        })
        .ok()?
        {
            return Some(Ok(Verified {
                secret: version,
                timestamp: None,
                signed_headers: &spec.signed_headers,
                signed_digest: None,
                layout: spec,
            }));
        }
    }
    Some(Err(VerifyError::NoMatch {
        candidates: 1,
        secrets: tried,
    }))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::{HeaderMap, HeaderName, HeaderValue};
    use proptest::prelude::*;

    use super::super::tests::secret_encoded;
    use super::super::{Signing, sign_with, verify_read, verify_with};
    use super::*;
    use crate::catalogue::{self, SecretEncoding};
    use crate::secrets::SigningSecret;

    const NOW: i64 = 1_700_000_000;
    const TOLERANCE: Duration = Duration::from_secs(300);

    /// Every plain layout there is: the catalogue's, and declared ones for the hash and secret
    /// encodings no entry of this shape uses.
    fn plain_layouts() -> Vec<&'static SignatureSpec> {
        let declared = [
            "kind = 'hmac'\nhash = 'sha512'\nheader = 'x-declared-signature'\nprefix = 'sha512='\nsigned = ['{body}']\n",
            "kind = 'hmac'\nhash = 'sha256'\nsecret = 'hex'\nheader = 'x-declared-signature'\nsigned = ['{body}']\n",
            "kind = 'hmac'\nhash = 'sha256'\nsecret = 'base64'\nheader = 'x-declared-signature'\nprefix = 'v1:'\nsigned = ['{body}']\n",
        ]
        .map(|text| catalogue::declare(toml::from_str(text).unwrap()).unwrap());
        catalogue::providers()
            .flat_map(|(_, provider)| provider.signatures.iter())
            .chain(declared)
            .filter(|spec| applies(spec))
            .collect()
    }

    /// The signature header's name and value, as the layout signs `body` with `secret`.
    fn signature(spec: &'static SignatureSpec, secret: &str, body: &[u8]) -> (HeaderName, String) {
        let signing = Signing {
            message_id: "",
            timestamp: NOW,
            body,
            method: "POST",
            url: None,
        };
        let mut headers = sign_with(spec, &SigningSecret::new(secret), &signing).unwrap();
        assert_eq!(headers.len(), 1, "a plain layout signs one header");
        let (name, value) = headers.remove(0);
        (name, value.to_str().unwrap().to_owned())
    }

    /// Both answers for one delivery: this module's (through `verify_with`) and the general
    /// reading's. Whether this module answered at all is returned beside them.
    fn both(
        spec: &'static SignatureSpec,
        headers: &HeaderMap,
        body: &[u8],
        secrets: &SecretSet,
    ) -> (
        Result<Verified, VerifyError>,
        Result<Verified, VerifyError>,
        bool,
    ) {
        let request = Request::post(headers, body);
        (
            verify_with(spec, &request, secrets, TOLERANCE, NOW),
            verify_read(spec, &request, secrets, TOLERANCE, NOW),
            verify(spec, &request, secrets).is_some(),
        )
    }

    fn one_header(name: &HeaderName, value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(name.clone(), HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn the_catalogue_has_plain_layouts_and_the_others_are_left_to_the_general_reading() {
        let plain: Vec<&str> = catalogue::providers()
            .filter(|(_, p)| p.signatures.iter().any(applies))
            .map(|(_, p)| p.name.as_str())
            .collect();
        for name in ["github", "bitbucket", "intercom"] {
            assert!(plain.contains(&name), "{name} is plain; plain: {plain:?}");
        }
        for name in [
            "stripe",
            "slack",
            "shopify",
            "standard_webhooks",
            "twilio",
            "discord",
        ] {
            assert!(!plain.contains(&name), "{name} is not plain");
        }
    }

    /// One delivery of the test, and where this module must answer it: `Some(matched)`.
    struct Delivery {
        what: &'static str,
        headers: HeaderMap,
        body: Vec<u8>,
        secrets: SecretSet,
        answered: Option<bool>,
    }

    #[test]
    fn it_answers_as_the_general_reading_on_every_plain_layout() {
        let body = br#"{"id":"evt_1","type":"order.paid"}"#;
        for spec in plain_layouts() {
            let (current, other) = (
                secret_encoded(spec.secret, false),
                secret_encoded(spec.secret, true),
            );
            let (name, value) = signature(spec, current, body);
            let digits = &value[spec.prefix.len()..];
            let delivery = |what, value: &str, answered| Delivery {
                what,
                headers: one_header(&name, value),
                body: body.to_vec(),
                secrets: SecretSet::new(current, None),
                answered,
            };
            let mut twice = one_header(&name, &value);
            twice.append(name.clone(), HeaderValue::from_str(&value).unwrap());
            let mut deliveries = vec![
                delivery("as signed", &value, Some(true)),
                Delivery {
                    secrets: SecretSet::new(other, Some(current.to_owned())),
                    ..delivery("signed with the previous secret", &value, Some(true))
                },
                Delivery {
                    secrets: SecretSet::new(other, None),
                    ..delivery("another secret", &value, Some(false))
                },
                delivery(
                    "upper-case digits",
                    &format!("{}{}", spec.prefix, digits.to_uppercase()),
                    Some(true),
                ),
                Delivery {
                    body: body[1..].to_vec(),
                    ..delivery("one body byte less", &value, Some(false))
                },
                Delivery {
                    headers: HeaderMap::new(),
                    ..delivery("no header", &value, None)
                },
                Delivery {
                    headers: twice,
                    ..delivery("the header twice", &value, None)
                },
                delivery("a space before", &format!(" {value}"), None),
                delivery("a tab after", &format!("{value}\t"), None),
                delivery("a digit short", &value[..value.len() - 1], None),
                delivery("a digit more", &format!("{value}0"), None),
                delivery(
                    "a digit that is not hex",
                    &format!("{}g{}", spec.prefix, &digits[1..]),
                    None,
                ),
                delivery("the prefix alone", &spec.prefix, None),
            ];
            if !spec.prefix.is_empty() {
                deliveries.push(delivery("no prefix", digits, None));
            }
            if spec.secret != SecretEncoding::Utf8 {
                deliveries.push(Delivery {
                    secrets: SecretSet::new("not hex or base64!", None),
                    ..delivery("a secret that cannot key it", &value, None)
                });
            }
            for d in deliveries {
                let label = format!("{:?}: {}", spec.header, d.what);
                let (through, general, by_this) = both(spec, &d.headers, &d.body, &d.secrets);
                assert_eq!(through, general, "{label}");
                assert_eq!(by_this, d.answered.is_some(), "{label}: answered here");
                if let Some(matched) = d.answered {
                    assert_eq!(through.is_ok(), matched, "{label}: {through:?}");
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Whatever the header holds (the signature, bits of it, spaces, other digits and
        /// prefixes), the answer is the general reading's.
        #[test]
        fn any_value_is_answered_as_the_general_reading_answers_it(
            layout in any::<proptest::sample::Index>(),
            pieces in proptest::collection::vec(
                prop_oneof![
                    Just("signature".to_owned()),
                    Just("prefix".to_owned()),
                    "[0-9a-fA-Fg =,\t]{0,3}",
                    "[0-9a-f]{40}|[0-9a-f]{64}|[0-9a-f]{128}",
                ],
                0..4,
            ),
            secret in any::<bool>(),
            body in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let layouts = plain_layouts();
            let spec = layouts[layout.index(layouts.len())];
            let (name, value) = signature(spec, secret_encoded(spec.secret, false), &body);
            let text: String = pieces
                .iter()
                .map(|piece| match piece.as_str() {
                    "signature" => value.clone(),
                    "prefix" => spec.prefix.clone(),
                    other => other.to_owned(),
                })
                .collect();
            let Ok(header) = HeaderValue::from_str(&text) else {
                return Ok(());
            };
            let mut headers = HeaderMap::new();
            headers.insert(name, header);
            let secrets = SecretSet::new(secret_encoded(spec.secret, secret), None);
            let (through, general, _) = both(spec, &headers, &body, &secrets);
            prop_assert_eq!(through, general);
        }
    }
}
