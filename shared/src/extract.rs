//! Reading an event's identity out of a verified delivery: external ID, type, entity, version
//! and provider sequence, each from the header or JSON pointer the source configures.

use chrono::DateTime;
use http::HeaderMap;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::domain::{ExternalId, FieldLocator, Scheme};

/// Where a source's events keep their fields.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldMap {
    pub external_id: FieldLocator,
    pub event_type: FieldLocator,
    #[serde(default)]
    pub entity_id: Option<FieldLocator>,
    #[serde(default)]
    pub entity_version: Option<FieldLocator>,
    /// Where the version is read when `entity_version` finds none (Shopify's deletes carry no
    /// `updated_at`: their version is `X-Shopify-Triggered-At`).
    #[serde(default)]
    pub entity_version_fallback: Option<FieldLocator>,
    /// What orders two events of one entity that carry the same version (Shopify's `updated_at`
    /// has one-second precision; `X-Shopify-Triggered-At` has nanoseconds).
    #[serde(default)]
    pub version_tiebreak: Option<FieldLocator>,
    #[serde(default)]
    pub sequence: Option<FieldLocator>,
    /// Where a batched delivery's events are (`crate::batches`): each element is filed as its
    /// own event, the other locators reading it. `None`: the delivery is one event.
    #[serde(default)]
    pub elements: Option<crate::domain::Elements>,
}

impl FieldMap {
    /// Where each provider puts its event id and type: the catalogue's `[fields]`.
    pub fn defaults_for(scheme: Scheme) -> Self {
        scheme.provider().fields.field_map()
    }

    /// Every locator it sets.
    pub fn locators(&self) -> impl Iterator<Item = &FieldLocator> {
        [Some(&self.external_id), Some(&self.event_type)]
            .into_iter()
            .chain([
                self.entity_id.as_ref(),
                self.entity_version.as_ref(),
                self.entity_version_fallback.as_ref(),
                self.version_tiebreak.as_ref(),
                self.sequence.as_ref(),
            ])
            .flatten()
    }

    pub fn reads_body(&self) -> bool {
        self.elements.is_some() || self.locators().any(FieldLocator::reads_body)
    }

    /// Headers the fields are read from, to keep beside the payload.
    pub fn header_names(&self) -> impl Iterator<Item = &http::HeaderName> {
        self.locators().flat_map(FieldLocator::headers)
    }
}

/// What the rest of the system knows an event by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventFields {
    pub external_id: ExternalId,
    pub event_type: String,
    pub entity_id: Option<String>,
    /// Integer versions as sent; RFC 3339 timestamps as Unix microseconds.
    pub entity_version: Option<i64>,
    /// Orders events of one entity and version (as `entity_version` is read).
    pub version_tiebreak: Option<i64>,
    pub sequence: Option<i64>,
}

/// A verified delivery the system cannot file. Recorded as an anomaly and answered 400.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExtractError {
    #[error("the body is not JSON ({0})")]
    NotJson(String),
    #[error("no {field} at {locator}")]
    Missing {
        field: &'static str,
        locator: String,
    },
    #[error("{field} at {locator}: {reason}")]
    Invalid {
        field: &'static str,
        locator: String,
        reason: String,
    },
    /// A batch of more events than one request may carry (`crate::batches::MAX_ELEMENTS`):
    /// refused as too large, nothing stored.
    #[error(
        "the batch at {locator} holds {count} events, more than the {limit} a request may carry"
    )]
    TooManyElements {
        locator: String,
        count: usize,
        limit: usize,
    },
}

impl ExtractError {
    /// The `ingest_anomalies.kind` this is recorded as.
    pub fn anomaly_kind(&self) -> &'static str {
        match self {
            ExtractError::NotJson(_) => "unparseable_payload",
            ExtractError::Missing { .. } => "missing_field",
            ExtractError::Invalid { .. } | ExtractError::TooManyElements { .. } => "invalid_field",
        }
    }
}

const MAX_FIELD_LEN: usize = 255;

