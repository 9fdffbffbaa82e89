//! One catalogue entry, as its TOML file says it: the signature built from a small set of
//! primitives, where the event's fields are read, the endpoint handshake, the documented retry
//! policy and the backfill API. `docs/catalogue.md` describes the format for a reviewer.

use serde::{Deserialize, Serialize};

use crate::domain::FieldLocator;
use crate::extract::FieldMap;

/// A provider: everything the receiver needs to know about it, as data.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Provider {
    /// The scheme name sources configure (the file's name).
    pub name: String,
    /// As the provider calls itself.
    pub title: String,
    /// The page the signature algorithm is taken from.
    pub docs: String,
    /// Delivery headers worth keeping beside the payload for an operator.
    #[serde(default)]
    pub kept_headers: Vec<String>,
    /// One layout, or several (Standard Webhooks' `webhook-*` and `svix-*` headers): the first
    /// that applies to a delivery is used.
    #[serde(rename = "signature")]
    pub signatures: Vec<SignatureSpec>,
    pub fields: ProviderFields,
    #[serde(default)]
    pub handshake: HandshakeSpec,
    /// Signed messages about the subscription rather than events of it (Twitch's
    /// `revocation`): answered 204, kept for the operator, never stored as events.
    #[serde(default)]
    pub notices: Vec<NoticeSpec>,
    pub retries: Retries,
    #[serde(default)]
    pub backfill: Backfill,
    /// Where the provider publishes the addresses its webhooks come from, when it does: the
    /// second check a source may make of a signed delivery (`crate::address_ranges`).
    #[serde(default)]
    pub address_ranges: Option<AddressRangesSpec>,
    /// Known-answer vectors: the provider's own, or built from its documented algorithm.
    #[serde(default)]
    pub vectors: Vec<Vector>,
}

/// How a signature is made and where a delivery carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignatureSpec {
    /// The layout's name among its provider's (HubSpot's `v3`, `v1`, `v2`): what a source
    /// names to pin the layouts it accepts (`layouts = ["v3"]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A weaker layout the provider still sends beside a stronger one, for compatibility
    /// (HubSpot's v1 and v2: a plain SHA-256 of the secret and the body, no timestamp, open to
    /// length extension). Accepted only by a source whose `layouts` names it: by default a
    /// captured request stripped of its stronger signature is refused.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub legacy: bool,
    pub kind: Kind,
    /// `hmac` and `digest`: the hash function.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<Hash>,
    /// How the configured secret text becomes key bytes (a public key, for the asymmetric kinds).
    #[serde(default)]
    pub secret: SecretEncoding,
    /// When this layout applies; without it, when its signature header (or field) is present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when: Option<When>,
    /// The header carrying the signature ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// `header`, parsed once.
    #[serde(skip)]
    pub header_name: ParsedName,
    /// ... or a JSON pointer into the body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json: Option<String>,
    /// How the signature is written: hex by default, text for tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<Encoding>,
    /// A literal before the encoded signature (`sha256=`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub prefix: String,
    /// `key=value` items (Stripe's `t=..,v1=..`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub items: Option<Items>,
    /// `<version>,<signature>` entries (Standard Webhooks' `v1,<b64> v1,<b64>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub versions: Option<Versions>,
    /// The signed bytes, concatenated in order.
    #[serde(default)]
    pub signed: Vec<Part>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<TimestampSpec>,
    /// The headers whose values the signature covers besides the body.
    #[serde(default)]
    pub signed_headers: Vec<String>,
    /// A query parameter of the signed URL that carries the hex SHA-256 of the body (Twilio's
    /// `bodySHA256` on JSON posts): the body is covered through it, and must match it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_sha256_query: Option<String>,
    /// The provider's SDKs accept a signature over other forms of the signed URL (Twilio's): with
    /// its port removed or, without one, the scheme's default port added (after any
    /// credentials), and with a `'` in its query written `%27` or the reverse. Each form is
    /// tried; the URL as given first.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub url_variants: bool,
    /// Percent-encodings (`%3A`, as written: upper-case hex) the provider decodes in the URL
    /// before signing it (HubSpot v3's table). The URL is tried as given, then with these
    /// decoded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub url_decoded: Vec<String>,
    /// The provider lets whoever sets the webhook up name the header (Okta's event hooks): a
    /// source names it (`signature_header`), and `header` is the usual one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub header_named_by_source: bool,
    /// Whether this is the plain layout (`signature::plain`), worked out on first use.
    #[serde(skip)]
    pub plain: Derived<bool>,
}

