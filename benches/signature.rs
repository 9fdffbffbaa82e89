//! Signature verification per scheme, in ns for 1 KiB and 64 KiB bodies, beside raw
//! HMAC-SHA256 of the same bytes measured in the same run. The ratio is the cost of everything
//! that is not the MAC: header parsing, candidate decoding, constant-time comparison.
//!
//! Then every primitive of the catalogue (HMAC-SHA1/256/512, Ed25519, ECDSA P-256) through a
//! catalogue entry (or a declared layout: no entry signs with SHA-512), beside the raw library
//! call on the same bytes: the catalogue's dispatch must cost at most 10% over the primitive at
//! 1 KiB. The raw call is the library's own verification: `Mac::verify_slice` for HMAC (its
//! constant-time comparison; a `==` on the tag would not be a verifier), `verify` for ring's
//! Ed25519 and P-256.
//!
//! Run: `./scripts/bench signature` (or `cargo bench -p benchmarks --bench signature`).

use std::hint::black_box;
use std::time::Duration;

use benchmarks::paired_ns_per_op;
use hmac::{Hmac, KeyInit, Mac};
use http::HeaderMap;
use ring::signature::KeyPair as _;
use sha2::Sha256;
use shared::catalogue::SignatureSpec;
use shared::domain::Scheme;
use shared::secrets::{SecretSet, SigningSecret};
use shared::signature;

fn raw_hmac(key: &[u8], body: &[u8]) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(key).unwrap();
    mac.update(body);
    mac.finalize().into_bytes().into()
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let batches = if quick { 5 } else { 21 };
    let batch_time = Duration::from_millis(if quick { 5 } else { 40 });
    let now = 1_700_000_000;
    println!(
        "signature verification vs raw HMAC-SHA256 over the same bytes ({batches} pairs of batches; \
         ns: medians, ratio: the median of each pair's own ratio)"
    );
    println!(
        "{:<18} {:>7} {:>12} {:>12} {:>9} {:>10}",
        "scheme", "body", "verify ns", "raw ns", "ratio", "verify ns/KiB"
    );
    // The five schemes written before the catalogue, as this benchmark has always measured.
    for scheme in [
        Scheme::Stripe,
        Scheme::StandardWebhooks,
        Scheme::Github,
        Scheme::Shopify,
        Scheme::Slack,
    ] {
        let secret = match scheme {
            Scheme::StandardWebhooks => "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".to_owned(),
            _ => format!("{scheme}-bench-secret"),
        };
        let secrets = SecretSet::new(secret.clone(), None);
        for kib in [1usize, 64] {
            let body: Vec<u8> = (0..kib * 1024).map(|i| b'a' + (i % 26) as u8).collect();
            let headers: HeaderMap = signature::sign(
                scheme,
                &SigningSecret::new(secret.clone()),
                "msg_bench",
                now,
                &body,
            )
            .unwrap()
            .into_iter()
            .collect();
            // The raw MAC uses the key the scheme derives (base64-decoded for Standard Webhooks).
            let key = match scheme {
                Scheme::StandardWebhooks => {
                    use base64::Engine as _;
                    base64::engine::general_purpose::STANDARD
                        .decode(secret.trim_start_matches("whsec_"))
                        .unwrap()
                }
                _ => secret.as_bytes().to_vec(),
            };
            let timed = paired_ns_per_op(
                || {
                    let r = signature::verify(
                        scheme,
                        black_box(&headers),
                        black_box(&body),
                        &secrets,
                        Duration::from_secs(300),
                        now,
                    );
                    assert!(r.is_ok());
                },
                || {
                    black_box(raw_hmac(black_box(&key), black_box(&body)));
                },
                batches,
                batch_time,
            );
            println!(
                "{:<18} {:>4} KiB {:>12.0} {:>12.0} {:>8.2}x {:>10.0}",
                scheme.as_str(),
                kib,
                timed.a_ns,
                timed.b_ns,
                timed.ratio,
                timed.a_ns / kib as f64
            );
        }
    }
    primitives(batches, batch_time, now);
}

/// The raw library call over the signed bytes: whether it verified.
type RawCall = Box<dyn Fn(&[u8]) -> bool>;

