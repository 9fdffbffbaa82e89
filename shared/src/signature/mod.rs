//! Signature verification over the exact raw request bytes, for every provider of the
//! catalogue (`crate::catalogue`).
//!
//! An entry describes its signature with a few primitives: where the signature is (a header,
//! with a prefix, `key=value` items or `<version>,<sig>` entries, or a JSON field), how it is
//! encoded, which parts are signed (body, timestamp, headers, JSON fields, URL, method, sorted
//! form parameters), and how it is made (HMAC-SHA1/256/512, a plain digest, Ed25519, ECDSA
//! P-256, or a shared token). Verification is the same for all of them: each of the source's
//! secrets (current, then previous) against every candidate in constant time, then the
//! timestamp window in both directions. The files beside this one name each provider's headers
//! and keep the unit tests of the five schemes written before the catalogue.

pub mod github;
mod plain;
pub mod shopify;
pub mod slack;
pub mod standard_webhooks;
pub mod stripe;
pub mod vectors;

use std::borrow::Cow;
use std::time::Duration;

use hmac::{Hmac, KeyInit, Mac};
use http::{HeaderMap, HeaderName, HeaderValue};
use sha2::{Digest, Sha256, Sha512};
use subtle::ConstantTimeEq;

use crate::catalogue::{
    Encoding, Hash, Kind, ParsedName, Part, SecretEncoding, SignatureSpec, TimestampFormat,
};
use crate::domain::{Scheme, SecretVersion};
use crate::secrets::{SecretSet, SigningSecret};

/// A signature header longer than this is rejected before any parsing.
const MAX_HEADER_LEN: usize = 8 * 1024;
/// More candidate signatures than this in one delivery is not a rotation, it is an attack.
const MAX_CANDIDATES: usize = 16;

/// A delivery as the provider sent it: what a signature can cover.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub headers: &'a HeaderMap,
    /// The raw body bytes, exactly as signed.
    pub body: &'a [u8],
    /// The HTTP method, upper case.
    pub method: &'a str,
    /// The full URL the provider called (`https://host/path?query`), when known: the schemes
    /// that sign it (Twilio, Square, HubSpot v2/v3) cannot verify without it.
    pub url: Option<&'a str>,
}

impl<'a> Request<'a> {
    /// A POST whose URL is not known.
    pub fn post(headers: &'a HeaderMap, body: &'a [u8]) -> Self {
        Self {
            headers,
            body,
            method: "POST",
            url: None,
        }
    }
}

/// What a delivery's headers claim was signed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedMessage {
    /// Unix seconds, for schemes that sign a timestamp.
    pub timestamp: Option<i64>,
    /// The timestamp exactly as sent (what is signed).
    pub raw_timestamp: Option<String>,
    /// Every signature the delivery carries, decoded.
    pub candidates: Candidates,
    /// The headers whose values the signature covers. A value read from any other header (an
    /// event id, say) can be changed by whoever holds one signed delivery.
    pub signed_headers: &'static [String],
}

/// The longest signature kept without a heap allocation: SHA-512's 64 bytes, Ed25519's 64, and
/// a P-256 DER signature's at most 72. Only a shared token is longer.
const INLINE_CANDIDATE: usize = 72;

/// One signature a delivery carries, decoded.
#[derive(Clone, PartialEq, Eq)]
pub enum Candidate {
    Inline {
        bytes: [u8; INLINE_CANDIDATE],
        len: u8,
    },
    Heap(Vec<u8>),
}

impl Candidate {
    fn of(bytes: &[u8]) -> Self {
        if bytes.len() <= INLINE_CANDIDATE {
            let mut inline = [0u8; INLINE_CANDIDATE];
            inline[..bytes.len()].copy_from_slice(bytes);
            Self::Inline {
                bytes: inline,
                len: bytes.len() as u8,
            }
        } else {
            Self::Heap(bytes.to_vec())
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        match self {
            Self::Inline { bytes, len } => &bytes[..usize::from(*len)],
            Self::Heap(bytes) => bytes,
        }
    }
}

impl std::fmt::Debug for Candidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Candidate({})", hex::encode(self.as_slice()))
    }
}

/// The signatures of one delivery, in order: the first (usually the only one) held inline, so
/// reading a delivery's signature allocates nothing; a rotation's second and later ones after it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Candidates {
    first: Option<Candidate>,
    rest: Vec<Candidate>,
}

impl Candidates {
    fn push(&mut self, candidate: Candidate) {
        if self.first.is_none() {
            self.first = Some(candidate);
        } else {
            self.rest.push(candidate);
        }
    }

    pub fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.rest.len()
    }

    pub fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    pub fn iter(&self) -> impl Iterator<Item = &[u8]> {
        self.first
            .iter()
            .chain(self.rest.iter())
            .map(Candidate::as_slice)
    }
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
    /// The signature, or a signed part, is read from the body, and the body does not have it.
    #[error("the body cannot be verified: {reason}")]
    UnreadableBody { reason: String },
    /// The scheme signs the URL the provider called, and none is known.
    #[error(
        "this scheme signs the URL the provider called, and it is not known (set the source's url)"
    )]
    UnknownUrl,
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
            VerifyError::UnreadableBody { .. } => "unreadable_body",
            VerifyError::UnknownUrl => "unknown_url",
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
    pub signed_headers: &'static [String],
    /// For a layout that signs values rather than the raw body (Twilio's URL and sorted form,
    /// Mailgun's timestamp and token, Adyen's item fields): the SHA-256 of the signed string,
    /// which is what the signature binds. Bytes re-encoded around the same signed string
    /// (form fields reordered, a trailing `&`, other event data beside Mailgun's token) have
    /// this digest, so the replay guard claims it instead of the raw bytes' digest. `None` for
    /// a layout that signs the body (the raw bytes are what it binds) or nothing (a token).
    pub signed_digest: Option<[u8; 32]>,
    /// The layout that verified it.
    pub layout: &'static SignatureSpec,
}

impl Verified {
    /// Whether a value read from header `name` is covered by the signature.
    pub fn signs_header(&self, name: &str) -> bool {
        self.signed_headers.iter().any(|h| h == name)
    }
}

/// Verifies `body` as delivered with `headers` (a POST whose URL is not known) against the
/// source's secrets. `now_unix` is the current time in Unix seconds.
pub fn verify(
    scheme: Scheme,
    headers: &HeaderMap,
    body: &[u8],
    secrets: &SecretSet,
    tolerance: Duration,
    now_unix: i64,
) -> Result<Verified, VerifyError> {
    verify_request(
        scheme,
        &Request::post(headers, body),
        secrets,
        tolerance,
        now_unix,
    )
}

/// Verifies a delivery under its provider's signature layout (of those a source accepts by
/// default: every one but the legacy ones).
pub fn verify_request(
    scheme: Scheme,
    request: &Request<'_>,
    secrets: &SecretSet,
    tolerance: Duration,
    now_unix: i64,
) -> Result<Verified, VerifyError> {
    verify_accepting(scheme, None, request, secrets, tolerance, now_unix)
}

/// Verifies a delivery under the layout of its provider that applies to it, among those
/// `accepted` names (a source's `layouts`; `None`: every layout but the legacy ones).
pub fn verify_accepting(
    scheme: Scheme,
    accepted: Option<&[String]>,
    request: &Request<'_>,
    secrets: &SecretSet,
    tolerance: Duration,
    now_unix: i64,
) -> Result<Verified, VerifyError> {
    verify_with(
        layout_accepting(scheme, accepted, request)?,
        request,
        secrets,
        tolerance,
        now_unix,
    )
}

/// Verifies a delivery under one signature layout (a catalogue entry's, or a declared one).
pub fn verify_with(
    spec: &'static SignatureSpec,
    request: &Request<'_>,
    secrets: &SecretSet,
    tolerance: Duration,
    now_unix: i64,
) -> Result<Verified, VerifyError> {
    match plain::verify(spec, request, secrets) {
        Some(answer) => answer,
        None => verify_read(spec, request, secrets, tolerance, now_unix),
    }
}