pub fn extract(
    fields: &FieldMap,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<EventFields, ExtractError> {
    extract_delivery(fields, headers, body, None)
}

/// What a delivery's headers may claim about time when the signature does not cover them.
pub struct UnsignedHeaders<'a> {
    /// Whether the signature covers this header (lowercase name).
    pub signed: &'a (dyn Fn(&str) -> bool + Sync),
    /// When the delivery was received, as Unix microseconds.
    pub received_at_micros: i64,
}

/// [`extract`] for a delivery as received. A version or tiebreak read from a header the
/// signature does not cover (Shopify's `X-Shopify-Triggered-At`: a delete's version, every
/// event's tiebreak) is never later than the delivery's receipt: anyone can write that header
/// on a replayed signed body, and a forged future time would outrank every genuine change to
/// come (a delete versioned in 2099 is never undone). A version the signed body carries
/// (`updated_at`) is read from the body first, so a header never decides it when it is there.
pub fn extract_delivery(
    fields: &FieldMap,
    headers: &HeaderMap,
    body: &[u8],
    unsigned: Option<&UnsignedHeaders<'_>>,
) -> Result<EventFields, ExtractError> {
    let json = if fields.reads_body() {
        Some(serde_json::from_slice::<Value>(body).map_err(|e| {
            // serde_json's message names a line and column, never the content.
            ExtractError::NotJson(e.to_string())
        })?)
    } else {
        None
    };
    Reader {
        headers,
        body,
        json: json.as_ref(),
        envelope: json.as_ref(),
        element_index: None,
        digested: body,
        unsigned,
    }
    .fields(fields)
}

/// One element of a batched delivery, as [`extract_delivery`] reads a delivery: `json:`
/// locators read `element`, `envelope:` locators the request's JSON, `form:` locators and
/// headers the request, and `digest:sha256` is the digest of `digested` (the element's
/// canonical bytes).
///
/// A sequence read from the envelope numbers the batch's first element (Xero's
/// `firstEventSequence`, "the sequence number of the first event in this payload"): the
/// element at `index` (counting from 0, in the order sent) is that number plus `index`.
pub fn extract_element(
    fields: &FieldMap,
    headers: &HeaderMap,
    body: &[u8],
    (element, index): (&Value, usize),
    envelope: &Value,
    digested: &[u8],
    unsigned: Option<&UnsignedHeaders<'_>>,
) -> Result<EventFields, ExtractError> {
    Reader {
        headers,
        body,
        json: Some(element),
        envelope: Some(envelope),
        element_index: Some(index),
        digested,
        unsigned,
    }
    .fields(fields)
}

impl Reader<'_> {
    fn fields(&self, fields: &FieldMap) -> Result<EventFields, ExtractError> {
        let reader = self;
        let external_id = reader.required("event id", &fields.external_id)?;
        let external_id = ExternalId::parse(&external_id).map_err(|e| ExtractError::Invalid {
            field: "event id",
            locator: fields.external_id.to_string(),
            reason: e.reason,
        })?;
        let event_type = reader.required("event type", &fields.event_type)?;
        let entity_id = reader.optional("entity id", fields.entity_id.as_ref())?;
        let entity_version = match reader
            .version("entity version", fields.entity_version.as_ref())?
        {
            Some(version) => Some(version),
            None => reader.version("entity version", fields.entity_version_fallback.as_ref())?,
        };
        let version_tiebreak =
            reader.version("version tiebreak", fields.version_tiebreak.as_ref())?;
        let sequence = match &fields.sequence {
            Some(locator) => reader
                .optional("sequence", Some(locator))?
                .map(|raw| {
                    let first = raw
                        .parse::<i64>()
                        .map_err(|_| invalid("sequence", locator, "not an integer"))?;
                    // An envelope's number is the first element's; the others follow in order.
                    match (locator, reader.element_index) {
                        (FieldLocator::Envelope(_), Some(index)) => i64::try_from(index)
                            .ok()
                            .and_then(|index| first.checked_add(index))
                            .ok_or_else(|| invalid("sequence", locator, "out of range")),
                        _ => Ok(first),
                    }
                })
                .transpose()?,
            None => None,
        };
        Ok(EventFields {
            external_id,
            event_type,
            entity_id,
            entity_version,
            version_tiebreak,
            sequence,
        })
    }
}

