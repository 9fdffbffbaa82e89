//! What a subscriber receives, on every destination: a JSON envelope with CloudEvents 1.0
//! attribute names (structured mode) and our own extension attributes.
//!
//! ```json
//! {"specversion": "1.0", "id": "<idempotency key>", "source": "/tenants/acme/sources/acme-github",
//!  "type": "issues.opened", "time": "2026-12-05T10:00:00.123Z", "subject": "42",
//!  "datacontenttype": "application/json", "data": {...},
//!  "tenant": "acme", "sourceid": "acme-github", "providerid": "<the provider's event id>",
//!  "provider": "github"}
//! ```
//!
//! `data` is the provider's JSON as JSON; a form body becomes an object of its fields (a field
//! given more than once, an array of its values); anything else is carried as `data_base64`.
//! An envelope without its data (`dataomitted`: `too_large` for a destination's limit, `purged`
//! when retention took the payload first) says in `datafetch` the operator request that returns
//! the event (`{"action":"show_event",...}` to the operator function).

use base64::Engine as _;
use serde_json::{Map, Value, json};

use crate::store::event_queue::ClaimedEvent;

/// The event's bytes as a subscriber receives them.
#[derive(Debug, Clone, PartialEq)]
pub enum Data {
    Json(Value),
    /// A form body (`a=1&b=2`), as an object of its fields.
    Form(Value),
    /// Anything else.
    Binary(Vec<u8>),
}

impl Data {
    /// The data as JSON, for a subscription's filter: JSON and forms; nothing else.
    pub fn as_json(self) -> Option<Value> {
        match self {
            Data::Json(v) | Data::Form(v) => Some(v),
            Data::Binary(_) => None,
        }
    }
}

/// JSON when it parses; a form when it is one (printable ASCII, `&`-separated `name=value`
/// pairs); else bytes.
pub fn data_of(payload: &[u8]) -> Data {
    if let Ok(value) = serde_json::from_slice::<Value>(payload) {
        return Data::Json(value);
    }
    if let Some(form) = form_fields(payload) {
        return Data::Form(form);
    }
    Data::Binary(payload.to_vec())
}

fn form_fields(payload: &[u8]) -> Option<Value> {
    if payload.is_empty() || !payload.iter().all(|b| b.is_ascii_graphic()) {
        return None;
    }
    if !payload
        .split(|b| *b == b'&')
        .all(|pair| pair.contains(&b'='))
    {
        return None;
    }
    let mut fields = Map::new();
    for (name, value) in url::form_urlencoded::parse(payload) {
        let value = Value::String(value.into_owned());
        match fields.get_mut(name.as_ref()) {
            None => {
                fields.insert(name.into_owned(), value);
            }
            Some(Value::Array(values)) => values.push(value),
            Some(first) => {
                let first = first.take();
                fields.insert(name.into_owned(), Value::Array(vec![first, value]));
            }
        }
    }
    Some(Value::Object(fields))
}

/// The CloudEvents `source` of a tenant's source.
pub fn source_uri(tenant_id: &str, source_id: &str) -> String {
    format!("/tenants/{tenant_id}/sources/{source_id}")
}

/// The operator request that returns the event, for an envelope sent without its data.
pub fn fetch_request(tenant_id: &str, external_id: &str) -> String {
    json!({"action": "show_event", "tenant_id": tenant_id, "external_id": external_id}).to_string()
}

/// The envelope of `event` for the message whose idempotency key is `key`.
pub fn of(event: &ClaimedEvent, key: &str) -> Value {
    let mut e = Map::new();
    e.insert("specversion".into(), "1.0".into());
    e.insert("id".into(), key.into());
    e.insert(
        "source".into(),
        source_uri(&event.tenant_id, &event.source_id).into(),
    );
    e.insert("type".into(), event.event_type.clone().into());
    e.insert(
        "time".into(),
        event
            .first_received_at
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
            .into(),
    );
    if let Some(entity) = &event.entity_id {
        e.insert("subject".into(), entity.clone().into());
    }
    e.insert("tenant".into(), event.tenant_id.clone().into());
    e.insert("sourceid".into(), event.source_id.clone().into());
    e.insert("providerid".into(), event.external_id.clone().into());
    e.insert("provider".into(), event.scheme.clone().into());
    match event.payload.as_deref().map(data_of) {
        Some(Data::Json(v) | Data::Form(v)) => {
            e.insert("datacontenttype".into(), "application/json".into());
            e.insert("data".into(), v);
        }
        Some(Data::Binary(bytes)) => {
            e.insert("datacontenttype".into(), "application/octet-stream".into());
            e.insert(
                "data_base64".into(),
                base64::engine::general_purpose::STANDARD
                    .encode(bytes)
                    .into(),
            );
        }
        None => omit(&mut e, "purged", &event.tenant_id, &event.external_id),
    }
    Value::Object(e)
}

fn omit(e: &mut Map<String, Value>, why: &str, tenant_id: &str, external_id: &str) {
    e.remove("data");
    e.remove("data_base64");
    e.insert("dataomitted".into(), why.into());
    e.insert(
        "datafetch".into(),
        fetch_request(tenant_id, external_id).into(),
    );
}

/// The envelope without its data, for a destination whose limit it exceeds: marked
/// `dataomitted: too_large`, with the request that fetches it. `None` when `envelope` is not
/// one of ours.
pub fn without_data(envelope: &Value) -> Option<Value> {
    let mut e = envelope.as_object()?.clone();
    let tenant = e.get("tenant")?.as_str()?.to_owned();
    let external_id = e.get("providerid")?.as_str()?.to_owned();
    omit(&mut e, "too_large", &tenant, &external_id);
    Some(Value::Object(e))
}

/// (type, source, tenant) of an envelope, for message attributes.
pub fn attributes(envelope: &Value) -> Option<[(&'static str, &str); 3]> {
    Some([
        ("type", envelope.get("type")?.as_str()?),
        ("source", envelope.get("source")?.as_str()?),
        ("tenant", envelope.get("tenant")?.as_str()?),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_is_json_a_form_or_bytes() {
        assert_eq!(
            data_of(br#"{"a":1}"#),
            Data::Json(serde_json::json!({"a": 1}))
        );
        assert_eq!(
            data_of(b"From=%2B1555&Body=hi+there&To=a&To=b"),
            Data::Form(serde_json::json!({"From": "+1555", "Body": "hi there", "To": ["a", "b"]}))
        );
        assert_eq!(data_of(b"plain text"), Data::Binary(b"plain text".to_vec()));
        assert_eq!(data_of(&[0xff, 0x00]), Data::Binary(vec![0xff, 0x00]));
        assert_eq!(data_of(b""), Data::Binary(vec![]));
    }
}