/// [`verify_with`] by the general reading of the layout: every layout, every error.
fn verify_read(
    spec: &'static SignatureSpec,
    request: &Request<'_>,
    secrets: &SecretSet,
    tolerance: Duration,
    now_unix: i64,
) -> Result<Verified, VerifyError> {
    let signed = read(spec, request.headers, request.body)?;
    let body_covered = body_digest_matches(spec, request)?;
    let urls = match request.url {
        Some(url) if spec.url_variants || !spec.url_decoded.is_empty() => {
            let mut forms = if spec.url_variants {
                url_variants(url)
            } else {
                vec![url.to_owned()]
            };
            let decoded: Vec<String> = forms
                .iter()
                .map(|form| url_decoded(form, &spec.url_decoded))
                .collect();
            for form in decoded {
                if !forms.contains(&form) {
                    forms.push(form);
                }
            }
            forms
        }
        _ => Vec::new(),
    };
    let mut matched = None;
    let mut tried = 0;
    'secrets: for (version, secret) in secrets.candidates() {
        tried += 1;
        if matches(spec, secret, request, &signed)? && body_covered {
            matched = Some(version);
            break;
        }
        // The URL as given was tried above: its other forms, in turn.
        for url in urls.iter().skip(1) {
            let other = Request {
                url: Some(url),
                ..*request
            };
            if matches(spec, secret, &other, &signed)? && body_covered {
                matched = Some(version);
                break 'secrets;
            }
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
            signed_digest: signed_digest(spec, request, &signed, secrets)?,
            layout: spec,
        }),
        None => Err(VerifyError::NoMatch {
            candidates: signed.candidates.len(),
            secrets: tried,
        }),
    }
}

/// The layout of `scheme` that applies to this delivery, of those a source accepts by default
/// ([`layout_accepting`]).
pub fn layout(
    scheme: Scheme,
    request: &Request<'_>,
) -> Result<&'static SignatureSpec, VerifyError> {
    layout_accepting(scheme, None, request)
}

/// The layout of `scheme` that applies to this delivery, among those `accepted` names (`None`:
/// every layout but the legacy ones): the first, in the entry's order (strongest first), whose
/// `when` holds (or, without one, whose signature is present); the first accepted when none
/// does, so its errors are the ones reported. A request that carries a stronger layout's
/// signature is verified with that one, and a legacy layout a source does not accept is never
/// tried: a captured request stripped of its stronger signature is refused.
pub fn layout_accepting(
    scheme: Scheme,
    accepted: Option<&[String]>,
    request: &Request<'_>,
) -> Result<&'static SignatureSpec, VerifyError> {
    choose_layout(layouts(scheme)?, accepted, request)
}

/// [`layout_accepting`] among `specs`, an entry's layouts in its order (a catalogue entry's,
/// or a draft's that `hookctl providers check` reads).
pub fn choose_layout(
    specs: &'static [SignatureSpec],
    accepted: Option<&[String]>,
    request: &Request<'_>,
) -> Result<&'static SignatureSpec, VerifyError> {
    if let ([only], None) = (specs, accepted) {
        // One layout: nothing to choose (and no header looked up twice).
        if !only.legacy {
            return Ok(only);
        }
    }
    let mut candidates = specs.iter().filter(|spec| accepts(spec, accepted));
    let first = candidates
        .clone()
        .next()
        .ok_or_else(|| VerifyError::UnusableSecret {
            reason: format!(
                "the source accepts none of the provider's layouts ({})",
                accepted.map(|names| names.join(", ")).unwrap_or_default()
            ),
        })?;
    Ok(candidates
        .find(|spec| applies(spec, request))
        .unwrap_or(first))
}

/// Whether a source that accepts `accepted` accepts the layout.
fn accepts(spec: &SignatureSpec, accepted: Option<&[String]>) -> bool {
    match accepted {
        Some(names) => spec.name.as_ref().is_some_and(|name| names.contains(name)),
        None => !spec.legacy,
    }
}

/// The scheme's layouts, at least one: every catalogue entry has one, and `declared` has none
/// of its own (a source that declares its signature is verified with it: [`verify_with`]).
fn layouts(scheme: Scheme) -> Result<&'static [SignatureSpec], VerifyError> {
    let specs = scheme.provider().signatures.as_slice();
    if specs.is_empty() {
        return Err(VerifyError::UnusableSecret {
            reason: format!("scheme {scheme} has no signature of its own: the source declares it"),
        });
    }
    Ok(specs)
}

fn applies(spec: &SignatureSpec, request: &Request<'_>) -> bool {
    let (headers, body) = (request.headers, request.body);
    match (&spec.when, &spec.header, &spec.json) {
        (Some(when), _, _) => match (&when.header, &when.equals, &when.query) {
            (Some(name), Some(value), _) => headers
                .get(name.as_str())
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.trim() == value),
            (Some(name), None, _) => headers.contains_key(name.as_str()),
            (None, _, Some(param)) => query_param(request.url, param).is_some(),
            (None, _, None) => false,
        },
        (None, Some(header), _) => match spec.header_name.get(header) {
            Some(name) => headers.contains_key(name),
            None => false,
        },
        (None, None, Some(pointer)) => serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .is_some_and(|v| v.pointer(pointer).is_some()),
        (None, None, None) => false,
    }
}

/// Reads a scheme's signature and timestamp from a delivery (the layout that applies to it).
pub fn parse(scheme: Scheme, headers: &HeaderMap) -> Result<SignedMessage, VerifyError> {
    read(layout(scheme, &Request::post(headers, b""))?, headers, b"")
}

/// A query parameter of the URL, decoded.
fn query_param(url: Option<&str>, name: &str) -> Option<String> {
    let (_, query) = url?.split_once('?')?;
    let query = query.split('#').next().unwrap_or_default();
    url::form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
}