struct Reader<'a> {
    headers: &'a HeaderMap,
    /// The request's bytes, which `form:` locators read.
    body: &'a [u8],
    /// What `json:` locators read: the body, or a batch's element.
    json: Option<&'a Value>,
    /// What `envelope:` locators read: the request's JSON.
    envelope: Option<&'a Value>,
    /// A batch element's place in its batch (from 0); `None` for a delivery read whole.
    element_index: Option<usize>,
    /// What `digest:sha256` digests: the body, or an element's canonical bytes.
    digested: &'a [u8],
    unsigned: Option<&'a UnsignedHeaders<'a>>,
}

impl Reader<'_> {
    fn required(
        &self,
        field: &'static str,
        locator: &FieldLocator,
    ) -> Result<String, ExtractError> {
        self.read(field, locator)?
            .ok_or_else(|| ExtractError::Missing {
                field,
                locator: locator.to_string(),
            })
    }

    fn optional(
        &self,
        field: &'static str,
        locator: Option<&FieldLocator>,
    ) -> Result<Option<String>, ExtractError> {
        match locator {
            Some(locator) => self.read(field, locator),
            None => Ok(None),
        }
    }

    /// A version (an integer, or an RFC 3339 timestamp as Unix microseconds), if present.
    fn version(
        &self,
        field: &'static str,
        locator: Option<&FieldLocator>,
    ) -> Result<Option<i64>, ExtractError> {
        let Some(locator) = locator else {
            return Ok(None);
        };
        let cap = match (locator, self.unsigned) {
            (FieldLocator::Header(name), Some(u)) if !(u.signed)(name.as_str()) => {
                Some(u.received_at_micros)
            }
            _ => None,
        };
        self.read(field, locator)?
            .map(|raw| {
                version_number(&raw)
                    .map(|v| cap.map_or(v, |cap| v.min(cap)))
                    .ok_or_else(|| {
                        invalid(
                            field,
                            locator,
                            "neither an integer nor a timestamp (RFC 3339, or with no offset: UTC)",
                        )
                    })
            })
            .transpose()
    }

    fn read(
        &self,
        field: &'static str,
        locator: &FieldLocator,
    ) -> Result<Option<String>, ExtractError> {
        let text = match locator {
            FieldLocator::Joined(parts) => {
                let mut joined = String::new();
                for (i, part) in parts.iter().enumerate() {
                    // Each part is held to a field's rules on its own, then the whole.
                    let Some(value) = self.read(field, part)? else {
                        return Ok(None);
                    };
                    if i > 0 {
                        joined.push(':');
                    }
                    for c in value.chars() {
                        if matches!(c, ':' | '\\') {
                            joined.push('\\');
                        }
                        joined.push(c);
                    }
                }
                Some(joined)
            }
            FieldLocator::Header(name) => match self.headers.get(name) {
                None => None,
                Some(value) => Some(
                    value
                        .to_str()
                        .map_err(|_| invalid(field, locator, "header is not visible ASCII"))?
                        .trim()
                        .to_owned(),
                ),
            },
            FieldLocator::Json(pointer) => match self.json.and_then(|j| j.pointer(pointer)) {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.trim().to_owned()),
                Some(Value::Number(n)) => Some(n.to_string()),
                Some(_) => return Err(invalid(field, locator, "not a string or a number")),
            },
            FieldLocator::Envelope(pointer) => {
                match self.envelope.and_then(|j| j.pointer(pointer)) {
                    None | Some(Value::Null) => None,
                    Some(Value::String(s)) => Some(s.trim().to_owned()),
                    Some(Value::Number(n)) => Some(n.to_string()),
                    Some(_) => return Err(invalid(field, locator, "not a string or a number")),
                }
            }
            FieldLocator::Form(name) => url::form_urlencoded::parse(self.body)
                .find(|(k, _)| k == name.as_str())
                .map(|(_, v)| v.trim().to_owned()),
            FieldLocator::BodyDigest => {
                use sha2::Digest as _;
                Some(hex::encode(sha2::Sha256::digest(self.digested)))
            }
        };
        match text {
            Some(t) if t.is_empty() => Ok(None),
            Some(t) if t.len() > MAX_FIELD_LEN => {
                Err(invalid(field, locator, "longer than 255 bytes"))
            }
            // PostgreSQL's text cannot hold a NUL: storing it would fail every time.
            Some(t) if t.contains('\0') => Err(invalid(
                field,
                locator,
                "contains a NUL character, which cannot be stored",
            )),
            other => Ok(other),
        }
    }
}