/// Something worked out from a layout's text on first use and kept (a parsed header name,
/// whether the layout is the plain one): worked out again on every delivery, it would cost
/// each of them. It is not part of what a layout says, so two layouts equal in their text are
/// equal whether or not either has been used.
#[derive(Clone, Default)]
pub struct Derived<T>(std::sync::OnceLock<T>);

impl<T> Derived<T> {
    pub fn get_or_init(&self, work_out: impl FnOnce() -> T) -> &T {
        self.0.get_or_init(work_out)
    }
}

impl<T> PartialEq for Derived<T> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl<T> Eq for Derived<T> {}

impl<T> std::fmt::Debug for Derived<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Derived")
    }
}

/// A header name parsed on first use and kept: a lookup by text parses the name again on every
/// delivery.
pub type ParsedName = Derived<Option<http::HeaderName>>;

impl ParsedName {
    /// `text` as a header name, or `None` when it is not one (`catalogue::validate` refuses such
    /// a layout).
    pub fn get(&self, text: &str) -> Option<&http::HeaderName> {
        self.get_or_init(|| http::HeaderName::from_bytes(text.as_bytes()).ok())
            .as_ref()
    }
}

impl SignatureSpec {
    /// Whether a delivery this layout verifies is covered whole: its body is signed, or every
    /// form parameter of it, or its digest through the URL (Twilio's `bodySHA256`). Not a
    /// shared token, which signs nothing, nor a layout that signs a few values read from the
    /// body (Adyen) or beside it (Mailgun's timestamp and token): any other byte of such a
    /// delivery can be changed without the signature noticing.
    pub fn covers_body(&self) -> bool {
        self.kind != Kind::Token
            && (self.body_sha256_query.is_some()
                || self
                    .signed
                    .iter()
                    .any(|part| matches!(part, Part::Body | Part::FormSorted)))
    }

    /// Where a shared token sent inside the body is, as a JSON pointer: Microsoft Graph's
    /// `clientState` in each notification. `None` for every other layout. Such a token is the
    /// secret itself, and is never kept ([`crate::prepare::without_tokens`]).
    pub fn token_in_body(&self) -> Option<&str> {
        (self.kind == Kind::Token).then_some(())?;
        self.json.as_deref()
    }

    /// Whether the layout signs values of the first element of the array at `array` (a JSON
    /// pointer, `""` for a body that is the array) and nothing of the body beyond them: Adyen's
    /// `notification_items`, which reads its signature and signed values from
    /// `/notificationItems/0/...`. Each element of a batch carries its own such signature.
    pub fn signs_first_element_of(&self, array: &str) -> bool {
        let first = format!("{array}/0/");
        !self.covers_body()
            && self.json.as_deref().is_some_and(|j| j.starts_with(&first))
            && self
                .signed
                .iter()
                .all(|part| !matches!(part, Part::Json(j) if !j.starts_with(&first)))
    }

    /// Whether the layout signs values read from the delivery (form fields, JSON fields,
    /// headers, the URL) rather than its raw body: the signed string, not the bytes, is what
    /// the signature binds, and what the replay guard claims (`Verified::signed_digest`). A
    /// digest (it signs the secret) and a token (it signs nothing) do not; nor does a layout
    /// that signs only a timestamp, a method or literals, which says nothing of the event.
    pub fn binds_signed_values(&self) -> bool {
        matches!(self.kind, Kind::Hmac | Kind::Ed25519 | Kind::EcdsaP256)
            && !self.signed.contains(&Part::Body)
            && self.signed.iter().any(|part| {
                matches!(
                    part,
                    Part::FormSorted | Part::Json(_) | Part::Header(_) | Part::Url
                )
            })
    }

