//! The provider catalogue: one reviewed TOML file per provider under `shared/providers/`,
//! compiled in (`build.rs` lists the files) and validated here. An entry says how the provider
//! signs (from the primitives `signature` implements), where its events keep their fields, how
//! it checks an endpoint, how it retries and how a gap is backfilled, and carries its
//! known-answer vectors. Adding a provider is adding a file; `docs/providers.md` is generated
//! from the catalogue (`hookctl providers markdown`) and a test keeps it in sync.

mod entry;

use std::fmt::Write as _;
use std::sync::LazyLock;

pub use entry::*;

use serde::Deserialize;

use crate::domain::Scheme;

include!(concat!(env!("OUT_DIR"), "/catalogue_files.rs"));

/// Why a catalogue entry (or a scheme a source declares) is not usable, naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct SpecError {
    pub field: String,
    pub reason: String,
}

fn spec_error(field: impl Into<String>, reason: impl Into<String>) -> SpecError {
    SpecError {
        field: field.into(),
        reason: reason.into(),
    }
}

static CATALOGUE: LazyLock<Vec<Provider>> = LazyLock::new(|| {
    FILES
        .iter()
        .map(|(name, text)| {
            // The files are compiled in and every one is loaded by this module's tests, so a
            // broken entry fails the build's tests, never a request.
            load(name, text).unwrap_or_else(|e| panic!("shared/providers/{name}.toml: {e}"))
        })
        .collect()
});

pub use crate::domain::DECLARED_NAME;

/// What stands in for a catalogue entry behind a source that declares its signature (a
/// provider not in the catalogue): no layout of its own (the source's is used), the fields
/// most providers use unless the source sets them, no handshake.
static DECLARED: LazyLock<Provider> = LazyLock::new(|| {
    use crate::domain::FieldLocator;
    Provider {
        name: DECLARED_NAME.into(),
        title: "A provider not in the catalogue (the source declares its signature)".into(),
        docs: String::new(),
        kept_headers: Vec::new(),
        signatures: Vec::new(),
        fields: ProviderFields {
            external_id: FieldLocator::json("/id"),
            event_type: FieldLocator::json("/type"),
            entity_id: None,
            entity_version: None,
            entity_version_fallback: None,
            version_tiebreak: None,
            sequence: None,
            id_signed: true,
            batch: None,
            elements: None,
            json_form_field: None,
            volatile: Vec::new(),
        },
        handshake: HandshakeSpec::default(),
        notices: Vec::new(),
        retries: Retries {
            summary: "as the provider documents".into(),
            docs: String::new(),
            marks_retries: String::new(),
            acknowledge: None,
        },
        backfill: Backfill::default(),
        address_ranges: None,
        vectors: Vec::new(),
    }
});

impl Scheme {
    /// The catalogue entry itself (for [`Scheme::Declared`], what stands in for one).
    pub fn provider(self) -> &'static Provider {
        provider(self)
    }
}

/// The entry behind `scheme`.
pub fn provider(scheme: Scheme) -> &'static Provider {
    CATALOGUE.get(usize::from(scheme.0)).unwrap_or(&DECLARED)
}

/// Declared layouts, each kept once for the life of the process: verification borrows a
/// layout for `'static`, as it does the catalogue's, and a source cache refreshing every few
/// seconds must not keep a new copy each time. Bounded by the distinct layouts configured.
static DECLARED_LAYOUTS: std::sync::Mutex<Vec<&'static SignatureSpec>> =
    std::sync::Mutex::new(Vec::new());

/// Validates a layout a source declares and returns the process's one copy of it.
pub fn declare(spec: SignatureSpec) -> Result<&'static SignatureSpec, SpecError> {
    validate(&spec)?;
    let mut layouts = DECLARED_LAYOUTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(known) = layouts.iter().find(|known| ***known == spec) {
        return Ok(known);
    }
    let leaked: &'static SignatureSpec = Box::leak(Box::new(spec));
    layouts.push(leaked);
    Ok(leaked)
}

/// Every entry, in name order.
pub fn providers() -> impl Iterator<Item = (Scheme, &'static Provider)> {
    Scheme::ALL.into_iter().map(|s| (s, provider(s)))
}

/// Parses and validates one catalogue file.
pub fn load(name: &str, text: &str) -> Result<Provider, SpecError> {
    let provider: Provider =
        toml::from_str(text).map_err(|e| spec_error(name, e.message().to_owned()))?;
    if provider.name != name {
        return Err(spec_error(
            "name",
            format!("{:?} differs from the file name {name:?}", provider.name),
        ));
    }
    if provider.signatures.is_empty() {
        return Err(spec_error("signature", "at least one [[signature]] table"));
    }
    for (i, spec) in provider.signatures.iter().enumerate() {
        validate(spec).map_err(|e| spec_error(format!("signature[{i}].{}", e.field), e.reason))?;
        if let Some(name) = &spec.name
            && provider.signatures[..i]
                .iter()
                .any(|other| other.name.as_ref() == Some(name))
        {
            return Err(spec_error(
                format!("signature[{i}].name"),
                format!("{name:?} names two layouts"),
            ));
        }
    }
    if provider.signatures.iter().all(|spec| spec.legacy) {
        return Err(spec_error(
            "signature",
            "every layout is legacy: a source would accept none by default",
        ));
    }
    for name in &provider.kept_headers {
        header_name("kept_headers", name)?;
    }
    for pointer in &provider.fields.volatile {
        json_pointer("fields.volatile", pointer)?;
        // What the id reads, as a pointer into the request (an element's, under every element).
        let id_reads_it = provider.fields.external_id.parts().iter().any(|part| {
            match (part, &provider.fields.elements) {
                (crate::domain::FieldLocator::Json(read), None)
                | (crate::domain::FieldLocator::Envelope(read), _) => pointer_covers(pointer, read),
                (crate::domain::FieldLocator::Json(read), Some(elements)) => {
                    pointer_covers(pointer, &elements.in_request(read))
                }
                _ => false,
            }
        });
        if id_reads_it {
            return Err(spec_error(
                "fields.external_id",
                format!(
                    "reads {pointer:?}, which the entry lists as volatile: an id must not change between attempts"
                ),
            ));
        }
    }
    if !provider.retries.marks_retries.is_empty() {
        header_name("retries.marks_retries", &provider.retries.marks_retries)?;
    }
    batch_covers_the_elements_read(&provider.fields)?;
    match (
        provider.handshake.kind,
        provider.handshake.vectors.is_empty(),
    ) {
        (HandshakeKind::None, false) => {
            return Err(spec_error(
                "handshake.vectors",
                "known answers of a handshake the entry does not have (kind = \"none\")",
            ));
        }
        (kind, true) if kind != HandshakeKind::None => {
            return Err(spec_error(
                "handshake.vectors",
                format!(
                    "a {} handshake needs a known answer: a [[handshake.vectors]] table with the request and the answer the provider requires",
                    kind.as_str()
                ),
            ));
        }
        _ => {}
    }
    for (i, notice) in provider.notices.iter().enumerate() {
        header_name(&format!("notices[{i}].header"), &notice.header)?;
        for pointer in [&notice.subject, &notice.detail].into_iter().flatten() {
            json_pointer(&format!("notices[{i}]"), pointer)?;
        }
        if notice.kind.is_empty() || notice.equals.is_empty() {
            return Err(spec_error(
                format!("notices[{i}]"),
                "a notice needs its kind and the header value that marks it",
            ));
        }
    }
    if let Some(ranges) = &provider.address_ranges {
        address_ranges(ranges)?;
    }
    for (i, vector) in provider.vectors.iter().enumerate() {
        if vector.body.is_some() == vector.body_base64.is_some() {
            return Err(spec_error(
                format!("vectors[{i}]"),
                "exactly one of body and body_base64",
            ));
        }
        if let Err(e) = vector.body_bytes() {
            return Err(spec_error(
                format!("vectors[{i}].body_base64"),
                format!("not standard base64: {e}"),
            ));
        }
    }
    Ok(provider)
}