/// One primitive: how a delivery is verified through the catalogue, and the raw call.
struct Primitive {
    name: &'static str,
    layout: &'static SignatureSpec,
    secret: String,
    headers: HeaderMap,
    /// The raw primitive over the same bytes, returning whether it verified.
    raw: RawCall,
}

fn primitives(batches: usize, batch_time: Duration, now: i64) {
    println!();
    println!("catalogue dispatch vs the raw primitive on the same bytes (limit 1.10x at 1 KiB)");
    println!(
        "(ns: medians of the batches; of medians: their ratio; paired: the median of each pair of \
         batches' own ratio, held to the limit)"
    );
    println!(
        "{:<14} {:<18} {:>7} {:>12} {:>12} {:>9} {:>9} {:>7}",
        "primitive", "through", "body", "catalogue ns", "raw ns", "of medians", "paired", "limit"
    );
    for kib in [1usize, 64] {
        let body: Vec<u8> = (0..kib * 1024).map(|i| b'a' + (i % 26) as u8).collect();
        for p in cases(&body, now) {
            let secrets = SecretSet::new(p.secret.clone(), None);
            let request = signature::Request::post(&p.headers, &body);
            assert!(
                signature::verify_with(p.layout, &request, &secrets, Duration::from_secs(300), now)
                    .is_ok(),
                "{}",
                p.name
            );
            let message = signed_bytes(p.layout, &p.headers, &body);
            assert!((p.raw)(&message), "{} raw", p.name);
            let timed = paired_ns_per_op(
                || {
                    let request = signature::Request::post(black_box(&p.headers), black_box(&body));
                    let r = signature::verify_with(
                        p.layout,
                        &request,
                        &secrets,
                        Duration::from_secs(300),
                        now,
                    );
                    assert!(r.is_ok());
                },
                || {
                    assert!((p.raw)(black_box(&message)));
                },
                batches,
                batch_time,
            );
            let ratio = timed.ratio;
            println!(
                "{:<14} {:<18} {:>4} KiB {:>12.0} {:>12.0} {:>8.2}x {:>8.2}x {:>7}",
                p.name,
                through(p.layout),
                kib,
                timed.a_ns,
                timed.b_ns,
                timed.a_ns / timed.b_ns,
                ratio,
                if kib == 1 {
                    if ratio <= 1.10 { "ok" } else { "OVER" }
                } else {
                    ""
                }
            );
        }
    }
}

/// The bytes each case signs, as the raw call sees them: the layout's parts concatenated.
fn signed_bytes(layout: &SignatureSpec, headers: &HeaderMap, body: &[u8]) -> Vec<u8> {
    use shared::catalogue::Part;
    let timestamp = layout
        .timestamp
        .as_ref()
        .and_then(|t| t.header.as_ref())
        .map(|h| headers[h.as_str()].as_bytes().to_vec())
        .unwrap_or_default();
    let mut out = Vec::new();
    for part in &layout.signed {
        match part {
            Part::Literal(text) => out.extend_from_slice(text.as_bytes()),
            Part::Body => out.extend_from_slice(body),
            Part::Timestamp => out.extend_from_slice(&timestamp),
            other => panic!("the benchmark's layouts sign no {other:?}"),
        }
    }
    out
}

fn through(layout: &SignatureSpec) -> String {
    layout.header.clone().unwrap_or_default()
}

fn hmac_headers(scheme: Scheme, secret: &str, body: &[u8], now: i64) -> HeaderMap {
    signature::sign(scheme, &SigningSecret::new(secret), "msg_bench", now, body)
        .unwrap()
        .into_iter()
        .collect()
}