fn invalid(field: &'static str, locator: &FieldLocator, reason: &str) -> ExtractError {
    ExtractError::Invalid {
        field,
        locator: locator.to_string(),
        reason: reason.to_owned(),
    }
}

/// An integer, or an RFC 3339 timestamp as Unix microseconds.
/// A timestamp with no offset (WooCommerce's `date_modified_gmt`, `2017-03-22T16:28:08`) is
/// read as UTC: versions are compared within one provider's events, which all write theirs the
/// same way.
fn version_number(raw: &str) -> Option<i64> {
    raw.parse::<i64>()
        .ok()
        .or_else(|| {
            DateTime::parse_from_rfc3339(raw)
                .ok()
                .map(|t| t.timestamp_micros())
        })
        .or_else(|| {
            chrono::NaiveDateTime::parse_from_str(raw, "%Y-%m-%dT%H:%M:%S%.f")
                .ok()
                .map(|t| t.and_utc().timestamp_micros())
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    http::HeaderName::from_static(k),
                    HeaderValue::from_static(v),
                )
            })
            .collect()
    }

    /// A batch's envelope number is its first element's (Xero's `firstEventSequence`): each
    /// element's is that number plus its place in the batch; one read from the element itself is
    /// the element's own. A delivery read whole takes the number as it is.
    #[test]
    fn an_envelope_sequence_numbers_a_batch_from_its_first_element() {
        let mut fields = FieldMap::defaults_for(Scheme::Stripe);
        fields.external_id = FieldLocator::parse("json:/id").unwrap();
        fields.event_type = FieldLocator::parse("json:/type").unwrap();
        fields.sequence = Some(FieldLocator::parse("envelope:/firstEventSequence").unwrap());
        let envelope = serde_json::json!({"firstEventSequence": 41, "events": []});
        let element = serde_json::json!({"id": "e", "type": "t", "seq": 7});
        let read = |fields: &FieldMap, index| {
            extract_element(
                fields,
                &HeaderMap::new(),
                b"",
                (&element, index),
                &envelope,
                b"",
                None,
            )
            .unwrap()
            .sequence
        };
        assert_eq!([read(&fields, 0), read(&fields, 2)], [Some(41), Some(43)]);
        let mut own = fields.clone();
        own.sequence = Some(FieldLocator::parse("json:/seq").unwrap());
        assert_eq!(read(&own, 3), Some(7));
        let delivery = serde_json::json!({"id": "d", "type": "t", "firstEventSequence": 41});
        let whole = extract_delivery(
            &fields,
            &HeaderMap::new(),
            delivery.to_string().as_bytes(),
            None,
        )
        .unwrap();
        assert_eq!(whole.sequence, Some(41));
    }

    /// A joined id: each value as read, joined with ':', a ':' or backslash in a value escaped, so
    /// two lists of values never join alike; absent (a missing id) when any part is.
    #[test]
    fn a_joined_locator_joins_its_parts_and_is_absent_without_one() {
        let mut fields = FieldMap::defaults_for(Scheme::Stripe);
        fields.external_id =
            FieldLocator::parse("json:/psp + json:/code + header:x-kind + json:/n").unwrap();
        let h = headers(&[("x-kind", " live ")]);
        let id =
            |body: &[u8]| extract(&fields, &h, body).map(|f| f.external_id.as_str().to_owned());
        assert_eq!(
            id(br#"{"type":"t","psp":"8815","code":"CAPTURE","n":12}"#).unwrap(),
            "8815:CAPTURE:live:12"
        );
        let a = id(br#"{"type":"t","psp":"a:b","code":"c","n":1}"#).unwrap();
        let b = id(br#"{"type":"t","psp":"a","code":"b:c","n":1}"#).unwrap();
        assert_eq!(
            (a.as_str(), b.as_str()),
            (r"a\:b:c:live:1", r"a:b\:c:live:1")
        );
        let c = id(br#"{"type":"t","psp":"a\\","code":":c","n":1}"#).unwrap();
        assert_eq!(c, r"a\\:\:c:live:1");
        for missing in [
            &br#"{"type":"t","code":"CAPTURE","n":1}"#[..],
            br#"{"type":"t","psp":"","code":"CAPTURE","n":1}"#,
            br#"{"type":"t","psp":"1","code":null,"n":1}"#,
        ] {
            assert!(
                matches!(
                    extract(&fields, &h, missing),
                    Err(ExtractError::Missing { .. })
                ),
                "{}",
                String::from_utf8_lossy(missing)
            );
        }
        assert!(matches!(
            extract(
                &fields,
                &HeaderMap::new(),
                br#"{"type":"t","psp":"1","code":"c","n":1}"#
            ),
            Err(ExtractError::Missing { .. })
        ));
        assert_eq!(
            fields
                .header_names()
                .map(|n| n.as_str())
                .collect::<Vec<_>>(),
            ["x-kind"]
        );
    }

    /// Versions: integers as sent; RFC 3339 timestamps and ones with no offset (read as UTC) as
    /// Unix microseconds; anything else refused.
    #[test]
    fn versions_are_integers_or_timestamps_with_or_without_an_offset() {
        for (raw, micros) in [
            ("42", Some(42)),
            ("2017-03-22T16:28:08Z", Some(1_490_200_088_000_000)),
            ("2017-03-22T17:28:08+01:00", Some(1_490_200_088_000_000)),
            ("2017-03-22T16:28:08", Some(1_490_200_088_000_000)),
            ("2017-03-22T16:28:08.25", Some(1_490_200_088_250_000)),
            ("2017-03-22 16:28:08", None),
            ("2017-03-22", None),
            ("yesterday", None),
        ] {
            assert_eq!(version_number(raw), micros, "{raw}");
        }
    }

    #[test]
    fn stripe_defaults_read_id_type_and_object() {
        let body =
            br#"{"id":"evt_1","type":"payment_intent.succeeded","data":{"object":{"id":"pi_1"}}}"#;
        let got = extract(
            &FieldMap::defaults_for(Scheme::Stripe),
            &HeaderMap::new(),
            body,
        )
        .unwrap();
        assert_eq!(got.external_id.as_str(), "evt_1");
        assert_eq!(got.event_type, "payment_intent.succeeded");
        assert_eq!(got.entity_id.as_deref(), Some("pi_1"));
        assert_eq!(got.entity_version, None);
    }

    #[test]
    fn github_defaults_read_headers_and_ignore_the_body() {
        let h = headers(&[
            ("x-github-delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958"),
            ("x-github-event", "issues"),
        ]);
        let got = extract(
            &FieldMap::defaults_for(Scheme::Github),
            &h,
            b"payload=not-json",
        )
        .unwrap();
        assert_eq!(
            got.external_id.as_str(),
            "72d3162e-cc78-11e3-81ab-4c9367dc0958"
        );
        assert_eq!(got.event_type, "issues");
    }

    #[test]
    fn shopify_versions_are_timestamps() {
        let h = headers(&[
            ("x-shopify-webhook-id", "b54557e4"),
            ("x-shopify-topic", "orders/updated"),
            ("x-shopify-triggered-at", "2026-11-30T15:00:00.123456789Z"),
        ]);
        let body = br#"{"id":1,"admin_graphql_api_id":"gid://shopify/Order/1","updated_at":"2026-11-30T10:00:00-05:00"}"#;
        let shopify = FieldMap::defaults_for(Scheme::Shopify);
        let got = extract(&shopify, &h, body).unwrap();
        assert_eq!(got.entity_id.as_deref(), Some("1"));
        assert_eq!(got.entity_version, Some(1_796_050_800_000_000));
        assert_eq!(got.version_tiebreak, Some(1_796_050_800_123_456));
        // A delete is `{"id": N}`: the same entity, versioned by when it was triggered.
        let h = headers(&[
            ("x-shopify-webhook-id", "c0ffee"),
            ("x-shopify-topic", "orders/delete"),
            ("x-shopify-triggered-at", "2026-11-30T15:05:00.5Z"),
        ]);
        let got = extract(&shopify, &h, br#"{"id":1}"#).unwrap();
        assert_eq!(got.entity_id.as_deref(), Some("1"));
        assert_eq!(got.entity_version, Some(1_796_051_100_500_000));
        assert_eq!(got.version_tiebreak, got.entity_version);
    }

    #[test]
    fn an_unsigned_header_never_dates_an_event_after_its_receipt() {
        let shopify = FieldMap::defaults_for(Scheme::Shopify);
        let h = headers(&[
            ("x-shopify-webhook-id", "forged"),
            ("x-shopify-topic", "products/delete"),
            ("x-shopify-triggered-at", "2099-01-01T00:00:00Z"),
        ]);
        let received = 1_796_051_100_500_000;
        let unsigned = UnsignedHeaders {
            signed: &|_| false,
            received_at_micros: received,
        };
        let got = extract_delivery(&shopify, &h, br#"{"id":1}"#, Some(&unsigned)).unwrap();
        assert_eq!(got.entity_version, Some(received));
        assert_eq!(got.version_tiebreak, Some(received));
        // The signed body's own version is kept as it is; only the header's tiebreak is capped.
        let body = br#"{"id":1,"updated_at":"2026-11-30T10:00:00-05:00"}"#;
        let got = extract_delivery(&shopify, &h, body, Some(&unsigned)).unwrap();
        assert_eq!(got.entity_version, Some(1_796_050_800_000_000));
        assert_eq!(got.version_tiebreak, Some(received));
        // A header the signature covers is taken as sent.
        let signed = UnsignedHeaders {
            signed: &|name| name == "x-shopify-triggered-at",
            received_at_micros: received,
        };
        let got = extract_delivery(&shopify, &h, br#"{"id":1}"#, Some(&signed)).unwrap();
        assert_eq!(got.entity_version, Some(4_070_908_800_000_000));
    }

    #[test]
    fn unusable_bodies_say_why() {
        let stripe = FieldMap::defaults_for(Scheme::Stripe);
        assert!(matches!(
            extract(&stripe, &HeaderMap::new(), b"{not json"),
            Err(ExtractError::NotJson(_))
        ));
        assert_eq!(
            extract(&stripe, &HeaderMap::new(), br#"{"type":"x"}"#),
            Err(ExtractError::Missing {
                field: "event id",
                locator: "json:/id".into()
            })
        );
        assert_eq!(
            extract(
                &stripe,
                &HeaderMap::new(),
                br#"{"id":{"nested":1},"type":"x"}"#
            )
            .unwrap_err()
            .anomaly_kind(),
            "invalid_field"
        );
        for nul in [
            &br#"{"id":"e\u0000","type":"x"}"#[..],
            br#"{"id":"e","type":"x\u0000"}"#,
            br#"{"id":"e","type":"x","data":{"object":{"id":"\u0000"}}}"#,
        ] {
            let err = extract(&stripe, &HeaderMap::new(), nul).unwrap_err();
            assert_eq!(err.anomaly_kind(), "invalid_field", "{err}");
        }
        let mut with_sequence = stripe.clone();
        with_sequence.sequence = Some(FieldLocator::json("/seq"));
        assert!(
            extract(
                &with_sequence,
                &HeaderMap::new(),
                br#"{"id":"e","type":"x","seq":"12a"}"#
            )
            .is_err()
        );
        assert_eq!(
            extract(
                &with_sequence,
                &HeaderMap::new(),
                br#"{"id":"e","type":"x","seq":12}"#
            )
            .unwrap()
            .sequence,
            Some(12)
        );
    }
}
