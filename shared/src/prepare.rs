//! What the upsert needs of a verified delivery, read with its source's field map: the event's
//! fields, the headers kept beside the payload, the provider's retry mark, and whether the event
//! id is outside the signature. Ingest's direct path and the buffer's consumer both store
//! through [`prepare`], so a buffered delivery is filed as the same event its direct delivery
//! would have been.

use http::HeaderMap;
use sha2::Digest as _;

use crate::batches;
use crate::extract::{self, EventFields, ExtractError};
use crate::protocol;
use crate::signature;
use crate::sources::Source;
use crate::store::webhook_events::NewEvent;

/// What the upsert needs of a verified delivery, read with its source's field map. The direct
/// path and the buffer's consumer both store through this, so a buffered delivery is filed as
/// the same events its direct delivery would have been.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The events the delivery carries: one, or each element of a batch ([`Prepared::batch`]),
    /// in the order sent. Never empty.
    pub events: Vec<PreparedEvent>,
    /// The source files each element of its deliveries as an event (`crate::batches`).
    pub batch: bool,
    /// The headers kept beside the payload ([`kept_headers`]).
    pub headers: serde_json::Value,
    /// 1 when the provider marked the delivery as its own retry.
    pub provider_retries: i32,
    /// Nothing binds the event id to these bytes: it was read from a header the signature
    /// does not cover, or the signature does not cover the body (it signs a few values, as
    /// Adyen's and Mailgun's do, or it is a shared token). Such a delivery never replaces a
    /// stored payload, and its body is claimed so that it is stored under one id only.
    pub id_outside_signature: bool,
    /// The JSON a form delivery carried in its source's `json_form_field` (GitHub's `payload`):
    /// what is stored as the event's payload in place of the raw form bytes. `None`: the body
    /// is the event.
    pub form_json: Option<Vec<u8>>,
}

/// One event of a delivery.
#[derive(Debug, Clone)]
pub struct PreparedEvent {
    pub fields: EventFields,
    /// An element's own JSON, stored as its payload; `None`: the delivery's payload is.
    pub element: Option<Vec<u8>>,
    /// The digest of the event without its provider's volatile fields (`fields.volatile`), what
    /// the stored `payload_sha256` is for such a provider: two attempts of one delivery have the
    /// same. For an element, always: the digest of its canonical bytes (keys sorted). `None`:
    /// the payload's own digest.
    pub steady_sha256: Option<[u8; 32]>,
    /// An element's own signed digest, for a layout that signs each element's values
    /// ([`crate::batches::verify_each_element`]): what its replay guard claims. `None`: the
    /// delivery's (`Verified::signed_digest`).
    pub signed_digest: Option<[u8; 32]>,
}

/// Whether the delivery says it is a form post.
fn is_form(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| {
            v.trim()
                .eq_ignore_ascii_case("application/x-www-form-urlencoded")
        })
}

/// The JSON a form body carries in `field`, checked to be JSON.
fn form_json(body: &[u8], field: &str) -> Result<Vec<u8>, ExtractError> {
    let value = url::form_urlencoded::parse(body)
        .find(|(name, _)| name == field)
        .map(|(_, value)| value.into_owned())
        .ok_or_else(|| ExtractError::Missing {
            field: "JSON form field",
            locator: format!("form:{field}"),
        })?;
    serde_json::from_str::<serde::de::IgnoredAny>(&value)
        .map_err(|e| ExtractError::NotJson(format!("form field {field}: {e}")))?;
    Ok(value.into_bytes())
}