/// `[address_ranges]`: a URL with the pointer of its array, or a fixed list of CIDRs, each
/// of which parses.
fn address_ranges(spec: &AddressRangesSpec) -> Result<(), SpecError> {
    match (&spec.url, &spec.pointer, spec.cidrs.is_empty()) {
        (Some(url), Some(pointer), true) => {
            let parsed = url::Url::parse(url)
                .map_err(|e| spec_error("address_ranges.url", format!("{url:?}: {e}")))?;
            if parsed.scheme() != "https" {
                return Err(spec_error(
                    "address_ranges.url",
                    format!("{url:?}: a published list is read over https"),
                ));
            }
            json_pointer("address_ranges.pointer", pointer)
        }
        (None, None, false) => crate::address_lists::Ranges::parse(&spec.cidrs)
            .map(|_| ())
            .map_err(|e| spec_error("address_ranges.cidrs", e.to_string())),
        (Some(_), None, _) => Err(spec_error(
            "address_ranges.pointer",
            "the JSON pointer of the array of CIDRs in the document at url",
        )),
        _ => Err(spec_error(
            "address_ranges",
            "either url and pointer (a published list) or cidrs (a fixed one)",
        )),
    }
}

/// A locator that reads an element of an array (`/0/eventId`) reads one event of a batch: the
/// entry must say so (`fields.batch`), so that its documentation tells operators a request is
/// stored as one event.
fn batch_covers_the_elements_read(fields: &ProviderFields) -> Result<(), SpecError> {
    use crate::domain::FieldLocator;
    if fields.elements.is_some() {
        // Its locators read each element; `batch` (a request stored as one event) is the
        // opposite choice.
        if fields.batch.is_some() {
            return Err(spec_error(
                "fields.batch",
                "batch stores a request as one event, elements files each element as its own: name one",
            ));
        }
        return Ok(());
    }
    if let Some(batch) = &fields.batch
        && !batch.is_empty()
    {
        json_pointer("fields.batch", batch)?;
    }
    let read = fields.field_map();
    let pointers = read
        .locators()
        .flat_map(FieldLocator::parts)
        .filter_map(|part| match part {
            FieldLocator::Json(pointer) => Some(pointer.as_str()),
            _ => None,
        });
    for pointer in pointers {
        let segments: Vec<&str> = pointer.split('/').collect();
        let Some(element) = segments
            .iter()
            .position(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let array = segments[..element].join("/");
        if fields.batch.as_deref() != Some(array.as_str()) {
            return Err(spec_error(
                "fields.batch",
                format!(
                    "{pointer:?} reads an element of the array at {array:?}: a request carries a batch \
                     of events there, so set batch = {array:?}"
                ),
            ));
        }
    }
    Ok(())
}

/// Checks a signature layout: a catalogue entry's, or one a source declares.
pub fn validate(spec: &SignatureSpec) -> Result<(), SpecError> {
    use Kind::*;
    match (spec.kind, spec.hash) {
        (Hmac | Digest, None) => return Err(spec_error("hash", "hmac and digest need a hash")),
        (Ed25519 | EcdsaP256 | Token, Some(_)) => {
            return Err(spec_error("hash", "only hmac and digest take a hash"));
        }
        _ => {}
    }
    match (&spec.header, &spec.json) {
        (Some(name), None) => header_name("header", name)?,
        (None, Some(pointer)) => json_pointer("json", pointer)?,
        _ => return Err(spec_error("header", "exactly one of header and json")),
    }
    if spec.items.is_some() && spec.versions.is_some() {
        return Err(spec_error("items", "items and versions exclude each other"));
    }
    if let Some(items) = &spec.items {
        if items.timestamp_first
            && (items.separator.is_empty()
                || !items.pair.is_empty()
                || !items.signature.is_empty()
                || items.timestamp.is_some())
        {
            return Err(spec_error(
                "items",
                "timestamp_first reads items without keys: give separator alone",
            ));
        }
        if !items.timestamp_first
            && (items.separator.is_empty() || items.pair.is_empty() || items.signature.is_empty())
        {
            return Err(spec_error(
                "items",
                "separator, pair and signature are required",
            ));
        }
    }
    if let Some(versions) = &spec.versions
        && (versions.separator.is_empty()
            || versions.pair.is_empty()
            || versions.version.is_empty())
    {
        return Err(spec_error(
            "versions",
            "separator, pair and version are required",
        ));
    }
    match (spec.kind, spec.encoding()) {
        (Token, Encoding::Text) => {}
        (Token, _) => return Err(spec_error("encoding", "a token is compared as text")),
        (_, Encoding::Text) => return Err(spec_error("encoding", "text is for tokens only")),
        _ => {}
    }
    match (spec.kind, spec.secret) {
        (Ed25519, SecretEncoding::Hex | SecretEncoding::Base64 | SecretEncoding::Whpk) => {}
        (Ed25519, _) => {
            return Err(spec_error(
                "secret",
                "an Ed25519 public key is hex, base64 or whpk (base64 after whpk_)",
            ));
        }
        (EcdsaP256, SecretEncoding::Base64 | SecretEncoding::Pem) => {}
        (EcdsaP256, _) => {
            return Err(spec_error(
                "secret",
                "a P-256 public key is base64 DER or PEM",
            ));
        }
        (Token, SecretEncoding::Utf8) => {}
        (Token, _) => return Err(spec_error("secret", "a token is compared as typed (utf8)")),
        (_, SecretEncoding::Pem | SecretEncoding::Whpk) => {
            return Err(spec_error("secret", "pem and whpk are for public keys"));
        }
        _ => {}
    }
    if spec.kind == Token {
        if !spec.signed.is_empty() {
            return Err(spec_error("signed", "a token signs nothing"));
        }
    } else if spec.signed.is_empty() {
        return Err(spec_error("signed", "name the signed parts"));
    }
    for part in &spec.signed {
        match part {
            Part::Header(name) => header_name("signed", name)?,
            Part::Json(pointer) => json_pointer("signed", pointer)?,
            Part::Timestamp if spec.timestamp.is_none() => {
                return Err(spec_error("signed", "{timestamp} needs a timestamp table"));
            }
            Part::Secret if spec.kind != Digest => {
                return Err(spec_error(
                    "signed",
                    "{secret} is signed only by the digest kind",
                ));
            }
            _ => {}
        }
    }
    if spec.kind == Digest && !spec.signed.contains(&Part::Secret) {
        return Err(spec_error(
            "signed",
            "a digest without {secret} proves nothing",
        ));
    }
    if let Some(ts) = &spec.timestamp {
        let sources = usize::from(ts.item)
            + usize::from(ts.header.is_some())
            + usize::from(ts.json.is_some());
        if sources != 1 {
            return Err(spec_error(
                "timestamp",
                "exactly one of item, header and json",
            ));
        }
        if ts.item
            && spec
                .items
                .as_ref()
                .is_none_or(|i| i.timestamp.is_none() && !i.timestamp_first)
        {
            return Err(spec_error(
                "timestamp",
                "item = true needs items.timestamp or items.timestamp_first",
            ));
        }
        if let Some(name) = &ts.header {
            header_name("timestamp.header", name)?;
        }
        if let Some(pointer) = &ts.json {
            json_pointer("timestamp.json", pointer)?;
        }
        if !(1..=86_400).contains(&ts.tolerance_seconds) {
            return Err(spec_error(
                "timestamp.tolerance_seconds",
                "outside 1..=86400",
            ));
        }
    }
    for name in &spec.signed_headers {
        header_name("signed_headers", name)?;
        let read_by_a_part = spec.signed.iter().any(|part| match part {
            Part::Header(signed) => signed == name,
            Part::Timestamp => spec
                .timestamp
                .as_ref()
                .is_some_and(|ts| ts.header.as_deref() == Some(name.as_str())),
            _ => false,
        });
        if !read_by_a_part {
            return Err(spec_error(
                "signed_headers",
                format!("{name:?} is listed as signed but no signed part reads it"),
            ));
        }
    }
    if let Some(ts) = &spec.timestamp {
        let signed = spec.signed.iter().any(|part| match part {
            Part::Timestamp => true,
            Part::Header(name) => ts.header.as_deref() == Some(name.as_str()),
            Part::Json(pointer) => ts.json.as_deref() == Some(pointer.as_str()),
            Part::Body => ts.json.is_some(),
            _ => false,
        });
        if !signed {
            return Err(spec_error(
                "timestamp",
                "the timestamp is not among the signed parts: the sender could move it",
            ));
        }
    }
    if let Some(when) = &spec.when {
        match (&when.header, &when.query) {
            (Some(name), None) => header_name("when.header", name)?,
            (None, Some(_)) if when.equals.is_none() => {}
            _ => {
                return Err(spec_error(
                    "when",
                    "a header (with or without equals), or a query",
                ));
            }
        }
    }
    for encoding in &spec.url_decoded {
        let hex = encoding.strip_prefix('%').unwrap_or_default();
        let valid = hex.len() == 2
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'A'..=b'F').contains(&b))
            && u8::from_str_radix(hex, 16).is_ok_and(|b| b.is_ascii() && b != b'%');
        if !valid {
            return Err(SpecError {
                field: "url_decoded".into(),
                reason: format!(
                    "{encoding:?} is not a percent-encoding of an ASCII character other than % (%3A, upper-case hex)"
                ),
            });
        }
    }
    if !spec.url_decoded.is_empty() && !spec.signed.contains(&Part::Url) {
        return Err(SpecError {
            field: "url_decoded".into(),
            reason: "decodes the URL, but the layout does not sign {url}".into(),
        });
    }
    if spec.body_sha256_query.is_some() && !spec.signed.contains(&Part::Url) {
        return Err(spec_error(
            "body_sha256_query",
            "only a layout that signs {url}",
        ));
    }
    Ok(())
}

