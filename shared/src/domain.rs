//! Domain values parsed at the edge: once one of these exists, it is valid.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A value failed to parse into a domain type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what}: {reason}")]
pub struct ParseError {
    pub what: &'static str,
    pub reason: String,
}

impl ParseError {
    pub fn new(what: &'static str, reason: impl Into<String>) -> Self {
        Self {
            what,
            reason: reason.into(),
        }
    }
}

/// The route segment naming a configured source: `POST /webhooks/{source_id}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SourceId(String);

impl SourceId {
    pub fn parse(raw: &str) -> Result<Self, ParseError> {
        let ok_first = raw
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric());
        let ok_rest = raw
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
        if raw.is_empty() || raw.len() > 64 || !ok_first || !ok_rest {
            return Err(ParseError::new(
                "source id",
                "1-64 characters of [A-Za-z0-9_.-], starting with a letter or digit",
            ));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The tenant owning a source. Comes from trusted configuration only.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct TenantId(String);

impl TenantId {
    pub fn parse(raw: &str) -> Result<Self, ParseError> {
        if raw.is_empty() || raw.len() > 128 || raw.chars().any(char::is_control) {
            return Err(ParseError::new(
                "tenant id",
                "1-128 characters, no control characters",
            ));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The provider's own identifier of an event: the deduplication key within a tenant.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ExternalId(String);

impl ExternalId {
    pub const MAX_LEN: usize = 255;

    pub fn parse(raw: &str) -> Result<Self, ParseError> {
        let trimmed = raw.trim();
        if trimmed.is_empty() {
            return Err(ParseError::new("event id", "empty"));
        }
        if trimmed.len() > Self::MAX_LEN {
            return Err(ParseError::new(
                "event id",
                format!("{} bytes, longer than {}", trimmed.len(), Self::MAX_LEN),
            ));
        }
        if trimmed.chars().any(char::is_control) {
            return Err(ParseError::new("event id", "contains control characters"));
        }
        Ok(Self(trimmed.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

macro_rules! string_conversions {
    ($($ty:ident),*) => {$(
        impl TryFrom<String> for $ty {
            type Error = ParseError;
            fn try_from(raw: String) -> Result<Self, Self::Error> {
                Self::parse(&raw)
            }
        }
        impl From<$ty> for String {
            fn from(value: $ty) -> Self {
                value.0
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    )*};
}
string_conversions!(SourceId, TenantId, ExternalId);

/// A provider of the catalogue (`shared/providers/*.toml`): how it signs its deliveries, where
/// its events keep their fields, how it checks an endpoint. Written as the entry's name
/// (`stripe`, `standard_webhooks`, ...) in configuration and in the `sources` table. Each entry
/// has a constant named after it (`Scheme::Stripe`, `Scheme::StandardWebhooks`), generated from
/// the catalogue's file names, and [`Scheme::ALL`] lists them.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scheme(pub(crate) u16);

include!(concat!(env!("OUT_DIR"), "/scheme_names.rs"));

/// The scheme name of a source that declares its own signature ([`Scheme::Declared`]).
pub const DECLARED_NAME: &str = "declared";

impl Scheme {
    /// The entry's name, as configured (`declared` for [`Scheme::Declared`]). The entry itself
    /// is `Scheme::provider`, in `catalogue`.
    pub fn as_str(self) -> &'static str {
        NAMES
            .get(usize::from(self.0))
            .copied()
            .unwrap_or(DECLARED_NAME)
    }
}

impl fmt::Debug for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Scheme({})", self.as_str())
    }
}

impl FromStr for Scheme {
    type Err = ParseError;
    fn from_str(raw: &str) -> Result<Self, Self::Err> {
        Scheme::ALL
            .into_iter()
            .chain([Scheme::Declared])
            .find(|s| s.as_str() == raw)
            .ok_or_else(|| {
                ParseError::new(
                    "scheme",
                    format!(
                        "{raw:?} is not a provider of the catalogue (`hookctl providers list` names them), nor `declared`"
                    ),
                )
            })
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

impl Serialize for Scheme {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Scheme {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        raw.parse().map_err(serde::de::Error::custom)
    }
}

/// Where a field of an event is read: a request header, a JSON pointer into the body, a form
/// parameter, (for providers that send no event id: Zoom, Calendly, Xero) the SHA-256 of the
/// raw body, or several of the first three joined (Adyen's pspReference, eventCode and
/// success). Written `header:<name>`, `json:<pointer>`, `form:<name>`, `digest:sha256` or
/// `<part> + <part> ...` in configuration and in the `sources` table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum FieldLocator {
    Header(http::HeaderName),
    Json(String),
    /// A parameter of a form-encoded body (Twilio's `MessageSid`).
    Form(String),
    /// A JSON pointer into the whole request, where the other JSON locators of a batched
    /// source read its element (`crate::batches`): what scopes an element, sent once beside
    /// the elements (a tenant id). For a source that is not batched, the same as `json:`.
    Envelope(String),
    /// The body's SHA-256, hex: a redelivery of the same bytes is the same event.
    BodyDigest,
    /// The values of two or more header, JSON or form locators, joined with `:` (a `:` or `\`
    /// within a value escaped with `\`, so two different lists of values never join alike);
    /// absent when any part is. For a provider that signs a few values and not the body
    /// (Adyen): an id read from those values is bound to what the signature covers, where the
    /// body's digest changes with any unsigned byte.
    Joined(Vec<FieldLocator>),
}

/// How the parts of a [`FieldLocator::Joined`] are written.
const JOINED_BY: &str = " + ";

impl FieldLocator {
    pub fn parse(raw: &str) -> Result<Self, ParseError> {
        if raw.contains(JOINED_BY) {
            let parts = raw
                .split(JOINED_BY)
                .map(|part| match Self::parse_one(part)? {
                    Self::BodyDigest => Err(ParseError::new(
                        "field locator",
                        format!("{raw:?}: digest:sha256 is the whole body and joins nothing"),
                    )),
                    one => Ok(one),
                })
                .collect::<Result<Vec<_>, _>>()?;
            return Ok(Self::Joined(parts));
        }
        Self::parse_one(raw)
    }

    fn parse_one(raw: &str) -> Result<Self, ParseError> {
        if let Some(name) = raw.strip_prefix("header:") {
            let name = http::HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| {
                ParseError::new("field locator", format!("bad header name in {raw:?}"))
            })?;
            Ok(Self::Header(name))
        } else if let Some(pointer) = raw.strip_prefix("json:") {
            if !(pointer.is_empty() || pointer.starts_with('/')) {
                return Err(ParseError::new(
                    "field locator",
                    format!("JSON pointer in {raw:?} must start with '/'"),
                ));
            }
            Ok(Self::Json(pointer.to_owned()))
        } else if let Some(pointer) = raw.strip_prefix("envelope:") {
            if !pointer.starts_with('/') {
                return Err(ParseError::new(
                    "field locator",
                    format!("JSON pointer in {raw:?} must start with '/'"),
                ));
            }
            Ok(Self::Envelope(pointer.to_owned()))
        } else if let Some(name) = raw.strip_prefix("form:") {
            if name.is_empty() {
                return Err(ParseError::new(
                    "field locator",
                    "form: needs a parameter name",
                ));
            }
            Ok(Self::Form(name.to_owned()))
        } else if raw == "digest:sha256" {
            Ok(Self::BodyDigest)
        } else {
            Err(ParseError::new(
                "field locator",
                format!(
                    "{raw:?} is none of 'header:<name>', 'json:<pointer>', 'envelope:<pointer>', 'form:<name>', 'digest:sha256', '<part> + <part>'"
                ),
            ))
        }
    }

    pub fn json(pointer: &str) -> Self {
        Self::parse(&format!("json:{pointer}")).expect("static JSON pointer")
    }

    pub fn header(name: &'static str) -> Self {
        Self::Header(http::HeaderName::from_static(name))
    }

    /// Whether the body is parsed as JSON to read it.
    pub fn reads_body(&self) -> bool {
        self.parts()
            .iter()
            .any(|part| matches!(part, Self::Json(_) | Self::Envelope(_)))
    }

    /// The request headers it reads.
    pub fn headers(&self) -> impl Iterator<Item = &http::HeaderName> {
        self.parts().iter().filter_map(|part| match part {
            Self::Header(name) => Some(name),
            _ => None,
        })
    }

    /// The single locators it reads: a joined one's parts (never joined themselves: `parse`
    /// reads each part as one locator), or itself.
    pub fn parts(&self) -> &[FieldLocator] {
        match self {
            Self::Joined(parts) => parts,
            one => std::slice::from_ref(one),
        }
    }
}

impl TryFrom<String> for FieldLocator {
    type Error = ParseError;
    fn try_from(raw: String) -> Result<Self, Self::Error> {
        Self::parse(&raw)
    }
}

impl From<FieldLocator> for String {
    fn from(value: FieldLocator) -> Self {
        value.to_string()
    }
}

impl fmt::Display for FieldLocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Header(name) => write!(f, "header:{name}"),
            Self::Json(pointer) => write!(f, "json:{pointer}"),
            Self::Envelope(pointer) => write!(f, "envelope:{pointer}"),
            Self::Form(name) => write!(f, "form:{name}"),
            Self::BodyDigest => f.write_str("digest:sha256"),
            Self::Joined(parts) => {
                for (i, part) in parts.iter().enumerate() {
                    if i > 0 {
                        f.write_str(JOINED_BY)?;
                    }
                    write!(f, "{part}")?;
                }
                Ok(())
            }
        }
    }
}

/// Which of a source's signing secrets verified a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SecretVersion {
    Current,
    Previous,
}

impl SecretVersion {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Current => "current",
            Self::Previous => "previous",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn source_ids_are_route_safe() {
        assert!(SourceId::parse("stripe-prod_1.eu").is_ok());
        for bad in ["", "-lead", "has space", "slash/inside", &"x".repeat(65)] {
            assert!(SourceId::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn external_ids_are_trimmed_and_bounded() {
        assert_eq!(ExternalId::parse("  evt_1 ").unwrap().as_str(), "evt_1");
        assert!(ExternalId::parse("   ").is_err());
        assert!(ExternalId::parse(&"a".repeat(256)).is_err());
        assert!(ExternalId::parse("a\nb").is_err());
    }

    #[test]
    fn locators_round_trip() {
        for raw in [
            "header:x-github-delivery",
            "json:/data/object/id",
            "json:",
            "form:MessageSid",
            "digest:sha256",
            "json:/a/pspReference + json:/a/eventCode + header:x-kind + form:Sid",
        ] {
            assert_eq!(FieldLocator::parse(raw).unwrap().to_string(), raw);
        }
        // A pointer may hold a '+' and a space; only " + " joins.
        assert_eq!(
            FieldLocator::parse("json:/a+b /c").unwrap(),
            FieldLocator::Json("/a+b /c".into())
        );
        for joined in [
            "json:/a + digest:sha256",
            "json:/a + ",
            " + json:/a",
            "json:/a + json:b",
            "json:/a + + json:/b",
        ] {
            assert!(FieldLocator::parse(joined).is_err(), "{joined}");
        }
        assert!(FieldLocator::parse("json:id").is_err());
        assert!(FieldLocator::parse("query:id").is_err());
        assert!(FieldLocator::parse("header:bad header").is_err());
    }

    #[test]
    fn schemes_round_trip() {
        for scheme in Scheme::ALL {
            assert_eq!(scheme.as_str().parse::<Scheme>().unwrap(), scheme);
        }
        assert!("svix2".parse::<Scheme>().is_err());
    }

    proptest! {
        #[test]
        fn source_id_parse_never_panics_and_accepts_only_safe_text(raw in ".{0,80}") {
            if let Ok(id) = SourceId::parse(&raw) {
                prop_assert!(id.as_str().bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b)));
            }
        }
    }
}

/// The most events one request may carry (Segment's batch API takes 4 000 an HTTP call, the
/// largest of the catalogue's batches). A larger batch is refused as too large, nothing stored.
pub const MAX_ELEMENTS: usize = 4000;

/// Where a batched delivery's events are: an array in its JSON (`json:/data/events`; `json:/`
/// for a body that is the array) or in the JSON a form field carries (`form:mandrill_events`,
/// the array at its root).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Elements {
    /// The form field whose value is the JSON; `None`: the body is.
    pub form_field: Option<String>,
    /// The JSON pointer of the array in that JSON (`""`: the JSON is the array).
    pub pointer: String,
}

impl Elements {
    pub fn parse(raw: &str) -> Result<Self, ParseError> {
        if let Some(field) = raw.strip_prefix("form:") {
            if field.is_empty() {
                return Err(ParseError::new("elements", "form: needs a field name"));
            }
            return Ok(Self {
                form_field: Some(field.to_owned()),
                pointer: String::new(),
            });
        }
        let Some(pointer) = raw.strip_prefix("json:") else {
            return Err(ParseError::new(
                "elements",
                format!("{raw:?} is neither 'json:<pointer>' nor 'form:<field>'"),
            ));
        };
        let pointer = match pointer {
            // The body itself: `json:/` reads as an operator means it, not as the key "".
            "" | "/" => String::new(),
            p if p.starts_with('/') => p.to_owned(),
            _ => {
                return Err(ParseError::new(
                    "elements",
                    format!("JSON pointer in {raw:?} must start with '/'"),
                ));
            }
        };
        Ok(Self {
            form_field: None,
            pointer,
        })
    }

    /// The pointer, in the request's JSON, of what `pointer` (a JSON pointer into an element)
    /// reads in every element: `/data/events/*/uuid` for `/uuid`.
    pub fn in_request(&self, pointer: &str) -> String {
        format!("{}/*{pointer}", self.pointer)
    }
}

impl fmt::Display for Elements {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.form_field {
            Some(field) => write!(f, "form:{field}"),
            None if self.pointer.is_empty() => f.write_str("json:/"),
            None => write!(f, "json:{}", self.pointer),
        }
    }
}

impl TryFrom<String> for Elements {
    type Error = ParseError;
    fn try_from(raw: String) -> Result<Self, Self::Error> {
        Self::parse(&raw)
    }
}

impl From<Elements> for String {
    fn from(value: Elements) -> Self {
        value.to_string()
    }
}
