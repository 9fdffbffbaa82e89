//! Batches: a request that carries several events (HubSpot's array, SendGrid's, Okta's
//! `data.events`, Mandrill's `mandrill_events` form field), each element filed as its own event.
//!
//! The signature is verified once over the request. [`crate::prepare::prepare`] then reads every
//! element with the source's field map (`json:` locators relative to the element, `envelope:`
//! ones to the request), and ingest stores them all with the buffer's set-wise upsert in one
//! transaction, beside the request's bytes kept once (`batch_requests`): every element or none.
//! An element stores its own JSON; it is compared and digested in canonical form (keys sorted,
//! without the entry's volatile fields), so the same element inside another batch, in another
//! order or with a new attempt number, is a duplicate.

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::domain::{Elements, MAX_ELEMENTS};
use crate::extract::ExtractError;
use crate::store::webhook_events::DeliveryOutcome;

/// The array of events in a batched delivery's JSON: refused when it is not one, is empty (a
/// request that carries no event is not filed as none: it is kept as an anomaly), or holds more
/// than [`MAX_ELEMENTS`].
pub fn elements<'v>(elements: &Elements, json: &'v Value) -> Result<&'v [Value], ExtractError> {
    let missing = || ExtractError::Missing {
        field: "batch of events",
        locator: elements.to_string(),
    };
    let found = json.pointer(&elements.pointer).ok_or_else(missing)?;
    let Value::Array(items) = found else {
        return Err(ExtractError::Invalid {
            field: "batch of events",
            locator: elements.to_string(),
            reason: "not an array".into(),
        });
    };
    if items.is_empty() {
        return Err(missing());
    }
    if items.len() > MAX_ELEMENTS {
        return Err(ExtractError::TooManyElements {
            locator: elements.to_string(),
            count: items.len(),
            limit: MAX_ELEMENTS,
        });
    }
    Ok(items)
}

/// Verifies every element of a batch whose layout signs values of the first element alone
/// (Adyen's `notification_items`: each item carries its own HMAC over its own fields,
/// [`crate::catalogue::SignatureSpec::signs_first_element_of`]): each element is presented as
/// the first of the request, the rest of the request as it is, and verified with the same
/// layout and secrets. Returns each element's signed digest (what its replay guard claims), in
/// order; the first error refuses the whole request. `None`: the layout covers every element
/// already (it signs the body), or the batch is not in the JSON body.
pub fn verify_each_element(
    spec: &'static crate::catalogue::SignatureSpec,
    request: &crate::signature::Request<'_>,
    at: &Elements,
    secrets: &crate::secrets::SecretSet,
    tolerance: std::time::Duration,
    now_unix: i64,
) -> Result<Option<Vec<Option<[u8; 32]>>>, crate::signature::VerifyError> {
    if at.form_field.is_some() || !spec.signs_first_element_of(&at.pointer) {
        return Ok(None);
    }
    let unreadable = || crate::signature::VerifyError::UnreadableBody {
        reason: format!("no JSON array at {at}"),
    };
    let mut json: Value = serde_json::from_slice(request.body).map_err(|_| unreadable())?;
    let slot = json.pointer_mut(&at.pointer).ok_or_else(unreadable)?;
    let Value::Array(items) = std::mem::take(slot) else {
        return Err(unreadable());
    };
    let mut digests = Vec::with_capacity(items.len());
    for item in items {
        if let Some(slot) = json.pointer_mut(&at.pointer) {
            *slot = Value::Array(vec![item]);
        }
        let body = serde_json::to_vec(&json).map_err(|_| unreadable())?;
        let alone = crate::signature::Request {
            body: &body,
            ..*request
        };
        let verified = crate::signature::verify_with(spec, &alone, secrets, tolerance, now_unix)?;
        digests.push(verified.signed_digest);
    }
    Ok(Some(digests))
}

/// What became of a batch's elements: the answer's `elements` object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ElementCounts {
    pub accepted: u32,
    pub duplicate: u32,
    pub conflict: u32,
}

impl ElementCounts {
    pub fn count(&mut self, outcome: DeliveryOutcome) {
        match outcome {
            DeliveryOutcome::Accepted => self.accepted += 1,
            DeliveryOutcome::Duplicate => self.duplicate += 1,
            DeliveryOutcome::Conflict => self.conflict += 1,
        }
    }

    /// The batch's outcome in one word, as a single delivery's: `accepted` when any element
    /// was new, else `conflict` when any conflicted, else `duplicate`.
    pub fn outcome(&self) -> DeliveryOutcome {
        if self.accepted > 0 {
            DeliveryOutcome::Accepted
        } else if self.conflict > 0 {
            DeliveryOutcome::Conflict
        } else {
            DeliveryOutcome::Duplicate
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_are_named_in_the_body_or_in_a_form_field() {
        let root = Elements::parse("json:/").unwrap();
        assert_eq!(root.pointer, "");
        assert_eq!(root.to_string(), "json:/");
        assert_eq!(root.in_request("/eventId"), "/*/eventId");
        let nested = Elements::parse("json:/data/events").unwrap();
        assert_eq!(nested.in_request("/uuid"), "/data/events/*/uuid");
        let form = Elements::parse("form:mandrill_events").unwrap();
        assert_eq!(form.form_field.as_deref(), Some("mandrill_events"));
        assert_eq!(form.to_string(), "form:mandrill_events");
        for bad in ["json:events", "form:", "header:x", "/events"] {
            assert!(Elements::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_batch_is_a_non_empty_array_of_at_most_the_limit() {
        let at = Elements::parse("json:/events").unwrap();
        let json = serde_json::json!({"events": [1, 2]});
        assert_eq!(elements(&at, &json).unwrap().len(), 2);
        for refused in [
            serde_json::json!({"events": []}),
            serde_json::json!({"events": {"a": 1}}),
            serde_json::json!({"other": [1]}),
        ] {
            assert!(elements(&at, &refused).is_err(), "{refused}");
        }
        let too_many = serde_json::json!({ "events": vec![0; MAX_ELEMENTS + 1] });
        assert!(matches!(
            elements(&at, &too_many),
            Err(ExtractError::TooManyElements { count, .. }) if count == MAX_ELEMENTS + 1
        ));
    }
}