/// Whether the volatile `pattern` (a JSON pointer, `*` for any array index) names `pointer` or
/// a field that contains it.
fn pointer_covers(pattern: &str, pointer: &str) -> bool {
    let pattern: Vec<&str> = pattern.split('/').collect();
    let pointer: Vec<&str> = pointer.split('/').collect();
    pattern.len() <= pointer.len()
        && pattern
            .iter()
            .zip(&pointer)
            .all(|(p, s)| p == s || (*p == "*" && s.bytes().all(|b| b.is_ascii_digit())))
}

fn header_name(field: &str, name: &str) -> Result<(), SpecError> {
    let valid = http::HeaderName::from_bytes(name.as_bytes()).is_ok()
        && name.bytes().all(|b| !b.is_ascii_uppercase());
    if valid {
        Ok(())
    } else {
        Err(spec_error(
            field,
            format!("{name:?} is not a lower-case header name"),
        ))
    }
}

fn json_pointer(field: &str, pointer: &str) -> Result<(), SpecError> {
    if pointer.starts_with('/') {
        Ok(())
    } else {
        Err(spec_error(
            field,
            format!("JSON pointer {pointer:?} must start with '/'"),
        ))
    }
}

/// The catalogue as `docs/providers.md` shows it.
pub fn markdown() -> String {
    let mut out = String::new();
    out.push_str(
        "# Providers\n\n\
         Generated from `shared/providers/*.toml` by `hookctl providers markdown`; a test keeps \
         this file in sync. A source names its provider with `scheme = \"<name>\"`; the \
         catalogue format is described in [catalogue.md](catalogue.md).\n\n\
         | Provider | `scheme` | Signature | Event id | Id signed | Handshake | Backfill |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for (scheme, p) in providers() {
        let signature = p
            .signatures
            .iter()
            .map(describe)
            .collect::<Vec<_>>()
            .join("; or ");
        let _ = writeln!(
            out,
            "| [{}]({}) | `{scheme}` | {signature} | `{}` | {} | {} | {} |",
            p.title,
            p.docs,
            p.fields.external_id,
            if p.fields.id_signed { "yes" } else { "no" },
            match p.handshake.kind {
                HandshakeKind::None => "none".to_owned(),
                kind => format!("`{}`", kind.as_str()),
            },
            if p.backfill.api.is_empty() {
                "none"
            } else {
                "yes"
            },
        );
    }
    out.push_str(
        "\n## Legacy layouts\n\n\
         A provider that still sends a weaker signature beside a stronger one, for compatibility, \
         has that layout marked legacy: a source accepts it only when its `layouts` names it \
         (`layouts = [\"v3\", \"v1\"]`), so that a captured request stripped of its stronger \
         signature is refused. A request carrying a stronger layout's signature is always \
         verified with that one.\n\n",
    );
    for (scheme, p) in providers() {
        let legacy: Vec<&str> = p
            .signatures
            .iter()
            .filter(|s| s.legacy)
            .filter_map(|s| s.name.as_deref())
            .collect();
        if !legacy.is_empty() {
            let accepted: Vec<&str> = p
                .signatures
                .iter()
                .filter(|s| !s.legacy)
                .filter_map(|s| s.name.as_deref())
                .collect();
            let _ = writeln!(
                out,
                "- {} (`{scheme}`): legacy {}; accepted by default: {}",
                p.title,
                legacy.join(", "),
                if accepted.is_empty() {
                    "its unnamed layouts".to_owned()
                } else {
                    accepted.join(", ")
                }
            );
        }
    }
    out.push_str("\n## Retry policies and what an operator sets\n\n");
    for (scheme, p) in providers() {
        let _ = writeln!(out, "### {} (`{scheme}`)\n", p.title);
        let _ = writeln!(
            out,
            "- Retries: {} ([docs]({}))",
            p.retries.summary, p.retries.docs
        );
        if !p.backfill.api.is_empty() {
            let _ = writeln!(
                out,
                "- Backfill API: {} ([docs]({}))",
                p.backfill.api, p.backfill.docs
            );
        }
        let _ = writeln!(out, "- Secret: {}", secret_help(&p.signatures[0]));
        if let Some(ts) = p.signatures.iter().find_map(|s| s.timestamp.as_ref()) {
            let _ = writeln!(
                out,
                "- Timestamp tolerance: {} s by default (`tolerance_seconds`)",
                ts.tolerance_seconds
            );
        }
        if p.signatures.iter().all(|s| s.timestamp.is_none())
            && p.signatures.iter().any(|s| s.kind != Kind::Token)
        {
            out.push_str(
                "- No timestamp is signed: nothing bounds when a captured delivery verifies \
                 again. Sent again, it is filed as a duplicate of its stored event; where the id \
                 is outside the signature, the same body under another id is recorded as a \
                 replay, with no effect\n",
            );
        }
        if p.signatures.iter().any(|s| s.signed.contains(&Part::Url)) {
            out.push_str(
                "- Signs the URL it called: behind a custom domain, set the source's `url`\n",
            );
        }
        if let Some(batch) = &p.fields.batch {
            let _ = writeln!(out, "- Batches: {}", batch_help(p, batch));
        }
        if let Some(elements) = &p.fields.elements {
            let _ = writeln!(out, "- Batches: {}", elements_help(elements));
        }
        if let Some(layout) = p.signatures.iter().find(|s| s.header_named_by_source) {
            let _ = writeln!(
                out,
                "- Header named by the admin: usually `{}`; a source whose hook sends another sets `signature_header`",
                layout.header.as_deref().unwrap_or_default()
            );
        }
        for notice in &p.notices {
            let _ = writeln!(
                out,
                "- Notice `{}` ({}: {}): {}; answered 204, kept in `provider_notices`, no event ([docs]({}))",
                notice.kind, notice.header, notice.equals, notice.summary, notice.docs
            );
        }
        if !p.handshake.vectors.is_empty() {
            let _ = writeln!(
                out,
                "- Handshake `{}`: {} known answer(s), from: {}",
                p.handshake.kind.as_str(),
                p.handshake.vectors.len(),
                p.handshake
                    .vectors
                    .iter()
                    .map(|v| v.source.as_str())
                    .collect::<Vec<_>>()
                    .join("; ")
            );
        }
        if let Some(pointer) = p.signatures.iter().find_map(SignatureSpec::token_in_body) {
            let every = match &p.fields.elements {
                Some(at) if pointer.starts_with(&format!("{}/0/", at.pointer)) => {
                    " (each element's, every one checked)"
                }
                _ => "",
            };
            let _ = writeln!(
                out,
                "- Token in the body: `{pointer}`{every} is compared with the source's secret, \
                 then removed from all that is kept (payloads, the kept request, the buffer)"
            );
        }
        if let Some(help) = uncovered_help(p) {
            let _ = writeln!(out, "- Not signed whole: {help}");
        }
        if let Some(ranges) = &p.address_ranges {
            let _ = writeln!(
                out,
                "- Address ranges: {} ([docs]({})); its sources check a signed delivery's address \
                 against them (`address_check`, `observe` unless set)",
                ranges_help(ranges),
                ranges.docs
            );
        }
        let valid: Vec<&str> = p
            .vectors
            .iter()
            .filter(|v| v.valid)
            .map(|v| v.source.as_str())
            .collect();
        let _ = writeln!(
            out,
            "- Known-answer vectors: {} valid, {} refused; the valid ones from: {}",
            valid.len(),
            p.vectors.len() - valid.len(),
            valid.join("; ").replace('|', "\\|")
        );
        out.push('\n');
    }
    out.push_str(
        "## Not in the catalogue\n\n\
         Providers teams ask for that are not entries, how each authenticates its webhooks and \
         why it is not one (`shared/providers_not_supported.toml`). \"Could be an entry\" names \
         what is missing; until then a source can declare the layout itself where the engine's \
         primitives reach it ([catalogue.md](catalogue.md#declared-signatures)).\n\n\
         | Provider | How it authenticates | Why it is not an entry |\n\
         |---|---|---|\n",
    );
    for p in not_supported() {
        let unconfirmed = if p.verified {
            ""
        } else {
            " Not confirmed on a page of the provider's own."
        };
        let _ = writeln!(
            out,
            "| [{}]({}) | {} | {}{unconfirmed} |",
            p.title,
            p.docs,
            p.scheme.replace('|', "\\|"),
            p.why.replace('|', "\\|"),
        );
    }
    out
}

