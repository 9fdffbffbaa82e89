//! The EventBridge destination: `PutEvents` on the route's bus, `Source` the route's
//! event source, `DetailType` the action, `Detail` the envelope (with the idempotency key and
//! the event id). The answer's entries are in the request's order; `FailedEntryCount` counts
//! those carrying an error code.

use aws_sdk_eventbridge::operation::put_events::PutEventsOutput;
use aws_sdk_eventbridge::types::PutEventsRequestEntry;

use super::{Delivery, Outgoing, call_failed, unanswered};

pub(super) async fn put_events(
    client: &aws_sdk_eventbridge::Client,
    bus: &str,
    event_source: &str,
    call: &[Outgoing<'_>],
) -> Vec<Delivery> {
    let entries = call
        .iter()
        .map(|o| {
            PutEventsRequestEntry::builder()
                .event_bus_name(bus)
                .source(event_source)
                .detail_type(o.detail_type())
                .detail(&o.body)
                .build()
        })
        .collect();
    match client.put_events().set_entries(Some(entries)).send().await {
        Ok(output) => put_events_outcomes(call.len(), &output),
        Err(error) => vec![call_failed("EventBridge PutEvents", error); call.len()],
    }
}

/// EventBridge's error codes worth another try.
fn transient(code: &str) -> bool {
    matches!(
        code,
        "ThrottlingException" | "InternalFailure" | "InternalException" | "ServiceUnavailable"
    )
}

/// One outcome per entry of a `PutEvents` of `len` entries: an entry with an event id and no
/// error code was delivered; one with an error code failed on its own; one missing from the
/// answer (a shorter list than was sent) is not delivered.
pub fn put_events_outcomes(len: usize, output: &PutEventsOutput) -> Vec<Delivery> {
    let answered = output.entries.as_deref().unwrap_or_default();
    (0..len)
        .map(|i| match answered.get(i) {
            Some(entry) => match (entry.error_code.as_deref(), entry.event_id.as_deref()) {
                (Some(code), _) => {
                    let why = super::short(format!(
                        "{code}: {}",
                        entry.error_message.as_deref().unwrap_or("")
                    ));
                    if transient(code) || super::is_transient_code(code) {
                        Delivery::Transient(why)
                    } else {
                        Delivery::Refused(why)
                    }
                }
                (None, Some(_)) => Delivery::Delivered,
                (None, None) => unanswered(),
            },
            None => unanswered(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use aws_sdk_eventbridge::types::PutEventsResultEntry;

    use super::*;

    #[test]
    fn a_failed_entry_of_put_events_is_that_entrys_only_and_throttling_is_retried() {
        let ok = PutEventsResultEntry::builder().event_id("e-1").build();
        let throttled = PutEventsResultEntry::builder()
            .error_code("ThrottlingException")
            .error_message("Rate exceeded")
            .build();
        let malformed = PutEventsResultEntry::builder()
            .error_code("MalformedDetail")
            .error_message("Detail is malformed.")
            .build();
        let output = PutEventsOutput::builder()
            .failed_entry_count(2)
            .entries(ok.clone())
            .entries(throttled)
            .entries(malformed)
            .entries(ok)
            .build();
        let outcomes = put_events_outcomes(5, &output);
        assert_eq!(outcomes[0], Delivery::Delivered);
        assert!(
            matches!(&outcomes[1], Delivery::Transient(w) if w.starts_with("ThrottlingException"))
        );
        assert!(matches!(&outcomes[2], Delivery::Refused(w) if w.starts_with("MalformedDetail")));
        assert_eq!(outcomes[3], Delivery::Delivered);
        assert_eq!(
            outcomes[4],
            unanswered(),
            "fewer answers than entries: not delivered"
        );
    }
}