/// The URLs a signature over `url` may have been computed with, for a layout whose provider's
/// `url` with each of `encodings` (`%3A`, exactly as listed) replaced by the character it
/// encodes, in one pass from the left: what a provider that decodes them before signing signed
/// (HubSpot v3). Anything else, `%3a` and `%20` included, stays as it came.
fn url_decoded(url: &str, encodings: &[String]) -> String {
    if encodings.is_empty() {
        return url.to_owned();
    }
    let mut out = String::with_capacity(url.len());
    let mut rest = url;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let candidate = rest.get(at..at + 3);
        let decoded = candidate
            .filter(|c| encodings.iter().any(|e| e == c))
            .and_then(|c| u8::from_str_radix(&c[1..], 16).ok())
            .filter(u8::is_ascii);
        match decoded {
            Some(byte) => {
                out.push(char::from(byte));
                rest = &rest[at + 3..];
            }
            None => {
                out.push('%');
                rest = &rest[at + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// SDKs accept several forms of one URL (Twilio's `url_variants`): the URL as given; with its
/// port removed, or, without one, with the scheme's default port added after the host (and after
/// any credentials: `https://user:pass@host:443/...`), as twilio-python's and twilio-node's
/// validators try; and each with a `'` in the query written `%27`, or a `%27` written `'` (Node's
/// URL class escapes it, its older query string did not). The given URL first; no duplicates.
fn url_variants(url: &str) -> Vec<String> {
    let mut forms = vec![url.to_owned()];
    if let Some((scheme, rest)) = url.split_once("://") {
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (userinfo, hostport) = match authority.rfind('@') {
            Some(at) => authority.split_at(at + 1),
            None => ("", authority),
        };
        // A port follows the last ':' that is not inside an IPv6 literal's brackets.
        let port_at = hostport
            .rfind(':')
            .filter(|&colon| !hostport[colon..].contains(']'));
        match port_at {
            Some(colon) => {
                forms.push(format!("{scheme}://{userinfo}{}{tail}", &hostport[..colon]));
            }
            None => {
                let default = match scheme.to_ascii_lowercase().as_str() {
                    "https" => Some("443"),
                    "http" => Some("80"),
                    _ => None,
                };
                if let Some(port) = default {
                    forms.push(format!("{scheme}://{userinfo}{hostport}:{port}{tail}"));
                }
            }
        }
    }
    for i in 0..forms.len() {
        let Some(q) = forms[i].find('?') else {
            continue;
        };
        let (head, query) = forms[i].split_at(q);
        let quoted: Vec<String> = [("'", "%27"), ("%27", "'")]
            .into_iter()
            .filter(|(from, _)| query.contains(from))
            .map(|(from, to)| format!("{head}{}", query.replace(from, to)))
            .collect();
        forms.extend(quoted);
    }
    let mut seen = std::collections::HashSet::new();
    forms.retain(|form| seen.insert(form.clone()));
    forms
}

/// The body covered through the signed URL (Twilio's `bodySHA256`): its digest must be there.
fn body_digest_matches(spec: &SignatureSpec, request: &Request<'_>) -> Result<bool, VerifyError> {
    let Some(param) = &spec.body_sha256_query else {
        return Ok(true);
    };
    let url = request.url.ok_or(VerifyError::UnknownUrl)?;
    let claimed = query_param(Some(url), param).ok_or_else(|| VerifyError::UnreadableBody {
        reason: format!("the URL carries no {param} for the body"),
    })?;
    Ok(claimed.eq_ignore_ascii_case(&hex::encode(Sha256::digest(request.body))))
}

/// Why a header held no signature to check: the first candidate that did not decode, else
/// `missing`.
fn none_decoded(
    undecodable: &mut Option<VerifyError>,
    place: &'static str,
    missing: String,
) -> VerifyError {
    undecodable
        .take()
        .unwrap_or_else(|| malformed(place, missing))
}

fn read(
    spec: &'static SignatureSpec,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<SignedMessage, VerifyError> {
    // The signature's bytes: a header's are ASCII (checked), a JSON field's are text.
    let (place, value): (&'static str, Cow<'_, [u8]>) = match (&spec.header, &spec.json) {
        (Some(name), _) => (
            name.as_str(),
            Cow::Borrowed(header_parsed(headers, &spec.header_name, name)?),
        ),
        (None, Some(pointer)) => (
            pointer.as_str(),
            Cow::Owned(json_text(body, pointer)?.into_bytes()),
        ),
        (None, None) => return Err(unplaced()),
    };
    let expected = expected_len(spec);
    let mut candidates = Candidates::default();
    // A signature among several that does not decode (Paddle's SDK tests send `h1=dummy` before
    // the real one) is skipped, as the providers' SDKs skip it; it is the error only when no
    // other decodes.
    let mut undecodable: Option<VerifyError> = None;
    let mut take =
        |candidates: &mut Candidates, decoded: Result<Candidate, VerifyError>| match decoded {
            Ok(candidate) => {
                candidates.push(candidate);
                check_candidate_count(place, candidates.len())
            }
            Err(error) => {
                undecodable.get_or_insert(error);
                Ok(())
            }
        };
    let mut item_timestamp: Option<&str> = None;
    if let Some(items) = spec.items.as_ref().filter(|i| i.timestamp_first) {
        let mut parts = text(place, &value)?
            .split(items.separator.as_str())
            .map(str::trim);
        let timestamp = parts
            .next()
            .filter(|t| !t.is_empty())
            .ok_or_else(|| malformed(place, "no timestamp first".to_owned()))?;
        if let Some(ts) = &spec.timestamp {
            parse_timestamp(place, timestamp, ts.format)?;
        }
        item_timestamp = Some(timestamp);
        for signature in parts.filter(|p| !p.is_empty()) {
            take(
                &mut candidates,
                decode(spec, place, signature.as_bytes(), expected),
            )?;
        }
        if candidates.is_empty() {
            return Err(none_decoded(
                &mut undecodable,
                place,
                "no signature after the timestamp".to_owned(),
            ));
        }
    } else if let Some(items) = &spec.items {
        for item in text(place, &value)?
            .split(items.separator.as_str())
            .map(str::trim)
        {
            let (key, val) = item.split_once(items.pair.as_str()).ok_or_else(|| {
                malformed(
                    place,
                    format!("item {:?} is not key{}value", excerpt(item), items.pair),
                )
            })?;
            if items.timestamp.as_deref() == Some(key) {
                if item_timestamp.is_some() {
                    return Err(malformed(
                        place,
                        format!("more than one {key}{}", items.pair),
                    ));
                }
                if let Some(ts) = &spec.timestamp {
                    parse_timestamp(place, val, ts.format)?;
                }
                item_timestamp = Some(val);
            } else if key == items.signature {
                take(
                    &mut candidates,
                    decode(spec, place, val.as_bytes(), expected),
                )?;
            }
            // Other keys (Stripe's v0, schemes added later) are not ours to check.
        }
        if let (Some(key), true) = (&items.timestamp, item_timestamp.is_none()) {
            return Err(malformed(
                place,
                format!("no {key}{} timestamp", items.pair),
            ));
        }
        if candidates.is_empty() {
            return Err(none_decoded(
                &mut undecodable,
                place,
                format!("no {}{} signature", items.signature, items.pair),
            ));
        }
    } else if let Some(versions) = &spec.versions {
        for entry in text(place, &value)?
            .split(versions.separator.as_str())
            .filter(|e| !e.is_empty())
        {
            let (version, signature) =
                entry.split_once(versions.pair.as_str()).ok_or_else(|| {
                    malformed(
                        place,
                        format!("entry is not <version>{}<signature>", versions.pair),
                    )
                })?;
            // Other versions (v1a: asymmetric) are another layout's; skip them.
            if version == versions.version {
                take(
                    &mut candidates,
                    decode(spec, place, signature.as_bytes(), expected),
                )?;
            }
        }
        if candidates.is_empty() {
            return Err(none_decoded(
                &mut undecodable,
                place,
                format!("no {} signature", versions.version),
            ));
        }
    } else {
        // The plain layout reads bytes: no UTF-8 pass over a value already known to be ASCII.
        let encoded = value
            .strip_prefix(spec.prefix.as_bytes())
            .ok_or_else(|| malformed(place, format!("does not start with {}", spec.prefix)))?;
        candidates.push(decode(spec, place, encoded, expected)?);
    }

    let (timestamp, raw_timestamp) = match &spec.timestamp {
        None => (None, None),
        Some(ts) => {
            let (from, raw): (&'static str, Cow<'_, str>) = if ts.item {
                (place, Cow::Borrowed(item_timestamp.unwrap_or_default()))
            } else if let Some(name) = &ts.header {
                (
                    name.as_str(),
                    Cow::Borrowed(text(
                        name.as_str(),
                        header_parsed(headers, &ts.header_name, name)?,
                    )?),
                )
            } else if let Some(pointer) = &ts.json {
                (pointer.as_str(), Cow::Owned(json_text(body, pointer)?))
            } else {
                return Err(unplaced());
            };
            let unix = parse_timestamp(from, &raw, ts.format)?;
            (Some(unix), Some(raw.into_owned()))
        }
    };
    Ok(SignedMessage {
        timestamp,
        raw_timestamp,
        candidates,
        signed_headers: &spec.signed_headers,
    })
}

/// A layout that does not say where its signature or timestamp is. `catalogue::validate`
/// refuses one, and every catalogue entry and declared layout is validated when loaded; this
/// answers a layout built some other way.
fn unplaced() -> VerifyError {
    VerifyError::UnusableSecret {
        reason: "the signature layout names no header or field to read".into(),
    }
}

/// Whether `secret` made one of the delivery's candidates.
fn matches(
    spec: &'static SignatureSpec,
    secret: &SigningSecret,
    request: &Request<'_>,
    signed: &SignedMessage,
) -> Result<bool, VerifyError> {
    let any = |tag: &[u8]| {
        // Compare against every candidate without stopping early on a mismatch.
        bool::from(
            signed
                .candidates
                .iter()
                .fold(subtle::Choice::from(0), |acc, c| acc | same(tag, c)),
        )
    };
    let parts = Parts {
        spec,
        request,
        signed,
        secret,
    };
    match spec.kind {
        Kind::Hmac => {
            let key = key(spec.secret, secret)?;
            hmac(hash_of(spec), &key, parts, any)
        }
        Kind::Digest => digest(hash_of(spec), parts, any),
        Kind::Token => Ok(any(secret.expose().as_bytes())),
        Kind::Ed25519 | Kind::EcdsaP256 => {
            let public_key = public_key(spec, secret)?;
            let message = parts.message()?;
            let algorithm: &'static dyn ring::signature::VerificationAlgorithm =
                if spec.kind == Kind::Ed25519 {
                    &ring::signature::ED25519
                } else {
                    &ring::signature::ECDSA_P256_SHA256_ASN1
                };
            let key = ring::signature::UnparsedPublicKey::new(algorithm, &public_key);
            Ok(signed
                .candidates
                .iter()
                .any(|candidate| key.verify(&message, candidate).is_ok()))
        }
    }
}

/// The digest of what `spec` signs, when it signs values rather than the raw body
/// ([`SignatureSpec::binds_signed_values`]); see [`Verified::signed_digest`].
fn signed_digest(
    spec: &'static SignatureSpec,
    request: &Request<'_>,
    signed: &SignedMessage,
    secrets: &SecretSet,
) -> Result<Option<[u8; 32]>, VerifyError> {
    if !spec.binds_signed_values() {
        return Ok(None);
    }
    // Such a layout signs no `{secret}` (only a digest does): the secret is never read.
    let parts = Parts {
        spec,
        request,
        signed,
        secret: &secrets.current,
    };
    let mut hasher = Sha256::new();
    parts.feed(&mut |part: &[u8]| Digest::update(&mut hasher, part))?;
    Ok(Some(hasher.finalize().into()))
}

/// Whether two tags are equal, in time that depends only on their lengths (which are public):
/// every byte pair is XORed into one accumulator with no branch on the bytes, and only the
/// accumulator goes through `subtle`'s barrier (its slice comparison puts one on every byte).
fn same(tag: &[u8], candidate: &[u8]) -> subtle::Choice {
    if tag.len() != candidate.len() {
        return subtle::Choice::from(0);
    }
    let difference = tag
        .iter()
        .zip(candidate)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    difference.ct_eq(&0)
}

fn hash_of(spec: &SignatureSpec) -> Hash {
    // `catalogue::validate` requires a hash of hmac and digest layouts.
    spec.hash.unwrap_or(Hash::Sha256)
}

/// One delivery's signed bytes under one secret, as its layout lists them.
#[derive(Clone, Copy)]
struct Parts<'a> {
    spec: &'static SignatureSpec,
    request: &'a Request<'a>,
    signed: &'a SignedMessage,
    secret: &'a SigningSecret,
}

/// Signed bytes as a MAC or a digest takes them: part by part, in order, borrowed where they
/// can be, never gathered into one buffer. The sink is generic, so each MAC's `update` is
/// called directly.
trait Signed {
    fn feed(&self, sink: &mut impl FnMut(&[u8])) -> Result<(), VerifyError>;
}

/// The body alone, as the plain layout signs it ([`plain`]).
impl Signed for &[u8] {
    fn feed(&self, sink: &mut impl FnMut(&[u8])) -> Result<(), VerifyError> {
        sink(self);
        Ok(())
    }
}

impl Signed for Parts<'_> {
    /// The parts the layout lists.
    fn feed(&self, sink: &mut impl FnMut(&[u8])) -> Result<(), VerifyError> {
        let Self {
            spec,
            request,
            signed,
            secret,
        } = *self;
        let mut json: Option<serde_json::Value> = None;
        for part in &spec.signed {
            match part {
                Part::Literal(text) => sink(text.as_bytes()),
                Part::Body => sink(request.body),
                Part::Timestamp => sink(
                    signed
                        .raw_timestamp
                        .as_deref()
                        .unwrap_or_default()
                        .as_bytes(),
                ),
                Part::Header(name) => sink(header(request.headers, name.as_str())?),
                Part::Json(pointer) => {
                    if json.is_none() {
                        json = Some(serde_json::from_slice(request.body).map_err(|_| {
                            VerifyError::UnreadableBody {
                                reason: "it is not JSON".into(),
                            }
                        })?);
                    }
                    // A field the body does not carry is signed as empty text (Adyen: "if a
                    // field is empty, use an empty string"); the signature must still match.
                    let value = json.as_ref().and_then(|v| v.pointer(pointer));
                    sink(value.map(value_text).unwrap_or_default().as_bytes());
                }
                Part::Url => sink(request.url.ok_or(VerifyError::UnknownUrl)?.as_bytes()),
                Part::Method => sink(request.method.as_bytes()),
                Part::FormSorted => sink(&form_sorted(request.body)),
                Part::Secret => sink(secret.expose().as_bytes()),
            }
        }
        Ok(())
    }
}

impl Parts<'_> {
    /// The signed bytes in one buffer, for the public-key schemes (their verifiers take one
    /// slice).
    fn message(&self) -> Result<Vec<u8>, VerifyError> {
        let mut out = Vec::with_capacity(self.request.body.len() + 64);
        self.feed(&mut |part| out.extend_from_slice(part))?;
        Ok(out)
    }
}

/// Form parameters sorted by name (then value), each name followed by its value, as Twilio
/// signs them.
fn form_sorted(body: &[u8]) -> Vec<u8> {
    let mut pairs: Vec<(String, String)> = url::form_urlencoded::parse(body)
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    pairs.sort();
    pairs.dedup();
    let mut out = Vec::new();
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.extend_from_slice(v.as_bytes());
    }
    out
}