/// Where an entry's address ranges come from, in a phrase.
fn ranges_help(spec: &AddressRangesSpec) -> String {
    match (&spec.url, &spec.pointer) {
        (Some(url), Some(pointer)) => format!("published at {url} (`{pointer}`)"),
        _ => format!("a fixed list, {}", spec.cidrs.join(", ")),
    }
}

/// A provider that is not a catalogue entry, and why (`shared/providers_not_supported.toml`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NotSupported {
    pub name: String,
    pub title: String,
    /// The page its scheme was read from.
    pub docs: String,
    /// How it authenticates its webhooks.
    pub scheme: String,
    pub why: String,
    /// Whether a page of the provider's own confirmed the scheme.
    pub verified: bool,
}

/// The providers that are not entries, as listed.
pub fn not_supported() -> Vec<NotSupported> {
    #[derive(Deserialize)]
    struct List {
        provider: Vec<NotSupported>,
    }
    toml::from_str::<List>(include_str!("../../providers_not_supported.toml"))
        .map(|list| list.provider)
        .unwrap_or_default()
}

/// Everything the catalogue says about one provider, for `hookctl providers show`.
pub fn show(scheme: Scheme) -> String {
    let p = provider(scheme);
    let mut out = String::new();
    let _ = writeln!(out, "{} (scheme {scheme})\n  docs: {}", p.title, p.docs);
    for (i, spec) in p.signatures.iter().enumerate() {
        let _ = writeln!(out, "signature {}: {}", i + 1, describe(spec));
        if let Some(when) = &spec.when {
            let _ = match (&when.header, &when.equals, &when.query) {
                (Some(h), Some(v), _) => writeln!(out, "  when header {h} is {v:?}"),
                (Some(h), None, _) => writeln!(out, "  when header {h} is present"),
                (None, _, Some(q)) => writeln!(out, "  when the URL has the query parameter {q}"),
                _ => Ok(()),
            };
        }
        if let Some(ts) = &spec.timestamp {
            let _ = writeln!(
                out,
                "  timestamp: {:?}, tolerance {} s by default",
                ts.format, ts.tolerance_seconds
            );
        }
        if !spec.signed_headers.is_empty() {
            let _ = writeln!(out, "  signed headers: {}", spec.signed_headers.join(", "));
        }
        let _ = writeln!(out, "  secret: {}", secret_help(spec));
    }
    let f = &p.fields;
    let _ = writeln!(
        out,
        "fields: event id {} ({}), type {}",
        f.external_id,
        if f.id_signed {
            "signed"
        } else {
            "NOT signed: a replayed body can carry a fresh id"
        },
        f.event_type
    );
    for (name, locator) in [
        ("entity", &f.entity_id),
        ("entity version", &f.entity_version),
        ("sequence", &f.sequence),
    ] {
        if let Some(locator) = locator {
            let _ = writeln!(out, "  {name}: {locator}");
        }
    }
    if let Some(batch) = &f.batch {
        let _ = writeln!(out, "  batch: {}", batch_help(p, batch));
    }
    if let Some(elements) = &f.elements {
        let _ = writeln!(out, "  batch: {}", elements_help(elements));
    }
    let _ = writeln!(out, "handshake: {}", p.handshake.kind.as_str());
    let _ = writeln!(out, "retries: {} ({})", p.retries.summary, p.retries.docs);
    let _ = writeln!(
        out,
        "backfill: {}",
        if p.backfill.api.is_empty() {
            "none"
        } else {
            &p.backfill.api
        }
    );
    if let Some(ranges) = &p.address_ranges {
        let _ = writeln!(
            out,
            "address ranges: {} ({})",
            ranges_help(ranges),
            ranges.docs
        );
    }
    let _ = writeln!(out, "vectors: {}", p.vectors.len());
    for v in &p.vectors {
        let _ = writeln!(
            out,
            "  {}: {}",
            if v.valid { "valid  " } else { "refused" },
            v.source
        );
    }
    out
}