/// Reads a verified delivery's fields: its event's, or each element's of a batch. `signed` says
/// which headers the signature covers; a version or tiebreak read from one it does not is never
/// later than `received_at_micros`.
pub fn prepare(
    source: &Source,
    headers: &HeaderMap,
    body: &[u8],
    signed: &(dyn Fn(&str) -> bool + Sync),
    received_at_micros: i64,
) -> Result<Prepared, ExtractError> {
    let unsigned = extract::UnsignedHeaders {
        signed,
        received_at_micros,
    };
    let elements = source.fields.elements.as_ref();
    let form_json = match (
        elements.and_then(|e| e.form_field.as_ref()),
        &source.json_form_field,
    ) {
        (Some(field), _) => Some(form_json(body, field)?),
        (None, Some(field)) if is_form(headers) => Some(form_json(body, field)?),
        _ => None,
    };
    let event_body = form_json.as_deref().unwrap_or(body);
    let events = match elements {
        None => {
            // Read, and digested, without the fields that change between attempts.
            let steady = without_volatile(source, event_body);
            let fields = extract::extract_delivery(
                &source.fields,
                headers,
                steady.as_deref().unwrap_or(event_body),
                Some(&unsigned),
            )?;
            vec![PreparedEvent {
                fields,
                element: None,
                steady_sha256: steady.map(|bytes| sha2::Sha256::digest(bytes).into()),
                signed_digest: None,
            }]
        }
        Some(at) => {
            let json: serde_json::Value = serde_json::from_slice(event_body)
                .map_err(|e| ExtractError::NotJson(e.to_string()))?;
            let mut steady = json.clone();
            remove_volatile(source, &mut steady);
            let sent = batches::elements(at, &json)?;
            let read = batches::elements(at, &steady)?;
            let mut events = Vec::with_capacity(sent.len());
            for (i, (element, steady_element)) in sent.iter().zip(read).enumerate() {
                // Canonical: serde_json's objects keep their keys sorted.
                let canonical = serde_json::to_vec(steady_element)
                    .map_err(|e| ExtractError::NotJson(e.to_string()))?;
                let fields = extract::extract_element(
                    &source.fields,
                    headers,
                    body,
                    (steady_element, i),
                    &steady,
                    &canonical,
                    Some(&unsigned),
                )
                .map_err(|e| in_element(e, at, i))?;
                events.push(PreparedEvent {
                    fields,
                    element: Some(
                        serde_json::to_vec(element)
                            .map_err(|e| ExtractError::NotJson(e.to_string()))?,
                    ),
                    steady_sha256: Some(sha2::Sha256::digest(&canonical).into()),
                    signed_digest: None,
                });
            }
            events
        }
    };
    Ok(Prepared {
        events,
        batch: elements.is_some(),
        form_json,
        headers: kept_headers(source, headers),
        provider_retries: i32::from(protocol::is_provider_retry(source.scheme, headers)),
        id_outside_signature: !covers_body(source)
            || source
                .fields
                .external_id
                .headers()
                .any(|name| !signed(name.as_str())),
    })
}

/// An element's error, naming the element.
fn in_element(error: ExtractError, at: &crate::domain::Elements, index: usize) -> ExtractError {
    let locator = |locator: String| format!("{locator} of element {index} of {at}");
    match error {
        ExtractError::Missing { field, locator: l } => ExtractError::Missing {
            field,
            locator: locator(l),
        },
        ExtractError::Invalid {
            field,
            locator: l,
            reason,
        } => ExtractError::Invalid {
            field,
            locator: locator(l),
            reason,
        },
        other => other,
    }
}

/// Whether every layout the source is verified with covers the whole delivery.
fn covers_body(source: &Source) -> bool {
    let layouts = match source.signature {
        Some(declared) => std::slice::from_ref(declared),
        None => source.scheme.provider().signatures.as_slice(),
    };
    !layouts.is_empty() && layouts.iter().all(|layout| layout.covers_body())
}

impl Prepared {
    /// Gives each element its own signed digest, one per element in order (the elements'
    /// signatures checked one by one); a list of another length changes nothing.
    pub fn sign_each(&mut self, digests: &[Option<[u8; 32]>]) {
        if digests.len() == self.events.len() {
            for (event, digest) in self.events.iter_mut().zip(digests) {
                event.signed_digest = *digest;
            }
        }
    }

    /// Each event's own signed digest, hex, where it has one: what the buffer's envelope
    /// carries for the consumer ([`Prepared::sign_each`]). Empty when no event has its own.
    pub fn element_digests(&self) -> Vec<String> {
        if self.events.iter().all(|e| e.signed_digest.is_none()) {
            return Vec::new();
        }
        self.events
            .iter()
            .map(|e| e.signed_digest.map(hex::encode).unwrap_or_default())
            .collect()
    }

    /// The first event's fields (a batch's first element): what a log line names.
    pub fn first(&self) -> Option<&EventFields> {
        self.events.first().map(|e| &e.fields)
    }

    /// The events to store: this delivery's fields under its source. `signed_digest` and
    /// `verified_layout` are the verification's ([`signature::Verified`]; carried in the
    /// buffer's envelope for a buffered delivery).
    pub fn events<'a>(
        &'a self,
        source: &'a Source,
        body: &'a [u8],
        verified_with: &'a str,
        signed_digest: Option<[u8; 32]>,
        verified_layout: Option<&'a str>,
    ) -> Vec<NewEvent<'a>> {
        let payload = self.form_json.as_deref().unwrap_or(body);
        self.events
            .iter()
            .map(|prepared| {
                let payload = prepared.element.as_deref().unwrap_or(payload);
                let mut event = source.event(
                    &prepared.fields,
                    payload,
                    self.headers.clone(),
                    verified_with,
                );
                if let Some(digest) = prepared.steady_sha256 {
                    event.payload_sha256 = digest;
                }
                event.provider_retries = self.provider_retries;
                event.id_outside_signature = self.id_outside_signature;
                event.signed_digest = prepared.signed_digest.or(signed_digest);
                event.verified_layout = verified_layout;
                event
            })
            .collect()
    }
}