fn value_text(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(text) => text.clone(),
        serde_json::Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn json_text(body: &[u8], pointer: &str) -> Result<String, VerifyError> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|_| VerifyError::UnreadableBody {
            reason: "it is not JSON".into(),
        })?;
    let found = value
        .pointer(pointer)
        .ok_or_else(|| VerifyError::UnreadableBody {
            reason: format!("no {pointer}"),
        })?;
    Ok(value_text(found))
}

macro_rules! hmac_over {
    ($digest:ty, $key:expr, $parts:expr, $then:expr) => {{
        let mut mac =
            <Hmac<$digest> as KeyInit>::new_from_slice($key).expect("HMAC takes any key length");
        $parts.feed(&mut |part: &[u8]| mac.update(part))?;
        $then(&mac.finalize().into_bytes())
    }};
}

macro_rules! digest_over {
    ($digest:ty, $parts:expr, $then:expr) => {{
        let mut hasher = <$digest>::new();
        $parts.feed(&mut |part: &[u8]| Digest::update(&mut hasher, part))?;
        $then(&hasher.finalize())
    }};
}

/// The HMAC of the signed parts, handed to `then` where the MAC leaves it: verifying compares
/// it there, with no copy into a buffer of the longest MAC's size that the comparison would
/// then read back (a read of bytes just stored in other widths, which the CPU cannot forward:
/// about an eighth of the verification's own samples in `perf record`, 2026-12-03; the timed
/// ratio could not show the difference).
fn hmac<R>(
    hash: Hash,
    key: &[u8],
    parts: impl Signed,
    then: impl FnOnce(&[u8]) -> R,
) -> Result<R, VerifyError> {
    Ok(match hash {
        Hash::Sha1 => hmac_over!(sha1::Sha1, key, parts, then),
        Hash::Sha256 => hmac_over!(Sha256, key, parts, then),
        Hash::Sha512 => hmac_over!(Sha512, key, parts, then),
    })
}

/// The digest of the signed parts, handed to `then` as [`hmac`] hands its MAC.
fn digest<R>(
    hash: Hash,
    parts: impl Signed,
    then: impl FnOnce(&[u8]) -> R,
) -> Result<R, VerifyError> {
    Ok(match hash {
        Hash::Sha1 => digest_over!(sha1::Sha1, parts, then),
        Hash::Sha256 => digest_over!(Sha256, parts, then),
        Hash::Sha512 => digest_over!(Sha512, parts, then),
    })
}