/// What an entry whose signature leaves bytes of a delivery uncovered means for its events.
fn uncovered_help(p: &Provider) -> Option<&'static str> {
    if p.signatures.iter().all(SignatureSpec::covers_body) {
        return None;
    }
    Some(if p.signatures.iter().all(|s| s.kind == Kind::Token) {
        "the token signs nothing: whoever holds it can send any event, so keep it as secret as a \
         signing key. A delivery with other bytes under a stored event's id is recorded as a \
         conflict and never replaces the stored payload"
    } else {
        "the signature covers the values of its signed string, not the body. The other bytes \
         are not verified: whoever captured a delivery can send it again with them changed and \
         the same signature (within the timestamp window, where there is one). Under a stored \
         event's id that is a recorded conflict, never replacing the stored payload; under \
         another id it is a new event"
    })
}

/// What a batching provider's entry means for the events stored.
fn batch_help(p: &Provider, array: &str) -> String {
    let at = if array.is_empty() {
        "the body is an array of events".to_owned()
    } else {
        format!("the array at `{array}` holds the request's events")
    };
    // A signature read from inside the first element covers that element alone.
    let first = format!("{array}/0/");
    let first_only = p.signatures.iter().any(|spec| {
        spec.json.as_deref().is_some_and(|j| j.starts_with(&first))
            || spec
                .signed
                .iter()
                .any(|part| matches!(part, Part::Json(j) if j.starts_with(&first)))
    });
    let mut help = format!(
        "{at}. A request is stored as one event: its id and fields as the locators read them \
         (the first element's or the envelope's), every element in its payload, so a consumer \
         reads the array. Elements are not deduplicated one by one, and a retry whose bytes \
         differ under the same id (an attempt count in each element) is a digest conflict, \
         counted and recorded"
    );
    if first_only {
        help.push_str(
            ". Only the first element's signature is checked: the other elements are stored \
             unverified, and a consumer must not act on them",
        );
    }
    help
}