    pub fn encoding(&self) -> Encoding {
        self.encoding.unwrap_or(if self.kind == Kind::Token {
            Encoding::Text
        } else {
            Encoding::Hex
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A keyed MAC over the signed parts.
    Hmac,
    /// A plain hash over signed parts that include the secret (HubSpot v1 and v2).
    Digest,
    /// An Ed25519 signature, verified with the provider's public key.
    Ed25519,
    /// An ECDSA P-256 / SHA-256 signature (DER), verified with the provider's public key.
    EcdsaP256,
    /// A shared token the provider sends as is, compared in constant time.
    Token,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Hash {
    Sha1,
    Sha256,
    Sha512,
}

impl Hash {
    pub fn output_len(self) -> usize {
        match self {
            Hash::Sha1 => 20,
            Hash::Sha256 => 32,
            Hash::Sha512 => 64,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SecretEncoding {
    /// The text as typed.
    #[default]
    Utf8,
    Base64,
    /// Base64 after an optional `whsec_` prefix (Standard Webhooks).
    Whsec,
    /// An Ed25519 public key: base64 after an optional `whpk_` prefix (Standard Webhooks' v1a).
    Whpk,
    Hex,
    /// A PEM public key (`-----BEGIN PUBLIC KEY-----`).
    Pem,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    Hex,
    Base64,
    Base64url,
    /// The raw header text (tokens).
    Text,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct When {
    /// A header that is present (or, with `equals`, has that value) ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub equals: Option<String>,
    /// ... or a query parameter the URL the provider called carries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Items {
    pub separator: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pair: String,
    /// The key of a signature item; every item with it is a candidate.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub signature: String,
    /// The key of the timestamp item.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
    /// No keys: the first item is the timestamp and every other one a signature (Recurly's
    /// `<ms>,<sig>[,<sig>]`). `pair`, `signature` and `timestamp` are then not given.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub timestamp_first: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Versions {
    pub separator: String,
    pub pair: String,
    /// Entries of this version are candidates; others are skipped.
    pub version: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimestampSpec {
    /// Read from the signature header's timestamp item.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub item: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// `header`, parsed once.
    #[serde(skip)]
    pub header_name: ParsedName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json: Option<String>,
    #[serde(default)]
    pub format: TimestampFormat,
    /// The provider's documented tolerance: a source's default.
    pub tolerance_seconds: u32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TimestampFormat {
    #[default]
    Unix,
    UnixMs,
    Rfc3339,
}

/// One part of the signed bytes. Written in the file as a literal string or `{body}`,
/// `{timestamp}`, `{header:NAME}`, `{json:/pointer}`, `{url}`, `{method}`, `{form_sorted}`,
/// `{secret}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Part {
    Literal(String),
    Body,
    Timestamp,
    Header(String),
    Json(String),
    Url,
    Method,
    FormSorted,
    Secret,
}

impl TryFrom<String> for Part {
    type Error = String;
    fn try_from(raw: String) -> Result<Self, String> {
        let Some(inner) = raw.strip_prefix('{').and_then(|r| r.strip_suffix('}')) else {
            if raw.is_empty() {
                return Err("an empty literal part".into());
            }
            return Ok(Part::Literal(raw));
        };
        Ok(match inner {
            "body" => Part::Body,
            "timestamp" => Part::Timestamp,
            "url" => Part::Url,
            "method" => Part::Method,
            "form_sorted" => Part::FormSorted,
            "secret" => Part::Secret,
            _ => {
                if let Some(name) = inner.strip_prefix("header:") {
                    Part::Header(name.to_owned())
                } else if let Some(pointer) = inner.strip_prefix("json:") {
                    Part::Json(pointer.to_owned())
                } else {
                    return Err(format!(
                        "{raw:?} is none of {{body}}, {{timestamp}}, {{header:NAME}}, {{json:/pointer}}, {{url}}, {{method}}, {{form_sorted}}, {{secret}}"
                    ));
                }
            }
        })
    }
}

impl From<Part> for String {
    fn from(part: Part) -> String {
        match part {
            Part::Literal(text) => text,
            Part::Body => "{body}".into(),
            Part::Timestamp => "{timestamp}".into(),
            Part::Header(name) => format!("{{header:{name}}}"),
            Part::Json(pointer) => format!("{{json:{pointer}}}"),
            Part::Url => "{url}".into(),
            Part::Method => "{method}".into(),
            Part::FormSorted => "{form_sorted}".into(),
            Part::Secret => "{secret}".into(),
        }
    }
}

/// Where a provider's events keep their identity.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderFields {
    pub external_id: FieldLocator,
    pub event_type: FieldLocator,
    #[serde(default)]
    pub entity_id: Option<FieldLocator>,
    #[serde(default)]
    pub entity_version: Option<FieldLocator>,
    #[serde(default)]
    pub entity_version_fallback: Option<FieldLocator>,
    #[serde(default)]
    pub version_tiebreak: Option<FieldLocator>,
    #[serde(default)]
    pub sequence: Option<FieldLocator>,
    /// Whether the signature covers the event id (in the body or a signed header).
    pub id_signed: bool,
    /// The JSON pointer of the array a request's events arrive in, for a provider that sends
    /// several in one request (`""`: the body is the array). The receiver stores such a request
    /// as one event: the locators read its id and fields (from the first element or the
    /// envelope), and its payload holds every element.
    #[serde(default)]
    pub batch: Option<String>,
    /// Where the events of a request that carries several are (`json:/` for a body that is
    /// the array, `json:/data/events`, `form:mandrill_events`): each element is filed as its
    /// own event (`crate::batches`). The other locators then read the element (`json:`) or
    /// the request (`envelope:`, headers). Excludes `batch`.
    #[serde(default)]
    pub elements: Option<crate::domain::Elements>,
    /// The form field the provider's JSON arrives in when it posts a form
    /// (`application/x-www-form-urlencoded`) rather than JSON: GitHub's `payload`, the default
    /// content type of a GitHub webhook. The event is read from, and stored as, that JSON; the
    /// signature still covers the raw form bytes.
    #[serde(default)]
    pub json_form_field: Option<String>,
    /// JSON pointers of fields the provider changes between attempts of one delivery
    /// (HubSpot's `/*/attemptNumber`, `*` standing for every element of an array; Intercom's
    /// `/delivery_attempts`; Xero's `/entropy`). Two attempts are compared, and a body's digest
    /// taken, without them, so a retry is a duplicate, not a conflict or a second event; the
    /// stored bytes stay as received. No event id may read one.
    #[serde(default)]
    pub volatile: Vec<String>,
}

impl ProviderFields {
    pub fn field_map(&self) -> FieldMap {
        FieldMap {
            external_id: self.external_id.clone(),
            event_type: self.event_type.clone(),
            entity_id: self.entity_id.clone(),
            entity_version: self.entity_version.clone(),
            entity_version_fallback: self.entity_version_fallback.clone(),
            version_tiebreak: self.version_tiebreak.clone(),
            sequence: self.sequence.clone(),
            elements: self.elements.clone(),
        }
    }
}

/// A kind of signed message that is not an event: what tells it apart (a header's value) and
/// what of it the operator is shown.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoticeSpec {
    /// Its name in `provider_notices` and the logs (`revocation`).
    pub kind: String,
    /// The header, and its value, that marks it.
    pub header: String,
    pub equals: String,
    /// JSON pointers to what it is about and what it says (Twitch: `/subscription/type`,
    /// `/subscription/status`).
    #[serde(default)]
    pub subject: Option<String>,
    #[serde(default)]
    pub detail: Option<String>,
    /// What it means for the operator, and the page that says so.
    pub summary: String,
    pub docs: String,
}

/// A request the provider sends to check the endpoint, answered and never stored.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandshakeSpec {
    #[serde(default)]
    pub kind: HandshakeKind,
    #[serde(default)]
    pub docs: String,
    /// Known answers: requests of the handshake and what the provider requires in return. An
    /// entry with a handshake has at least one; the catalogue test answers each.
    #[serde(default)]
    pub vectors: Vec<HandshakeVector>,
}

/// A known answer of a handshake: the request, as it arrives (its signature verified with
/// `secret`, which Zoom's answer is keyed with), and the answer the provider requires.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandshakeVector {
    /// Where it comes from: the provider's documentation page or SDK test, or how it was built.
    pub source: String,
    #[serde(default)]
    pub secret: String,
    #[serde(default = "post")]
    pub method: String,
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    pub body: String,
    /// The URL it is sent to, query included (Microsoft Graph's token is a query parameter).
    #[serde(default)]
    pub url: Option<String>,
    pub answer: HandshakeAnswer,
}

/// What a handshake is answered: a status, and a body of a content type (`application/json`
/// bodies compared as JSON), or no body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandshakeAnswer {
    pub status: u16,
    #[serde(default)]
    pub content_type: Option<String>,
    #[serde(default)]
    pub body: String,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HandshakeKind {
    #[default]
    None,
    /// Slack's signed `{"type": "url_verification", "challenge": ...}`: answer the challenge.
    SlackUrlVerification,
    /// Zoom's `endpoint.url_validation`: answer the plain token and its HMAC.
    ZoomUrlValidation,
    /// Twitch EventSub's `webhook_callback_verification`: answer the challenge as text.
    TwitchCallbackVerification,
    /// Discord's PING (`{"type": 1}`): answer `{"type": 1}`.
    DiscordPing,
    /// Okta's one-time GET with `X-Okta-Verification-Challenge`.
    OktaVerification,
    /// Xero's intent to receive: a signed delivery with no events, answered 200.
    XeroIntentToReceive,
    /// WooCommerce's ping when a webhook is saved or activated: an UNSIGNED POST whose body is
    /// `webhook_id=<n>`, answered 200 (WooCommerce shows the admin an error for any other
    /// status and pings again on the next save). The only handshake answered before a
    /// signature: WooCommerce signs none, and nothing is stored or read for it.
    WoocommercePing,
    /// Mailchimp Transactional's (Mandrill's) URL check when a webhook or an inbound route is
    /// added: an unsigned `HEAD`, answered 200 with nothing stored or read (Mandrill falls back
    /// to a POST signed with another key only when the HEAD fails).
    MandrillHead,
    /// Microsoft Graph's validation of a notification URL when a subscription is created or
    /// renewed: a request with no body and the query parameter `validationToken`, unsigned
    /// (`clientState` is in notifications only), answered 200 `text/plain` with the token
    /// decoded, nothing stored.
    GraphValidationToken,
}

impl HandshakeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            HandshakeKind::None => "none",
            HandshakeKind::SlackUrlVerification => "slack_url_verification",
            HandshakeKind::ZoomUrlValidation => "zoom_url_validation",
            HandshakeKind::TwitchCallbackVerification => "twitch_callback_verification",
            HandshakeKind::DiscordPing => "discord_ping",
            HandshakeKind::OktaVerification => "okta_verification",
            HandshakeKind::XeroIntentToReceive => "xero_intent_to_receive",
            HandshakeKind::WoocommercePing => "woocommerce_ping",
            HandshakeKind::MandrillHead => "mandrill_head",
            HandshakeKind::GraphValidationToken => "graph_validation_token",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Retries {
    pub summary: String,
    pub docs: String,
    /// A header the provider sets on its retries (Slack's `x-slack-retry-num`).
    #[serde(default)]
    pub marks_retries: String,
    /// The status, with an empty body, the provider requires for an event it received (Discord's
    /// Webhook Events: 204); absent: 200 with the JSON receipt (`{"status":"accepted"}`).
    #[serde(default)]
    pub acknowledge: Option<u16>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Backfill {
    /// The list or redelivery API, or empty when the provider has none.
    #[serde(default)]
    pub api: String,
    #[serde(default)]
    pub docs: String,
}

/// Where a provider publishes the addresses its webhooks are sent from: a JSON document at
/// `url` with the CIDRs (or bare addresses) as an array of strings at the JSON pointer
/// `pointer` (GitHub's meta API, `/hooks`; Stripe's `ips_webhooks.json`, `/WEBHOOKS`), fetched
/// by the ranges pass; or a fixed list, `cidrs`, that the provider's page gives and the entry
/// carries. Exactly one of the two.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddressRangesSpec {
    #[serde(default)]
    pub url: Option<String>,
    #[serde(default)]
    pub pointer: Option<String>,
    #[serde(default)]
    pub cidrs: Vec<String>,
    /// The provider's page that says where its webhooks come from.
    pub docs: String,
}

/// A known-answer vector: a delivery and whether it must verify.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Vector {
    /// Where it comes from: the SDK test file or documentation page, or "constructed from the
    /// documented algorithm (<url>)".
    pub source: String,
    /// The layouts accepted when it is verified, as a source's `layouts` names them (a legacy
    /// layout's vector names it); absent: the provider's default.
    #[serde(default)]
    pub layouts: Option<Vec<String>>,
    pub secret: String,
    /// The Unix time to verify at.
    pub now: i64,
    #[serde(default = "post")]
    pub method: String,
    #[serde(default)]
    pub url: Option<String>,
    pub headers: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    pub body: Option<String>,
    #[serde(default)]
    pub body_base64: Option<String>,
    pub valid: bool,
}

impl Vector {
    /// The body as the request carries it: `body` as text, or `body_base64` decoded (exactly
    /// one is set, and it decodes: [`super::load`] refuses an entry otherwise).
    pub fn body_bytes(&self) -> Result<Vec<u8>, base64::DecodeError> {
        use base64::Engine as _;
        match (&self.body, &self.body_base64) {
            (Some(text), _) => Ok(text.as_bytes().to_vec()),
            (None, Some(b64)) => base64::engine::general_purpose::STANDARD.decode(b64),
            (None, None) => Ok(Vec::new()),
        }
    }
}

fn post() -> String {
    "POST".into()
}

/// A vector's headers as a request carries them (names lower-cased); the first that is not a
/// header, named.
pub fn vector_headers(
    headers: &std::collections::BTreeMap<String, String>,
) -> Result<http::HeaderMap, String> {
    let mut map = http::HeaderMap::new();
    for (name, value) in headers {
        let name = http::HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes())
            .map_err(|e| format!("header {name:?}: {e}"))?;
        let value =
            http::HeaderValue::from_str(value).map_err(|e| format!("header {name}: {e}"))?;
        map.append(name, value);
    }
    Ok(map)
}