/// The HMAC key the configured secret text encodes.
fn key(encoding: SecretEncoding, secret: &SigningSecret) -> Result<Cow<'_, [u8]>, VerifyError> {
    use base64::Engine as _;
    let text = secret.expose();
    let unusable = |reason: &str| VerifyError::UnusableSecret {
        reason: reason.into(),
    };
    match encoding {
        SecretEncoding::Utf8 => Ok(Cow::Borrowed(text.as_bytes())),
        SecretEncoding::Base64 => base64::engine::general_purpose::STANDARD
            .decode(text.trim())
            .map(Cow::Owned)
            .map_err(|_| unusable("this scheme's secret is base64")),
        SecretEncoding::Whsec => base64::engine::general_purpose::STANDARD
            .decode(text.strip_prefix("whsec_").unwrap_or(text))
            .map(Cow::Owned)
            .map_err(|_| unusable("a Standard Webhooks secret is whsec_ followed by base64")),
        SecretEncoding::Hex => hex::decode(text.trim())
            .map(Cow::Owned)
            .map_err(|_| unusable("this scheme's secret is hexadecimal")),
        SecretEncoding::Pem | SecretEncoding::Whpk => {
            Err(unusable("a public key cannot key an HMAC"))
        }
    }
}

/// The provider's public key, as ring takes it: 32 raw bytes (Ed25519) or an uncompressed P-256
/// point (from the SubjectPublicKeyInfo DER that SendGrid shows, base64 or PEM).
fn public_key(spec: &SignatureSpec, secret: &SigningSecret) -> Result<Vec<u8>, VerifyError> {
    use base64::Engine as _;
    let unusable = |reason: &str| VerifyError::UnusableSecret {
        reason: reason.into(),
    };
    let text = secret.expose().trim();
    let bytes = match spec.secret {
        SecretEncoding::Hex => hex::decode(text).map_err(|_| unusable("the public key is hex"))?,
        SecretEncoding::Base64 => base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(|_| unusable("the public key is base64"))?,
        SecretEncoding::Whpk => base64::engine::general_purpose::STANDARD
            .decode(text.strip_prefix("whpk_").unwrap_or(text))
            .map_err(|_| unusable("a Standard Webhooks public key is whpk_ followed by base64"))?,
        SecretEncoding::Pem => {
            let inner: String = text
                .lines()
                .filter(|l| !l.starts_with("-----"))
                .map(str::trim)
                .collect();
            base64::engine::general_purpose::STANDARD
                .decode(inner)
                .map_err(|_| unusable("the PEM public key's body is not base64"))?
        }
        _ => return Err(unusable("a public key is hex, base64, whpk_ base64 or PEM")),
    };
    match spec.kind {
        Kind::Ed25519 if bytes.len() == 32 => Ok(bytes),
        Kind::Ed25519 => Err(unusable("an Ed25519 public key is 32 bytes")),
        _ => p256_point(&bytes).ok_or_else(|| {
            unusable("a P-256 public key is a SubjectPublicKeyInfo (DER) or a 65-byte point")
        }),
    }
}

/// The DER prefix of a P-256 SubjectPublicKeyInfo: SEQUENCE { SEQUENCE { id-ecPublicKey,
/// prime256v1 }, BIT STRING (65 bytes) }.
const P256_SPKI_PREFIX: [u8; 26] = [
    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a,
    0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
];

fn p256_point(bytes: &[u8]) -> Option<Vec<u8>> {
    let point = match bytes.strip_prefix(&P256_SPKI_PREFIX[..]) {
        Some(point) => point,
        None => bytes,
    };
    (point.len() == 65 && point[0] == 0x04).then(|| point.to_vec())
}

/// The decoded length a signature must have, where it is fixed.
fn expected_len(spec: &SignatureSpec) -> Option<usize> {
    match spec.kind {
        Kind::Hmac | Kind::Digest => Some(hash_of(spec).output_len()),
        Kind::Ed25519 => Some(64),
        Kind::EcdsaP256 | Kind::Token => None,
    }
}

/// Decodes exactly `out.len()` bytes of hex: `None` when `raw` is not `2 * out.len()` hex
/// digits. Every fixed length there is (the MACs' and digests' 20, 32 and 64, Ed25519's 64) is
/// decoded by code made for it; the `hex` crate answers any other.
fn hex_into(raw: &[u8], out: &mut [u8]) -> Option<()> {
    match out.len() {
        20 => hex_sha1(raw, out),
        32 => hex_exact::<32>(raw, out),
        64 => hex_exact::<64>(raw, out),
        _ => hex::decode_to_slice(raw, out).ok(),
    }
}

/// SHA-1's 40 digits decoded as 48, the last 8 zeros: a multiple of the 16 bytes a vector
/// holds, so the pass is vector code from end to end where 40 would end a byte at a time. The
/// padding is valid hex, so validity is the 40 digits' alone.
fn hex_sha1(raw: &[u8], out: &mut [u8]) -> Option<()> {
    let (Ok(raw), Ok(out)) = (<&[u8; 40]>::try_from(raw), <&mut [u8; 20]>::try_from(out)) else {
        return None;
    };
    let mut padded = [b'0'; 48];
    let (digits, _) = padded.split_first_chunk_mut::<40>()?;
    *digits = *raw;
    let mut bytes = [0u8; 24];
    hex_exact::<24>(&padded, &mut bytes)?;
    let (mac, _) = bytes.split_first_chunk::<20>()?;
    *out = *mac;
    Some(())
}

fn decode(
    spec: &SignatureSpec,
    place: &'static str,
    raw: &[u8],
    expected: Option<usize>,
) -> Result<Candidate, VerifyError> {
    use base64::Engine as _;
    let mut inline = [0u8; INLINE_CANDIDATE];
    let candidate = match spec.encoding() {
        Encoding::Text => return Ok(Candidate::of(raw)),
        Encoding::Hex => match expected {
            Some(n) if n <= INLINE_CANDIDATE => {
                // Exactly n bytes, so the length check below holds.
                hex_into(raw, &mut inline[..n]).ok_or_else(|| {
                    malformed(
                        place,
                        format!("signature is not {} hexadecimal characters", 2 * n),
                    )
                })?;
                return Ok(Candidate::Inline {
                    bytes: inline,
                    len: n as u8,
                });
            }
            _ => Candidate::Heap(
                hex::decode(raw).map_err(|_| malformed(place, "signature is not hexadecimal"))?,
            ),
        },
        Encoding::Base64 | Encoding::Base64url => {
            let (engine, raw) = if spec.encoding() == Encoding::Base64 {
                (&base64::engine::general_purpose::STANDARD, raw)
            } else {
                let mut unpadded = raw;
                while let [rest @ .., b'='] = unpadded {
                    unpadded = rest;
                }
                (&base64::engine::general_purpose::URL_SAFE_NO_PAD, unpadded)
            };
            let not_base64 = || malformed(place, "signature is not base64");
            match engine.decode_slice(raw, &mut inline) {
                Ok(len) => Candidate::of(&inline[..len]),
                Err(base64::DecodeSliceError::OutputSliceTooSmall) => {
                    Candidate::Heap(engine.decode(raw).map_err(|_| not_base64())?)
                }
                Err(base64::DecodeSliceError::DecodeError(_)) => return Err(not_base64()),
            }
        }
    };
    match expected {
        Some(n) if candidate.as_slice().len() != n => {
            Err(malformed(place, format!("signature is not {n} bytes")))
        }
        _ => Ok(candidate),
    }
}