/// What an entry that splits its batches means for the events stored.
fn elements_help(elements: &crate::domain::Elements) -> String {
    format!(
        "a request carries several events (`{elements}`). Each element is filed as its own \
         event, the locators above reading the element (`envelope:` ones the request): \
         deduplicated, versioned, projected, forwarded and counted one by one, in one \
         transaction with the others (all or none), its own JSON as its payload; the request's \
         bytes are kept once beside them. An element comes back a duplicate in any batch. At \
         most {} elements a request; more is refused (413), nothing stored",
        crate::domain::MAX_ELEMENTS
    )
}

/// One line on a signature layout.
pub fn describe(spec: &SignatureSpec) -> String {
    let algorithm = match (spec.kind, spec.hash) {
        (Kind::Hmac, Some(h)) => format!("HMAC-{}", hash_name(h)),
        (Kind::Digest, Some(h)) => format!("{} digest", hash_name(h)),
        (Kind::Ed25519, _) => "Ed25519".into(),
        (Kind::EcdsaP256, _) => "ECDSA P-256".into(),
        (Kind::Token, _) => "shared token".into(),
        _ => "?".into(),
    };
    let place = match (&spec.header, &spec.json) {
        (Some(h), _) => format!("`{h}`"),
        (_, Some(p)) => format!("body `{p}`"),
        _ => String::new(),
    };
    if spec.kind == Kind::Token {
        return format!("{algorithm} in {place}");
    }
    let signed: String = spec
        .signed
        .iter()
        .map(|p| match p {
            Part::Literal(text) => text.clone(),
            other => String::from(other.clone()),
        })
        .collect();
    let named = match (&spec.name, spec.legacy) {
        (Some(name), true) => format!("{name} (legacy, see below): "),
        (Some(name), false) => format!("{name}: "),
        (None, _) => String::new(),
    };
    format!(
        "{named}{algorithm} ({}) in {place} over `{}`",
        match spec.encoding() {
            Encoding::Hex => "hex",
            Encoding::Base64 => "base64",
            Encoding::Base64url => "base64url",
            Encoding::Text => "text",
        },
        signed.replace('|', "\\|")
    )
}

fn hash_name(hash: Hash) -> &'static str {
    match hash {
        Hash::Sha1 => "SHA1",
        Hash::Sha256 => "SHA256",
        Hash::Sha512 => "SHA512",
    }
}

