//! Instructions per verification, counted rather than timed: `./scripts/bench
//! signature-instructions` runs this under valgrind's callgrind for each HMAC primitive, once
//! with N verifications and once with 2N, through the catalogue and as the raw library call
//! (`Mac::verify_slice`, as `benches/signature.rs` times it), and prints the difference per
//! verification. A count is the same on every run of the same binary whatever else the machine
//! is doing, so it shows what a change to the dispatch saved where the timed ratio
//! (`./scripts/bench signature`, limit 1.10x) moves with the machine's load.
//!
//! Under valgrind the CPU's SHA extensions are not offered, so the primitive runs the portable
//! SHA code and its count is far above what the hardware path takes: the figure to read is
//! the catalogue's count less the raw call's (the dispatch's own instructions), not their
//! ratio.
//!
//! Run by hand: `signature_instructions <hmac-sha256|hmac-sha1|hmac-sha512> <catalogue|raw> <N>`.

use std::hint::black_box;
use std::time::Duration;

use hmac::{Hmac, KeyInit, Mac};
use http::HeaderMap;
use shared::catalogue::SignatureSpec;
use shared::domain::Scheme;
use shared::secrets::{SecretSet, SigningSecret};
use shared::signature;

/// The raw library call: key, signed bytes, expected tag.
type RawCall = fn(&[u8], &[u8], &[u8]);

const SECRET: &str = "bench-secret-key-0123456789";
const NOW: i64 = 1_700_000_000;

#[inline(never)]
fn through(layout: &'static SignatureSpec, headers: &HeaderMap, body: &[u8], s: &SecretSet) {
    let request = signature::Request::post(black_box(headers), black_box(body));
    let verified = signature::verify_with(layout, &request, s, Duration::from_secs(300), NOW);
    assert!(verified.is_ok());
}

#[inline(never)]
fn raw<M: Mac + KeyInit>(key: &[u8], body: &[u8], expected: &[u8]) {
    let mut mac = <M as KeyInit>::new_from_slice(black_box(key)).unwrap();
    mac.update(black_box(body));
    assert!(mac.verify_slice(expected).is_ok());
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, case, side, n] = args.as_slice() else {
        eprintln!(
            "usage: signature_instructions <hmac-sha256|hmac-sha1|hmac-sha512> <catalogue|raw> <N>"
        );
        std::process::exit(2);
    };
    let n: usize = n.parse().expect("N is a count");
    let body: Vec<u8> = (0..1024).map(|i| b'a' + (i % 26) as u8).collect();
    let secrets = SecretSet::new(SECRET.to_owned(), None);
    let signing = |layout: &'static SignatureSpec| -> HeaderMap {
        signature::sign_with(
            layout,
            &SigningSecret::new(SECRET),
            &signature::Signing {
                message_id: "",
                timestamp: NOW,
                body: &body,
                method: "POST",
                url: None,
            },
        )
        .unwrap()
        .into_iter()
        .collect()
    };
    // The layouts `benches/signature.rs` times: GitHub's, Intercom's, and a declared SHA-512
    // one (no catalogue entry signs with SHA-512).
    let (layout, expected, raw_call): (&'static SignatureSpec, Vec<u8>, RawCall) =
        match case.as_str() {
            "hmac-sha256" => (
                &Scheme::Github.provider().signatures[0],
                benchmarks::hmac_tag::<Hmac<sha2::Sha256>>(SECRET.as_bytes(), &body),
                raw::<Hmac<sha2::Sha256>>,
            ),
            "hmac-sha1" => (
                &Scheme::Intercom.provider().signatures[0],
                benchmarks::hmac_tag::<Hmac<sha1::Sha1>>(SECRET.as_bytes(), &body),
                raw::<Hmac<sha1::Sha1>>,
            ),
            "hmac-sha512" => (
                benchmarks::declared_sha512(),
                benchmarks::hmac_tag::<Hmac<sha2::Sha512>>(SECRET.as_bytes(), &body),
                raw::<Hmac<sha2::Sha512>>,
            ),
            other => panic!("unknown case {other}"),
        };
    let headers = signing(layout);
    // Both sides are set up whatever is counted, so the setup cancels out of N against 2N.
    through(layout, &headers, &body, &secrets);
    raw_call(SECRET.as_bytes(), &body, &expected);
    for _ in 0..n {
        match side.as_str() {
            "catalogue" => through(layout, &headers, &body, &secrets),
            "raw" => raw_call(SECRET.as_bytes(), &body, &expected),
            other => panic!("unknown side {other}"),
        }
    }
}