/// Decodes exactly `2 * N` hex digits into `out` (`N` bytes), `N` known when compiled, in two
/// passes with no branch on the text: first every digit's value, each on its own (a pass over
/// bytes that compiles to vector code), validity decided once at the end; then each pair
/// joined, read as one 16-bit word whose low byte is the high digit. Joining the values of one
/// pass (not picking the even and odd digits apart first) keeps the baseline x86-64 code from
/// gathering digits a byte at a time: that gather drew most of the decode's samples
/// (`perf record`, 2026-12-03). The `hex` crate's decoder branches on every digit.
fn hex_exact<const N: usize>(text: &[u8], out: &mut [u8]) -> Option<()> {
    let (pairs, []) = text.as_chunks::<2>() else {
        return None;
    };
    let (Ok(pairs), Ok(out)) = (
        <&[[u8; 2]; N]>::try_from(pairs),
        <&mut [u8; N]>::try_from(out),
    ) else {
        return None;
    };
    let mut values = [[0u8; 2]; N];
    let mut invalid = 0u8;
    for (&c, value) in pairs
        .as_flattened()
        .iter()
        .zip(values.as_flattened_mut().iter_mut())
    {
        let (digit, bad) = nibble(c);
        *value = digit;
        invalid |= bad;
    }
    for (&pair, byte) in values.iter().zip(out.iter_mut()) {
        let word = u16::from_le_bytes(pair);
        // The high digit shifted into the upper nibble, the low digit's value in the lower one
        // (both below 16 when the text is valid; anything else is refused below).
        *byte = ((word << 4) | (word >> 8)) as u8;
    }
    (invalid == 0).then_some(())
}

/// A hex digit's value and 1 when `c` is not a hex digit (its value is then meaningless),
/// worked out with no branch on `c`.
#[inline(always)]
fn nibble(c: u8) -> (u8, u8) {
    let digit = c.wrapping_sub(b'0');
    // Upper and lower case letters alike; no other byte lands in a..=f this way.
    let letter = (c | 0x20).wrapping_sub(b'a');
    let (is_digit, is_letter) = (digit < 10, letter < 6);
    let value = if is_digit {
        digit
    } else {
        letter.wrapping_add(10)
    };
    (value, u8::from(!(is_digit | is_letter)))
}

fn parse_timestamp(
    place: &'static str,
    raw: &str,
    format: TimestampFormat,
) -> Result<i64, VerifyError> {
    match format {
        TimestampFormat::Unix => unix_seconds(place, raw),
        TimestampFormat::UnixMs => {
            if raw.is_empty() || raw.len() > 15 || !raw.bytes().all(|b| b.is_ascii_digit()) {
                return Err(malformed(
                    place,
                    format!("timestamp {:?} is not Unix milliseconds", excerpt(raw)),
                ));
            }
            raw.parse::<i64>()
                .map(|ms| ms / 1000)
                .map_err(|_| malformed(place, "timestamp out of range"))
        }
        TimestampFormat::Rfc3339 => chrono::DateTime::parse_from_rfc3339(raw)
            .map(|t| t.timestamp())
            .map_err(|_| {
                malformed(
                    place,
                    format!("timestamp {:?} is not RFC 3339", excerpt(raw)),
                )
            }),
    }
}

fn format_timestamp(unix: i64, format: TimestampFormat) -> String {
    match format {
        TimestampFormat::Unix => unix.to_string(),
        TimestampFormat::UnixMs => unix.saturating_mul(1000).to_string(),
        TimestampFormat::Rfc3339 => chrono::DateTime::from_timestamp(unix, 0)
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
            .unwrap_or_default(),
    }
}

/// What `sign_request` signs: a delivery the way the provider would make it.
#[derive(Debug, Clone, Copy)]
pub struct Signing<'a> {
    /// The id written into every signed header that is not the timestamp (Standard Webhooks'
    /// `webhook-id`, Twitch's message id).
    pub message_id: &'a str,
    pub timestamp: i64,
    pub body: &'a [u8],
    pub method: &'a str,
    pub url: Option<&'a str>,
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
    sign_request(
        scheme,
        secret,
        &Signing {
            message_id,
            timestamp,
            body,
            method: "POST",
            url: None,
        },
    )
}

/// Signs a delivery with the scheme's first layout. Public-key schemes cannot be signed with
/// the public key a source holds, and a signature carried in the body cannot be added to it.
pub fn sign_request(
    scheme: Scheme,
    secret: &SigningSecret,
    request: &Signing<'_>,
) -> Result<Vec<(HeaderName, HeaderValue)>, VerifyError> {
    sign_with(signing_layout(scheme, request.url)?, secret, request)
}

/// Signs a delivery with one layout (a catalogue entry's, or one a source declares).
pub fn sign_with(
    spec: &'static SignatureSpec,
    secret: &SigningSecret,
    request: &Signing<'_>,
) -> Result<Vec<(HeaderName, HeaderValue)>, VerifyError> {
    let unsupported = |reason: &str| VerifyError::UnusableSecret {
        reason: reason.into(),
    };
    let Some(signature_header) = &spec.header else {
        return Err(unsupported("this scheme carries its signature in the body"));
    };
    let mut headers: Vec<(HeaderName, HeaderValue)> = Vec::new();
    // The header that selects this layout (HubSpot's `X-HubSpot-Signature-Version: v2`).
    if let Some(when) = &spec.when
        && let (Some(name), Some(value)) = (&when.header, &when.equals)
    {
        headers.push((header_name(name), text_value(value)?));
    }
    let raw_timestamp = spec
        .timestamp
        .as_ref()
        .map(|ts| format_timestamp(request.timestamp, ts.format));
    for part in &spec.signed {
        if let Part::Header(name) = part
            && spec.timestamp.as_ref().and_then(|t| t.header.as_ref()) != Some(name)
        {
            headers.push((header_name(name), text_value(request.message_id)?));
        }
    }
    if let (Some(ts), Some(raw)) = (&spec.timestamp, &raw_timestamp)
        && let Some(name) = &ts.header
    {
        headers.push((header_name(name), text_value(raw)?));
    }
    let mut map: HeaderMap = headers.iter().cloned().collect();
    // A placeholder so the signature header is present while the parts are read.
    map.insert(header_name(signature_header), HeaderValue::from_static("x"));
    let signed = SignedMessage {
        timestamp: Some(request.timestamp),
        raw_timestamp: raw_timestamp.clone(),
        candidates: Candidates::default(),
        signed_headers: &spec.signed_headers,
    };
    let req = Request {
        headers: &map,
        body: request.body,
        method: request.method,
        url: request.url,
    };
    let parts = Parts {
        spec,
        request: &req,
        signed: &signed,
        secret,
    };
    let tag = match spec.kind {
        Kind::Hmac => hmac(
            hash_of(spec),
            &key(spec.secret, secret)?,
            parts,
            <[u8]>::to_vec,
        )?,
        Kind::Digest => digest(hash_of(spec), parts, <[u8]>::to_vec)?,
        Kind::Token => secret.expose().as_bytes().to_vec(),
        Kind::Ed25519 | Kind::EcdsaP256 => {
            return Err(unsupported(
                "a public-key scheme is signed by the provider alone",
            ));
        }
    };
    let encoded = encode(spec.encoding(), &tag);
    let value = if let Some(items) = spec.items.as_ref().filter(|i| i.timestamp_first) {
        format!(
            "{}{}{encoded}",
            raw_timestamp.as_deref().unwrap_or_default(),
            items.separator
        )
    } else if let Some(items) = &spec.items {
        let mut value = String::new();
        if let (Some(key), Some(raw)) = (&items.timestamp, &raw_timestamp) {
            value.push_str(&format!("{key}{}{raw}{}", items.pair, items.separator));
        }
        value.push_str(&format!("{}{}{encoded}", items.signature, items.pair));
        value
    } else if let Some(versions) = &spec.versions {
        format!("{}{}{encoded}", versions.version, versions.pair)
    } else {
        format!("{}{encoded}", spec.prefix)
    };
    headers.push((header_name(signature_header), text_value(&value)?));
    Ok(headers)
}

/// The layout `sign_request` signs with: the first that a delivery to `url` can select (one
/// that needs a query parameter the URL lacks cannot be).
fn signing_layout(
    scheme: Scheme,
    url: Option<&str>,
) -> Result<&'static SignatureSpec, VerifyError> {
    let specs = layouts(scheme)?;
    Ok(specs
        .iter()
        .find(|spec| {
            spec.when
                .as_ref()
                .and_then(|w| w.query.as_ref())
                .is_none_or(|param| query_param(url, param).is_some())
        })
        .unwrap_or(&specs[0]))
}