fn secret_help(spec: &SignatureSpec) -> &'static str {
    match (spec.kind, spec.secret) {
        (Kind::Ed25519, SecretEncoding::Whpk) => {
            "the producer's Ed25519 public key, `whpk_...` as shown"
        }
        (Kind::Ed25519, _) => "the provider's Ed25519 public key (hex or base64, as shown)",
        (Kind::EcdsaP256, _) => "the provider's P-256 public key (base64 DER or PEM, as shown)",
        (Kind::Token, _) => "the token configured at the provider",
        (_, SecretEncoding::Whsec) => "the `whsec_...` signing secret as shown",
        (_, SecretEncoding::Hex) => "the hex key as shown",
        (_, SecretEncoding::Base64) => "the base64 key as shown",
        _ => "the signing secret as shown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The list of providers that are not entries loads, names each with a page and a reason,
    /// and holds no name that is an entry.
    #[test]
    fn the_providers_not_in_the_catalogue_are_listed_with_why() {
        #[derive(Deserialize)]
        struct List {
            #[allow(dead_code)]
            provider: Vec<NotSupported>,
        }
        toml::from_str::<List>(include_str!("../../providers_not_supported.toml"))
            .expect("shared/providers_not_supported.toml loads");
        let listed = not_supported();
        assert!(listed.len() >= 15, "{}", listed.len());
        for p in &listed {
            assert!(
                p.name.parse::<Scheme>().is_err(),
                "{} is a catalogue entry: remove it from shared/providers_not_supported.toml",
                p.name
            );
            assert!(p.docs.starts_with("https://"), "{}", p.name);
            assert!(!p.scheme.is_empty() && !p.why.is_empty(), "{}", p.name);
        }
    }

    #[test]
    fn every_entry_loads() {
        let errors: Vec<String> = FILES
            .iter()
            .filter_map(|(name, text)| {
                load(name, text)
                    .err()
                    .map(|e| format!("shared/providers/{name}.toml: {e}"))
            })
            .collect();
        assert!(errors.is_empty(), "{}", errors.join("\n"));
        // A Scheme indexes FILES by the names `domain` holds: the same order.
        for (scheme, (name, _)) in Scheme::ALL.iter().zip(FILES) {
            assert_eq!(scheme.as_str(), name);
        }
        assert_eq!(Scheme::Stripe.as_str(), "stripe");
        assert_eq!(
            Scheme::StandardWebhooks.provider().title,
            "Standard Webhooks (and Svix)"
        );
    }

    #[test]
    fn errors_name_the_field() {
        let base = FILES.iter().find(|(n, _)| *n == "github").unwrap().1;
        let cases = [
            (base.replace("hash = \"sha256\"\n", ""), "signature[0].hash"),
            (
                base.replace("encoding = \"hex\"", "encoding = \"hexa\""),
                "github",
            ),
            (
                base.replace("signed = [\"{body}\"]", "signed = [\"{bodyy}\"]"),
                "github",
            ),
            (
                base.replace("header = \"x-hub-signature-256\"", "header = \"X-Hub\""),
                "signature[0].header",
            ),
            (
                base.replace("name = \"github\"", "name = \"gitlab\""),
                "name",
            ),
            // A vector body given as base64 that does not decode (here: JSON text).
            (
                base.replacen("\nbody = ", "\nbody_base64 = ", 1),
                "vectors[0].body_base64",
            ),
        ];
        for (text, field) in cases {
            let err = load("github", &text).unwrap_err();
            assert_eq!(err.field, field, "{err}");
        }
    }

    /// `[address_ranges]` is a published list (an https URL and the pointer of its array) or a
    /// fixed one whose every entry parses; anything else fails to load, naming the field.
    #[test]
    fn address_ranges_are_a_url_with_its_pointer_or_a_fixed_list() {
        let base = FILES.iter().find(|(n, _)| *n == "github").unwrap().1;
        let url = "url = \"https://api.github.com/meta\"\npointer = \"/hooks\"\n";
        assert!(base.contains(url));
        let fixed = base.replace(url, "cidrs = [\"192.0.2.0/24\", \"2001:db8::1\"]\n");
        let loaded = load("github", &fixed).unwrap();
        assert_eq!(loaded.address_ranges.unwrap().cidrs.len(), 2);
        let cases = [
            (
                base.replace("https://api.github.com/meta", "http://api.github.com/meta"),
                "address_ranges.url",
            ),
            (
                base.replace("pointer = \"/hooks\"\n", ""),
                "address_ranges.pointer",
            ),
            (
                base.replace("\"/hooks\"", "\"hooks\""),
                "address_ranges.pointer",
            ),
            (
                base.replace(url, "cidrs = [\"192.0.2.0/33\"]\n"),
                "address_ranges.cidrs",
            ),
            (base.replace(url, "cidrs = []\n"), "address_ranges"),
            (
                base.replace(url, &format!("{url}cidrs = [\"192.0.2.0/24\"]\n")),
                "address_ranges",
            ),
        ];
        for (text, field) in cases {
            let err = load("github", &text).unwrap_err();
            assert_eq!(err.field, field, "{err}");
        }
    }

    /// An entry whose locators read an element of an array must declare that array as its
    /// batch (that is what documents a request as one stored event), and only that array.
    #[test]
    fn an_entry_reading_an_array_element_declares_its_batch() {
        let github = FILES.iter().find(|(n, _)| *n == "github").unwrap().1;
        let reads_element = github.replace(
            "external_id = \"header:x-github-delivery\"",
            "external_id = \"header:x-github-delivery + json:/commits/0/id\"",
        );
        assert_ne!(reads_element, github);
        assert_eq!(
            load("github", &reads_element).unwrap_err().field,
            "fields.batch"
        );
        let declared = reads_element.replace("[fields]\n", "[fields]\nbatch = \"/commits\"\n");
        assert_ne!(declared, reads_element);
        assert!(load("github", &declared).is_ok());
        let elsewhere = reads_element.replace("[fields]\n", "[fields]\nbatch = \"/events\"\n");
        assert_eq!(
            load("github", &elsewhere).unwrap_err().field,
            "fields.batch"
        );
        // Every entry that batches says so where operators read.
        let docs = markdown();
        for (scheme, p) in providers() {
            if p.fields.batch.is_some() || p.fields.elements.is_some() {
                assert!(show(scheme).contains("  batch: "), "{scheme}");
            }
        }
        assert_eq!(docs.matches("- Batches: ").count(), 10);
        assert_eq!(
            docs.matches("- Batches: a request carries several events")
                .count(),
            9
        );
    }

    /// Every entry says only what is true: no comment leaves a gap open in the format ("FORMAT
    /// GAP"). A gap is closed in the engine or stated as the provider's own choice.
    #[test]
    fn no_entry_carries_a_format_gap_note() {
        let open: Vec<&str> = FILES
            .iter()
            .filter(|(_, text)| text.contains("FORMAT GAP"))
            .map(|(name, _)| *name)
            .collect();
        assert!(open.is_empty(), "entries with a FORMAT GAP note: {open:?}");
    }

    /// An entry that files each element as an event: its locators read the element, an id may
    /// not read what the entry lists as volatile (in the element or the envelope), and it does
    /// not also say it stores the request as one event.
    #[test]
    fn an_element_id_never_reads_a_volatile_field() {
        let hubspot = FILES.iter().find(|(n, _)| *n == "hubspot").unwrap().1;
        let loaded = load("hubspot", hubspot).unwrap();
        assert_eq!(
            loaded.fields.elements.as_ref().map(ToString::to_string),
            Some("json:/".to_owned())
        );
        let id_line = hubspot
            .lines()
            .find(|l| l.starts_with("external_id = "))
            .unwrap();
        let with_attempt = hubspot.replace(
            id_line,
            "external_id = \"json:/eventId + json:/attemptNumber\"",
        );
        let err = load("hubspot", &with_attempt).unwrap_err();
        assert_eq!(err.field, "fields.external_id", "{err}");
        assert!(err.reason.contains("/*/attemptNumber"), "{err}");

        let okta = FILES.iter().find(|(n, _)| *n == "okta").unwrap().1;
        assert!(load("okta", okta).is_ok());
        let envelope_id = okta.replace(
            "external_id = \"json:/uuid\"",
            "external_id = \"envelope:/eventId + json:/uuid\"",
        );
        assert_ne!(envelope_id, okta);
        assert_eq!(
            load("okta", &envelope_id).unwrap_err().field,
            "fields.external_id"
        );
        // The same field of each element is not the envelope's.
        let element_id = okta.replace(
            "external_id = \"json:/uuid\"",
            "external_id = \"json:/eventId\"",
        );
        assert!(load("okta", &element_id).is_ok());

        let both = hubspot.replace(
            "elements = \"json:/\"",
            "elements = \"json:/\"\nbatch = \"\"",
        );
        assert_eq!(load("hubspot", &both).unwrap_err().field, "fields.batch");
    }

    /// The entries whose signature leaves some bytes of a delivery uncovered: their deliveries
    /// never replace a stored payload (`prepare`). Shared tokens sign nothing; Adyen signs
    /// eight values of the body, Mailgun a timestamp and a token; Microsoft Graph's token is
    /// inside each notification.
    #[test]
    fn the_entries_not_covering_the_body_are_the_token_and_value_signers() {
        let uncovered: Vec<&str> = providers()
            .filter(|(_, p)| !p.signatures.iter().all(SignatureSpec::covers_body))
            .map(|(_, p)| p.name.as_str())
            .collect();
        assert_eq!(
            uncovered,
            [
                "adyen",
                "auth0_log_streams",
                "figma",
                "gitlab",
                "mailgun",
                "microsoft_graph",
                "okta"
            ]
        );
        assert_eq!(markdown().matches("- Not signed whole: ").count(), 7);
    }

    /// A vector's headers and body, as the request carries them.
    fn delivered(v: &Vector) -> (http::HeaderMap, Vec<u8>) {
        (vector_headers(&v.headers).unwrap(), v.body_bytes().unwrap())
    }

    /// The README's count of the catalogue is the count the catalogue holds.
    #[test]
    fn the_readme_states_the_catalogue_count() {
        let readme = include_str!("../../../README.md");
        let stated: usize = readme
            .split_once("Providers (")
            .and_then(|(_, rest)| rest.split_once(" in the"))
            .and_then(|(n, _)| n.parse().ok())
            .expect("README: 'Providers (N in the catalogue'");
        assert_eq!(stated, providers().count(), "README's provider count");
    }

    /// An entry may not read its event id from a field it calls volatile (one that changes
    /// between attempts): every retry would be another event.
    #[test]
    fn an_id_that_reads_a_volatile_field_is_refused() {
        let text = include_str!("../../providers/hubspot.toml").replace(
            "volatile = [\"/*/attemptNumber\"]",
            "volatile = [\"/*/attemptNumber\", \"/*/eventId\"]",
        );
        let error = load("hubspot", &text).unwrap_err().to_string();
        assert!(
            error.contains("fields.external_id") && error.contains("volatile"),
            "{error}"
        );
        load("hubspot", include_str!("../../providers/hubspot.toml")).unwrap();
    }

    /// Linear's type is two fields, the entity type and the action: a subscription to
    /// `Issue:*` or `*:remove` can tell a comment created from an issue removed.
    #[test]
    fn linears_event_type_is_its_entity_type_and_action() {
        let (_, linear) = providers()
            .find(|(scheme, _)| scheme.as_str() == "linear")
            .expect("linear is in the catalogue");
        let (headers, body) = delivered(&linear.vectors[0]);
        let fields = crate::extract::extract(&linear.fields.field_map(), &headers, &body).unwrap();
        assert_eq!(fields.event_type, "Comment:create");
    }

    /// Recurly's header is `<ms>,<sig>[,<sig>]`: items without keys, the timestamp first. Such a
    /// layout gives its separator alone; one that also names keys is refused, since it could
    /// not say which reading it means.
    #[test]
    fn items_read_by_position_give_their_separator_alone() {
        let recurly = include_str!("../../providers/recurly.toml");
        load("recurly", recurly).unwrap();
        let keyed = recurly.replace(
            "items = { separator = \",\", timestamp_first = true }",
            "items = { separator = \",\", pair = \"=\", signature = \"v1\", timestamp_first = true }",
        );
        assert_ne!(keyed, recurly);
        let error = load("recurly", &keyed).unwrap_err();
        assert_eq!(error.field, "signature[0].items", "{error}");
    }

    /// A handshake is part of what an entry promises: without a known answer (the request and
    /// what the provider requires) the entry does not load, so no handshake goes unchecked.
    #[test]
    fn an_entry_with_a_handshake_and_no_known_answer_fails_to_load() {
        let zoom = include_str!("../../providers/zoom.toml");
        let start = zoom
            .find("[[handshake.vectors]]")
            .expect("zoom has a known answer");
        let end = start + zoom[start..].find("\n[retries]").expect("retries follow");
        let without = format!("{}{}", &zoom[..start], &zoom[end + 1..]);
        let error = load("zoom", &without).unwrap_err().to_string();
        assert!(
            error.contains("handshake.vectors") && error.contains("known answer"),
            "{error}"
        );
        load("zoom", zoom).unwrap();
    }

    /// No valid vector that is an event (not a handshake) holds a field its entry reads and
    /// then refuses (`ExtractError::Invalid`): a delivery the signature accepts is not refused
    /// for the shape of a value (WooCommerce's versions have no offset, and every one of its
    /// events was refused until they were read as UTC). A vector may lack a field (one taken
    /// from an SDK's signature test carries only the signature's headers) or not be JSON (a
    /// form, a GET); most give every field.
    #[test]
    fn no_valid_vector_is_refused_for_the_shape_of_a_field() {
        use crate::extract::ExtractError;
        use crate::secrets::SigningSecret;
        let mut read = 0usize;
        for (scheme, p) in providers() {
            for (i, v) in p.vectors.iter().enumerate().filter(|(_, v)| v.valid) {
                let (headers, body) = delivered(v);
                let secret = SigningSecret::new(v.secret.clone());
                if crate::protocol::handshake(scheme, &v.method, &headers, &body, &secret).is_some()
                    || crate::protocol::unsigned_handshake(
                        scheme,
                        &v.method,
                        &headers,
                        &body,
                        v.url.as_deref(),
                    )
                    .is_some()
                {
                    continue;
                }
                let fields = crate::extract::extract(&p.fields.field_map(), &headers, &body);
                assert!(
                    !matches!(fields, Err(ExtractError::Invalid { .. })),
                    "{scheme} vector {i} ({}): {fields:?}",
                    v.source
                );
                read += usize::from(fields.is_ok());
            }
        }
        assert!(read >= 26, "only {read} vectors gave every field");
    }

    /// `docs/providers.md` is the catalogue as `markdown()` renders it: regenerate it with
    /// `hookctl providers markdown > docs/providers.md` after changing an entry.
    #[test]
    fn docs_providers_md_is_generated_from_the_catalogue() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/providers.md");
        let on_disk = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            on_disk == markdown(),
            "docs/providers.md is stale: run `hookctl providers markdown > docs/providers.md`"
        );
    }
}
