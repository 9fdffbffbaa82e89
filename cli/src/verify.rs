//! `hookctl verify`: "my signature fails", answered. Given the captured headers, the raw body
//! and a source (or a scheme and secret), says valid, or exactly why not.

use std::time::Duration;

use http::HeaderMap;
use sha2::{Digest, Sha256};
use shared::domain::{Scheme, SecretVersion};
use shared::extract::{self, FieldMap};
use shared::secrets::SecretSet;
use shared::signature::{self, VerifyError};

pub struct Check<'a> {
    pub scheme: Scheme,
    pub secrets: &'a SecretSet,
    pub headers: &'a HeaderMap,
    pub body: &'a [u8],
    pub tolerance: Duration,
    /// The moment to check the timestamp against, in Unix seconds.
    pub now: i64,
    /// When checking against a configured source, also read the event's fields as ingest would.
    pub fields: Option<&'a FieldMap>,
    /// The URL the provider called, for the schemes that sign it.
    pub url: Option<&'a str>,
    pub method: &'a str,
    /// The signature a source declares (`scheme = "declared"`), used instead of the scheme's.
    pub declared: Option<&'static shared::catalogue::SignatureSpec>,
    /// The layouts accepted by name (a source's `layouts`); `None`: all but the legacy ones.
    pub layouts: Option<&'a [String]>,
}

/// The verdict and the lines that explain it.
#[derive(Debug)]
pub struct Report {
    pub valid: bool,
    pub lines: Vec<String>,
}

pub fn check(c: &Check<'_>) -> Report {
    let mut lines = vec![format!(
        "scheme {}; body {} bytes, sha256 {}",
        c.scheme,
        c.body.len(),
        hex::encode(Sha256::digest(c.body))
    )];
    for name in signature::signature_headers(c.scheme) {
        if let Some(value) = c.headers.get(*name) {
            lines.push(format!("header {name}: present ({} bytes)", value.len()));
        }
    }
    let secrets_shown = if c.secrets.previous.is_some() {
        "current and previous secrets"
    } else {
        "current secret (no previous)"
    };
    let request = signature::Request {
        headers: c.headers,
        body: c.body,
        method: c.method,
        url: c.url,
    };
    let result = match c.declared {
        Some(spec) => signature::verify_with(spec, &request, c.secrets, c.tolerance, c.now),
        None => signature::verify_accepting(
            c.scheme,
            c.layouts,
            &request,
            c.secrets,
            c.tolerance,
            c.now,
        ),
    };
    let mut valid = result.is_ok();
    match result {
        Ok(verified) => {
            let age = verified
                .timestamp
                .map(|t| {
                    format!(
                        ", signed {} s {} (tolerance {} s)",
                        (c.now - t).abs(),
                        if c.now >= t { "ago" } else { "ahead" },
                        c.tolerance.as_secs()
                    )
                })
                .unwrap_or_default();
            lines.push(format!(
                "VALID: the signature matches the {} secret{age}",
                verified.secret.as_str()
            ));
            if verified.secret == SecretVersion::Previous {
                lines.push("note: the provider still signs with the previous secret; keep it until the provider uses the new one".into());
            }
        }
        Err(error) => {
            lines.push(format!("INVALID: {error}"));
            lines.push(format!("hint: {}", hint(&error, secrets_shown)));
        }
    }
    if valid && let Some(fields) = c.fields {
        match extract::extract(fields, c.headers, c.body) {
            Ok(event) => lines.push(format!(
                "event id {:?}, type {:?}",
                event.external_id.as_str(),
                event.event_type
            )),
            Err(error) => {
                valid = false;
                lines.push(format!(
                    "UNFILEABLE: {error} (ingest answers 400 and records an anomaly)"
                ));
            }
        }
    }
    Report { valid, lines }
}

fn hint(error: &VerifyError, secrets_shown: &str) -> String {
    match error {
        VerifyError::MissingHeader { .. } => {
            "the request was not signed with this scheme, or something between the provider and here dropped the header".into()
        }
        VerifyError::MalformedHeader { .. } => "compare the header with the provider's documented format; it may have been truncated or re-encoded".into(),
        VerifyError::UnreadableBody { .. } => "this scheme reads its signature or a signed part from the body: the body file must be the exact JSON the provider sent".into(),
        VerifyError::UnknownUrl => "this scheme signs the URL the provider called: pass it with --url (or set the source's url)".into(),
        VerifyError::UnusableSecret { .. } => "fix the secret's value in Secrets Manager (or the local secrets file)".into(),
        VerifyError::NoMatch { .. } => format!(
            "checked against the {secrets_shown}. The body file must hold the exact raw bytes as sent: \
             re-serialized JSON, a changed encoding or an added trailing newline all break the signature; \
             otherwise the secret is not this endpoint's"
        ),
        VerifyError::TimestampOutsideTolerance { signature_matched: Some(v), .. } => format!(
            "the signature itself matches the {} secret: the delivery was delayed, replayed, or a clock is wrong \
             (use --at to check it as of capture time)",
            v.as_str()
        ),
        VerifyError::TimestampOutsideTolerance { signature_matched: None, .. } => {
            "the signature does not match either; fix that first".into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shared::secrets::SigningSecret;

    fn signed(secret: &str, ts: i64, body: &[u8]) -> HeaderMap {
        signature::sign(Scheme::Stripe, &SigningSecret::new(secret), "", ts, body)
            .unwrap()
            .into_iter()
            .collect()
    }

    fn run(headers: &HeaderMap, body: &[u8], secrets: &SecretSet, now: i64) -> Report {
        check(&Check {
            scheme: Scheme::Stripe,
            secrets,
            headers,
            body,
            tolerance: Duration::from_secs(300),
            now,
            fields: Some(&FieldMap::defaults_for(Scheme::Stripe)),
            url: None,
            method: "POST",
            declared: None,
            layouts: None,
        })
    }

    #[test]
    fn explains_each_verdict() {
        let body = br#"{"id":"evt_1","type":"charge.succeeded"}"#;
        let set = SecretSet::new("new", Some("old".into()));
        let ok = run(&signed("old", 1000, body), body, &set, 1010);
        assert!(ok.valid);
        assert!(ok.lines.iter().any(|l| l == "VALID: the signature matches the previous secret, signed 10 s ago (tolerance 300 s)"), "{:?}", ok.lines);
        assert!(
            ok.lines
                .iter()
                .any(|l| l == "event id \"evt_1\", type \"charge.succeeded\"")
        );

        let stale = run(&signed("new", 1000, body), body, &set, 1500);
        assert!(!stale.valid);
        assert!(
            stale
                .lines
                .iter()
                .any(|l| l == "INVALID: timestamp 200 s older than the tolerance of 300 s"),
            "{:?}",
            stale.lines
        );
        assert!(
            stale
                .lines
                .iter()
                .any(|l| l.contains("matches the current secret"))
        );

        let mut changed = body.to_vec();
        changed.push(b'\n');
        let no_match = run(&signed("new", 1000, body), &changed, &set, 1000);
        assert!(
            no_match
                .lines
                .iter()
                .any(|l| l.starts_with("INVALID: no candidate matches"))
        );
        assert!(
            no_match
                .lines
                .iter()
                .any(|l| l.contains("trailing newline"))
        );

        let unfileable = run(&signed("new", 1000, b"[]"), b"[]", &set, 1000);
        assert!(!unfileable.valid);
        assert!(
            unfileable
                .lines
                .iter()
                .any(|l| l.starts_with("UNFILEABLE: no event id")),
            "{:?}",
            unfileable.lines
        );
    }
}