fn cases(body: &[u8], now: i64) -> Vec<Primitive> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let secret = "bench-secret-key-0123456789";
    let key = secret.as_bytes().to_vec();
    let mut cases = Vec::new();

    let github = &Scheme::Github.provider().signatures[0];
    let k = key.clone();
    let expected = benchmarks::hmac_tag::<Hmac<Sha256>>(&key, body);
    cases.push(Primitive {
        name: "HMAC-SHA256",
        layout: github,
        secret: secret.into(),
        headers: hmac_headers(Scheme::Github, secret, body, now),
        raw: Box::new(move |m| {
            let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&k).unwrap();
            mac.update(m);
            mac.verify_slice(&expected).is_ok()
        }),
    });

    let intercom = &Scheme::Intercom.provider().signatures[0];
    let k = key.clone();
    let expected = benchmarks::hmac_tag::<Hmac<sha1::Sha1>>(&key, body);
    cases.push(Primitive {
        name: "HMAC-SHA1",
        layout: intercom,
        secret: secret.into(),
        headers: hmac_headers(Scheme::Intercom, secret, body, now),
        raw: Box::new(move |m| {
            let mut mac = <Hmac<sha1::Sha1> as KeyInit>::new_from_slice(&k).unwrap();
            mac.update(m);
            mac.verify_slice(&expected).is_ok()
        }),
    });

    // No catalogue entry signs with SHA-512: a declared layout, as a source would write it.
    let sha512 = benchmarks::declared_sha512();
    let headers: HeaderMap = signature::sign_with(
        sha512,
        &SigningSecret::new(secret),
        &signature::Signing {
            message_id: "",
            timestamp: now,
            body,
            method: "POST",
            url: None,
        },
    )
    .unwrap()
    .into_iter()
    .collect();
    let k = key.clone();
    let expected = benchmarks::hmac_tag::<Hmac<sha2::Sha512>>(&key, body);
    cases.push(Primitive {
        name: "HMAC-SHA512",
        layout: sha512,
        secret: secret.into(),
        headers,
        raw: Box::new(move |m| {
            let mut mac = <Hmac<sha2::Sha512> as KeyInit>::new_from_slice(&k).unwrap();
            mac.update(m);
            mac.verify_slice(&expected).is_ok()
        }),
    });

    // Ed25519 through Discord's entry: X-Signature-Ed25519 over timestamp + body.
    let discord = &Scheme::Discord.provider().signatures[0];
    let pair = ring::signature::Ed25519KeyPair::from_seed_unchecked(&[7u8; 32]).unwrap();
    let public = pair.public_key().as_ref().to_vec();
    let ts = now.to_string();
    let mut message = ts.clone().into_bytes();
    message.extend_from_slice(body);
    let mut headers = HeaderMap::new();
    headers.insert("x-signature-timestamp", ts.parse().unwrap());
    headers.insert(
        "x-signature-ed25519",
        hex::encode(pair.sign(&message)).parse().unwrap(),
    );
    let signature = pair.sign(&message).as_ref().to_vec();
    cases.push(Primitive {
        name: "Ed25519",
        layout: discord,
        secret: hex::encode(&public),
        headers,
        raw: Box::new(move |m| {
            ring::signature::UnparsedPublicKey::new(&ring::signature::ED25519, &public)
                .verify(m, &signature)
                .is_ok()
        }),
    });

    // ECDSA P-256 through SendGrid's entry: its signature (DER, base64) over timestamp + body.
    let sendgrid = &Scheme::Sendgrid.provider().signatures[0];
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = ring::signature::EcdsaKeyPair::generate_pkcs8(
        &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING,
        &rng,
    )
    .unwrap();
    let pair = ring::signature::EcdsaKeyPair::from_pkcs8(
        &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING,
        pkcs8.as_ref(),
        &rng,
    )
    .unwrap();
    let point = pair.public_key().as_ref().to_vec();
    let sendgrid_ts = sendgrid
        .timestamp
        .as_ref()
        .and_then(|t| t.header.clone())
        .unwrap();
    let mut message = ts.clone().into_bytes();
    message.extend_from_slice(body);
    let sig = pair.sign(&rng, &message).unwrap().as_ref().to_vec();
    let mut headers = HeaderMap::new();
    headers.insert(
        http::HeaderName::from_bytes(sendgrid_ts.as_bytes()).unwrap(),
        ts.parse().unwrap(),
    );
    headers.insert(
        http::HeaderName::from_bytes(sendgrid.header.as_deref().unwrap().as_bytes()).unwrap(),
        b64.encode(&sig).parse().unwrap(),
    );
    let key = point.clone();
    cases.push(Primitive {
        name: "ECDSA P-256",
        layout: sendgrid,
        secret: b64.encode(&point),
        headers,
        raw: Box::new(move |m| {
            ring::signature::UnparsedPublicKey::new(&ring::signature::ECDSA_P256_SHA256_ASN1, &key)
                .verify(m, &sig)
                .is_ok()
        }),
    });
    cases
}