fn encode(encoding: Encoding, bytes: &[u8]) -> String {
    use base64::Engine as _;
    match encoding {
        Encoding::Hex => hex::encode(bytes),
        Encoding::Base64 => base64::engine::general_purpose::STANDARD.encode(bytes),
        Encoding::Base64url => base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes),
        Encoding::Text => String::from_utf8_lossy(bytes).into_owned(),
    }
}

fn header_name(name: &str) -> HeaderName {
    HeaderName::from_bytes(name.as_bytes()).expect("catalogue header names are validated")
}

fn text_value(text: &str) -> Result<HeaderValue, VerifyError> {
    HeaderValue::try_from(text).map_err(|_| VerifyError::UnusableSecret {
        reason: "a signed value is not a valid header value".into(),
    })
}

/// The headers a scheme reads, for storing beside the payload and for the `verify` report:
/// worked out once per scheme, not on every delivery.
pub fn signature_headers(scheme: Scheme) -> &'static [&'static str] {
    static BY_SCHEME: std::sync::LazyLock<Vec<Vec<&'static str>>> =
        std::sync::LazyLock::new(|| {
            Scheme::ALL
                .iter()
                .map(|s| layout_headers(&s.provider().signatures))
                .collect()
        });
    BY_SCHEME
        .get(usize::from(scheme.0))
        .map_or(&[], Vec::as_slice)
}

/// The headers these layouts read (a scheme's, or the one a source declares).
pub fn layout_headers(layouts: &'static [SignatureSpec]) -> Vec<&'static str> {
    let mut names: Vec<&'static str> = Vec::new();
    for spec in layouts {
        let parts = spec.signed.iter().filter_map(|p| match p {
            Part::Header(name) => Some(name.as_str()),
            _ => None,
        });
        let timestamp = spec.timestamp.as_ref().and_then(|t| t.header.as_deref());
        for name in parts.chain(timestamp).chain(spec.header.as_deref()) {
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    names
}

/// The headers that carry a scheme's signature (the MAC itself): with the body, a delivery
/// anyone holding them could post again within the tolerance.
pub fn mac_headers(scheme: Scheme) -> Vec<&'static str> {
    scheme
        .provider()
        .signatures
        .iter()
        .filter_map(|s| s.header.as_deref())
        .collect()
}

/// Whether `name` (any case) carries a signature under any scheme.
pub fn is_signature_header(name: &str) -> bool {
    Scheme::ALL
        .iter()
        .flat_map(|s| mac_headers(*s))
        .any(|h| h.eq_ignore_ascii_case(name))
}

/// [`header`] through a name parsed once (a layout's own headers, read on every delivery).
fn header_parsed<'a>(
    headers: &'a HeaderMap,
    parsed: &ParsedName,
    name: &'static str,
) -> Result<&'a [u8], VerifyError> {
    match parsed.get(name) {
        Some(parsed) => single_value(headers.get_all(parsed).iter(), name),
        None => header(headers, name),
    }
}

/// The single value of a header: its bytes, all ASCII, without the spaces and tabs around them.
/// Absent, repeated, oversized, empty or non-ASCII values are errors, never panics.
fn header<'a>(headers: &'a HeaderMap, name: &'static str) -> Result<&'a [u8], VerifyError> {
    single_value(headers.get_all(name).iter(), name)
}

fn single_value<'a>(
    mut values: http::header::ValueIter<'a, HeaderValue>,
    name: &'static str,
) -> Result<&'a [u8], VerifyError> {
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
    // A `HeaderValue` holds only visible ASCII, spaces, tabs and bytes of 128 and above (its
    // constructors refuse the rest), so the ASCII check alone refuses what `HeaderValue::to_str`
    // refuses, a word at a time where `to_str` goes byte by byte (90 of the 300 ns the catalogue
    // once spent around a 1 KiB HMAC), and `trim_ascii` trims what `str::trim` would (spaces
    // and tabs are the only white space a value can hold).
    let bytes = value.as_bytes();
    if !bytes.is_ascii() {
        return Err(malformed(name, "contains bytes that are not visible ASCII"));
    }
    let trimmed = bytes.trim_ascii();
    if trimmed.is_empty() {
        return Err(malformed(name, "empty"));
    }
    Ok(trimmed)
}

