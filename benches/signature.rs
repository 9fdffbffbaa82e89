//! Signature verification per scheme, in ns for 1 KiB and 64 KiB bodies, beside raw
//! HMAC-SHA256 of the same bytes measured in the same run. The ratio is the cost of everything
//! that is not the MAC: header parsing, candidate decoding, constant-time comparison.
//!
//! Run: `./scripts/bench signature` (or `cargo bench -p benchmarks --bench signature`).

use std::hint::black_box;
use std::time::Duration;

use benchmarks::paired_ns_per_op;
use hmac::{Hmac, KeyInit, Mac};
use http::HeaderMap;
use sha2::Sha256;
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
        "signature verification vs raw HMAC-SHA256 over the same bytes ({batches} batches, median)"
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
            let (verify_ns, raw_ns) = paired_ns_per_op(
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
                verify_ns,
                raw_ns,
                verify_ns / raw_ns,
                verify_ns / kib as f64
            );
        }
    }
}