/// Headers kept beside the payload: what the signature and the fields were read from, what the
/// provider says about the delivery (its retry marks, ...), content type and user agent.
/// Nothing else (no cookies, no authorization), and never a shared token (Okta's
/// `Authorization`, or the header its admin named): that header is the secret itself.
pub fn kept_headers(source: &Source, headers: &HeaderMap) -> serde_json::Value {
    let declared = source
        .signature
        .map(std::slice::from_ref)
        .unwrap_or_default();
    let secret_headers: Vec<&str> = source
        .scheme
        .provider()
        .signatures
        .iter()
        .chain(declared)
        .filter(|layout| layout.kind == crate::catalogue::Kind::Token)
        .filter_map(|layout| layout.header.as_deref())
        .collect();
    let names = signature::signature_headers(source.scheme)
        .iter()
        .copied()
        .chain(
            source
                .signature
                .map(|declared| signature::layout_headers(std::slice::from_ref(declared)))
                .unwrap_or_default(),
        )
        .chain(protocol::kept_headers(source.scheme))
        .chain(["content-type", "user-agent"])
        .filter_map(|name| http::HeaderName::from_bytes(name.as_bytes()).ok())
        .chain(source.fields.header_names().cloned());
    let mut kept = serde_json::Map::new();
    for name in names {
        if secret_headers.contains(&name.as_str()) {
            continue;
        }
        if let Some(value) = headers.get(&name).and_then(|v| v.to_str().ok()) {
            kept.insert(
                name.as_str().to_owned(),
                serde_json::Value::String(value.to_owned()),
            );
        }
    }
    serde_json::Value::Object(kept)
}

/// The body to keep, when the source is verified with a shared token sent inside it (Microsoft
/// Graph's `clientState` in each notification): the JSON without it (in every element of a
/// batch whose layout reads it from the first), re-serialised. `None` when no layout of the
/// source reads a token from the body, or the body is not JSON: the body is kept as sent. Like
/// a token header ([`kept_headers`]), the token is the secret itself and is never stored: not
/// in an event's payload, a batch's kept request, the buffer or a notice.
pub fn without_tokens(source: &Source, body: &[u8]) -> Option<Vec<u8>> {
    let declared = source
        .signature
        .map(std::slice::from_ref)
        .unwrap_or_default();
    let pointers: Vec<String> = source
        .scheme
        .provider()
        .signatures
        .iter()
        .chain(declared)
        .filter_map(|layout| layout.token_in_body())
        .map(|pointer| match &source.fields.elements {
            // The first element's token stands for every element's.
            Some(at) if at.form_field.is_none() => {
                let first = format!("{}/0/", at.pointer);
                match pointer.strip_prefix(&first) {
                    Some(rest) => format!("{}/*/{rest}", at.pointer),
                    None => pointer.to_owned(),
                }
            }
            _ => pointer.to_owned(),
        })
        .collect();
    if pointers.is_empty() {
        return None;
    }
    let mut value: serde_json::Value = serde_json::from_slice(body).ok()?;
    for pointer in &pointers {
        let segments: Vec<&str> = pointer.split('/').skip(1).collect();
        remove_at(&mut value, &segments);
    }
    serde_json::to_vec(&value).ok()
}

/// A body with its provider's volatile fields removed (fields that change between attempts of
/// one delivery: HubSpot's `attemptNumber`, Intercom's `delivery_attempts`, Xero's `entropy`),
/// re-serialised: what two attempts of one event have in common, to compare and to digest.
/// `None` when the source names none, or the body is not JSON (it is compared as it is).
fn without_volatile(source: &Source, body: &[u8]) -> Option<Vec<u8>> {
    if source.scheme.provider().fields.volatile.is_empty() {
        return None;
    }
    let mut value: serde_json::Value = serde_json::from_slice(body).ok()?;
    remove_volatile(source, &mut value);
    serde_json::to_vec(&value).ok()
}

/// Removes its provider's volatile fields from `value`.
fn remove_volatile(source: &Source, value: &mut serde_json::Value) {
    for pointer in &source.scheme.provider().fields.volatile {
        let segments: Vec<&str> = pointer.split('/').skip(1).collect();
        remove_at(value, &segments);
    }
}

/// Removes what `segments` (a JSON pointer's, `*` standing for every element of an array)
/// names from `value`.
fn remove_at(value: &mut serde_json::Value, segments: &[&str]) {
    let Some((first, rest)) = segments.split_first() else {
        return;
    };
    let key = first.replace("~1", "/").replace("~0", "~");
    match value {
        serde_json::Value::Object(map) if rest.is_empty() => {
            map.remove(&key);
        }
        serde_json::Value::Object(map) => {
            if let Some(inner) = map.get_mut(&key) {
                remove_at(inner, rest);
            }
        }
        serde_json::Value::Array(items) if *first == "*" => {
            for item in items {
                remove_at(item, rest);
            }
        }
        serde_json::Value::Array(items) => {
            if let Some(inner) = key.parse::<usize>().ok().and_then(|i| items.get_mut(i)) {
                remove_at(inner, rest);
            }
        }
        _ => {}
    }
}