/// ASCII bytes read from `place` as text, for the layouts that split them (`key=value` items,
/// `<version>,<signature>` entries) or parse them (timestamps). ASCII is always UTF-8, so the
/// error only answers bytes that reached here some other way.
fn text<'a>(place: &'static str, bytes: &'a [u8]) -> Result<&'a str, VerifyError> {
    std::str::from_utf8(bytes)
        .map_err(|_| malformed(place, "contains bytes that are not visible ASCII"))
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

fn check_candidate_count(header: &'static str, n: usize) -> Result<(), VerifyError> {
    if n > MAX_CANDIDATES {
        return Err(malformed(
            header,
            format!("{n} signatures, at most {MAX_CANDIDATES} accepted"),
        ));
    }
    Ok(())
}

fn excerpt(s: &str) -> String {
    s.chars().take(24).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NOW: i64 = 1_700_000_000;
    const FIVE_MINUTES: Duration = Duration::from_secs(300);
    /// The URL a test delivery was sent to, for the layouts that sign it.
    const URL: &str = "https://hooks.example.com/webhooks/src_1?bodySHA256=";

    fn secrets(current: &str, previous: Option<&str>) -> SecretSet {
        SecretSet::new(current, previous.map(str::to_owned))
    }

    /// The catalogue's schemes a source's own secret can sign, the way their tests sign them:
    /// keyed MACs and digests carried in a header. Public-key schemes are signed by the provider
    /// alone, tokens cover nothing, and a signature or timestamp in the body (Mailgun, Adyen,
    /// Linear) is checked by the entry's vectors.
    fn signable() -> Vec<Scheme> {
        Scheme::ALL
            .into_iter()
            .filter(|s| {
                let spec = signing_layout(*s, Some(URL)).unwrap();
                matches!(spec.kind, Kind::Hmac | Kind::Digest)
                    && spec.header.is_some()
                    && !spec.signed.iter().any(|p| matches!(p, Part::Json(_)))
                    && spec.timestamp.as_ref().is_none_or(|t| t.json.is_none())
            })
            .collect()
    }

    /// The body of a signed test delivery: JSON where a layout signs the URL's body digest.
    fn url_for(body: &[u8]) -> String {
        format!("{URL}{}", hex::encode(Sha256::digest(body)))
    }

    fn signed(scheme: Scheme, secret: &str, ts: i64, body: &[u8]) -> HeaderMap {
        let secret = SigningSecret::new(secret);
        let url = url_for(body);
        sign_request(
            scheme,
            &secret,
            &Signing {
                message_id: "msg_1",
                timestamp: ts,
                body,
                method: "POST",
                url: Some(&url),
            },
        )
        .unwrap()
        .into_iter()
        .collect()
    }

    /// `super::verify` for a POST to the URL the test deliveries were signed for (`URL` with the
    /// body's digest): what the layouts that sign a URL need.
    fn verify(
        scheme: Scheme,
        headers: &HeaderMap,
        body: &[u8],
        secrets: &SecretSet,
        tolerance: Duration,
        now: i64,
    ) -> Result<Verified, VerifyError> {
        let url = url_for(body);
        let request = Request {
            headers,
            body,
            method: "POST",
            url: Some(&url),
        };
        verify_request(scheme, &request, secrets, tolerance, now)
    }

    /// A secret of the shape the scheme's layout expects.
    fn secret_for(scheme: Scheme) -> &'static str {
        secret_encoded(scheme.provider().signatures[0].secret, false)
    }

    fn other_secret_for(scheme: Scheme) -> &'static str {
        secret_encoded(scheme.provider().signatures[0].secret, true)
    }

    /// A test secret in `encoding`: one, or another (`other`) that makes different MACs.
    pub(super) fn secret_encoded(encoding: SecretEncoding, other: bool) -> &'static str {
        match (encoding, other) {
            (SecretEncoding::Whsec, false) => "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            (SecretEncoding::Whsec, true) => "whsec_bmV3LXNlY3JldC1mb3ItdGVzdGluZw==",
            (SecretEncoding::Base64, false) => "czNjcjN0",
            (SecretEncoding::Base64, true) => "bjN3",
            (SecretEncoding::Hex, false) => "73336372337400",
            (SecretEncoding::Hex, true) => "6e3377",
            (_, false) => "s3cr3t",
            (_, true) => "n3w",
        }
    }

    fn signs_timestamp(scheme: Scheme) -> bool {
        signing_layout(scheme, Some(URL))
            .unwrap()
            .timestamp
            .is_some()
    }

    /// Ingest keeps the signature headers beside every payload: the list is worked out once
    /// per scheme (the same slice each time), and a declared scheme has none of its own.
    #[test]
    fn signature_headers_are_computed_once_per_scheme() {
        let first = signature_headers(Scheme::StandardWebhooks);
        assert!(std::ptr::eq(
            first,
            signature_headers(Scheme::StandardWebhooks)
        ));
        assert_eq!(
            first,
            [
                "webhook-id",
                "webhook-timestamp",
                "webhook-signature",
                "svix-id",
                "svix-timestamp",
                "svix-signature"
            ]
        );
        assert!(signature_headers(Scheme::Declared).is_empty());
    }

    #[test]
    fn most_of_the_catalogue_is_signable_here() {
        let names: Vec<&str> = signable().iter().map(|s| s.as_str()).collect();
        for scheme in [
            "stripe",
            "standard_webhooks",
            "github",
            "shopify",
            "slack",
            "twilio",
            "hubspot",
            "paddle",
            "square",
        ] {
            assert!(names.contains(&scheme), "{scheme} missing from {names:?}");
        }
        assert!(names.len() >= 19, "{names:?}");
    }

    /// What `mac_headers` names is what verification needs: a delivery without those headers
    /// is refused as missing its signature, under every scheme, and the headers are found in
    /// any case.
    #[test]
    fn the_mac_headers_are_the_ones_a_signature_needs() {
        for scheme in signable() {
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
        for scheme in signable() {
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
            // Only Standard Webhooks and the senders that use its headers (Replicate) sign
            // `webhook-id`; GitHub's and Shopify's ids are outside their signatures.
            assert_eq!(
                verified.signs_header(standard_webhooks::ID),
                scheme == Scheme::StandardWebhooks || scheme == Scheme::Replicate,
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
        for scheme in signable() {
            let old = secret_for(scheme);
            let new = other_secret_for(scheme);
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
        for scheme in signable().into_iter().filter(|s| signs_timestamp(*s)) {
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
    fn hex_exact_decodes_what_the_hex_crate_does_on_odd_texts() {
        let mut ours = [0u8; 4];
        for text in [
            "00ff7a9B",
            "DEADbeef",
            "0g000000",
            "0000000",
            "000000000",
            "00 00000",
            "ＡＢ",
        ] {
            let theirs = hex::decode(text).ok().filter(|b| b.len() == 4);
            let decoded = hex_exact::<4>(text.as_bytes(), &mut ours).map(|()| ours.to_vec());
            assert_eq!(decoded, theirs, "{text:?}");
        }
        for byte in 0..=255u8 {
            for other in *b"09afAFgG/:@`" {
                for text in [[other, byte], [byte, other]] {
                    let mut one = [0u8; 1];
                    assert_eq!(
                        hex_exact::<1>(&text, &mut one).map(|()| one[0]),
                        hex::decode(text).ok().map(|b| b[0]),
                        "{text:?}"
                    );
                }
            }
        }
        assert!(bool::from(same(b"abc", b"abc")));
        assert!(!bool::from(same(b"abc", b"abd")));
        assert!(!bool::from(same(b"abc", b"abcd")));
    }

    /// The decoders of the MAC lengths (`hex_into`, as verification calls them) agree with the
    /// `hex` crate on every byte value at every position, and refuse a text of any other
    /// length.
    #[test]
    fn hex_exact_decodes_exactly_what_the_hex_crate_does() {
        fn check<const N: usize>() {
            let valid: Vec<u8> = (0..2 * N)
                .map(|i| b"0123456789abcdefABCDEF"[i % 22])
                .collect();
            let mut ours = [0u8; N];
            for position in 0..2 * N {
                for byte in 0..=255u8 {
                    let mut text = valid.clone();
                    text[position] = byte;
                    assert_eq!(
                        hex_into(&text, &mut ours).map(|()| ours.to_vec()),
                        hex::decode(&text).ok(),
                        "{N} bytes, {byte:#04x} at {position}"
                    );
                }
            }
            for len in [0, 2 * N - 2, 2 * N - 1, 2 * N + 1, 2 * N + 2] {
                let text: Vec<u8> = valid.iter().copied().cycle().take(len).collect();
                assert_eq!(hex_into(&text, &mut ours), None, "{N} bytes from {len}");
            }
            let mut short = [0u8; 1];
            assert_eq!(hex_into(&valid, &mut short), None, "{N} digits into 1 byte");
        }
        check::<20>();
        check::<32>();
        check::<64>();
    }

    /// Why a GitHub delivery of `b"b"` under the secret `s` with these headers is refused.
    fn github_refusal(headers: &HeaderMap) -> VerifyError {
        verify(
            Scheme::Github,
            headers,
            b"b",
            &secrets("s", None),
            FIVE_MINUTES,
            NOW,
        )
        .unwrap_err()
    }

    #[test]
    fn a_signature_header_with_bytes_beyond_ascii_is_refused_by_name() {
        // HeaderValue admits bytes of 128 and above (obs-text); they are never a signature.
        let mut headers = signed(Scheme::Github, "s", NOW, b"b");
        let mut value = headers[github::SIGNATURE].as_bytes().to_vec();
        value.push(0xE9);
        headers.insert(github::SIGNATURE, HeaderValue::from_bytes(&value).unwrap());
        let err = github_refusal(&headers);
        assert_eq!(
            err,
            VerifyError::MalformedHeader {
                header: github::SIGNATURE,
                reason: "contains bytes that are not visible ASCII".into()
            }
        );
    }

    #[test]
    fn every_listed_signature_is_tried_wherever_it_stands() {
        // Standard Webhooks lists several signatures; the one that matches may be any of them,
        // including one past the first (held apart from it) and a token too long to hold inline.
        let secret = secret_for(Scheme::StandardWebhooks);
        let good = signed(Scheme::StandardWebhooks, secret, NOW, b"body");
        let real = good[standard_webhooks::SIGNATURE]
            .to_str()
            .unwrap()
            .to_owned();
        let decoy = format!("v1,{}", "A".repeat(43) + "=");
        for listed in [
            format!("{real} {decoy} {decoy}"),
            format!("{decoy} {real}"),
            format!("{decoy} {decoy} {real}"),
        ] {
            let mut headers = good.clone();
            headers.insert(standard_webhooks::SIGNATURE, listed.parse().unwrap());
            let parsed = parse(Scheme::StandardWebhooks, &headers).unwrap();
            assert_eq!(
                parsed.candidates.len(),
                listed.matches("v1,").count(),
                "{listed}"
            );
            verify(
                Scheme::StandardWebhooks,
                &headers,
                b"body",
                &secrets(secret, None),
                FIVE_MINUTES,
                NOW,
            )
            .unwrap_or_else(|e| panic!("{listed}: {e}"));
        }
        let long = Candidate::of(&[7u8; 100]);
        assert!(matches!(long, Candidate::Heap(_)));
        assert_eq!(long.as_slice(), &[7u8; 100][..]);
    }

    #[test]
    fn missing_and_repeated_headers_are_named() {
        for scheme in signable() {
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
        let err = github_refusal(&headers);
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
            scheme_index in 0usize..Scheme::ALL.len(),
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
            scheme_index in 0usize..32,
            body in proptest::collection::vec(any::<u8>(), 1..256),
            at in any::<proptest::sample::Index>(),
            flip in 1u8..=255,
        ) {
            let schemes = signable();
            let scheme = schemes[scheme_index % schemes.len()];
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
