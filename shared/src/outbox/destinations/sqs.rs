//! The SQS destination: `SendMessageBatch`, the envelope as the body, `action` and
//! `idempotency_key` as message attributes; on a FIFO queue the entity as `MessageGroupId` and
//! the idempotency key as `MessageDeduplicationId` (a resend within SQS's five-minute window is
//! dropped by SQS, not delivered twice).

use aws_sdk_sqs::operation::send_message_batch::SendMessageBatchOutput;
use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};

use super::{Delivery, Outgoing, by_entry_id, call_failed, entry_failed, group_of};

fn attribute(value: &str) -> Option<MessageAttributeValue> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .ok()
}

pub(super) async fn send_batch(
    client: &aws_sdk_sqs::Client,
    queue_url: &str,
    fifo: bool,
    call: &[Outgoing<'_>],
) -> Vec<Delivery> {
    let mut entries = Vec::with_capacity(call.len());
    for (i, o) in call.iter().enumerate() {
        let m = o.message;
        let mut entry = SendMessageBatchRequestEntry::builder()
            .id(i.to_string())
            .message_body(&o.body)
            .set_message_attributes(Some(
                [
                    ("action", attribute(&m.action)),
                    ("idempotency_key", attribute(&m.idempotency_key)),
                ]
                .into_iter()
                .chain(
                    o.forwarded_attributes()
                        .into_iter()
                        .map(|(k, v)| (k, attribute(v))),
                )
                .filter_map(|(k, v)| Some((k.to_owned(), v?)))
                .collect(),
            ));
        if fifo {
            entry = entry
                .message_group_id(group_of(m))
                .message_deduplication_id(&m.idempotency_key);
        }
        match entry.build() {
            Ok(entry) => entries.push(entry),
            Err(e) => return vec![Delivery::Refused(e.to_string()); call.len()],
        }
    }
    match client
        .send_message_batch()
        .queue_url(queue_url)
        .set_entries(Some(entries))
        .send()
        .await
    {
        Ok(output) => send_batch_outcomes(call.len(), &output),
        Err(error) => vec![call_failed("SQS SendMessageBatch", error); call.len()],
    }
}

/// One outcome per entry of a `SendMessageBatch` of `len` entries (ids "0".."len-1").
pub fn send_batch_outcomes(len: usize, output: &SendMessageBatchOutput) -> Vec<Delivery> {
    by_entry_id(
        len,
        output.successful.iter().map(|s| s.id.clone()),
        output.failed.iter().map(|f| {
            (
                f.id.clone(),
                entry_failed(&f.code, f.message.as_deref().unwrap_or(""), f.sender_fault),
            )
        }),
    )
}

#[cfg(test)]
mod tests {
    use aws_sdk_sqs::types::{BatchResultErrorEntry, SendMessageBatchResultEntry};

    use super::*;

    #[test]
    fn a_failed_entry_of_a_successful_batch_is_that_entrys_only() {
        let ok = |id: &str| {
            SendMessageBatchResultEntry::builder()
                .id(id)
                .message_id("m")
                .md5_of_message_body("x")
                .build()
                .unwrap()
        };
        let failed = |id: &str, code: &str, sender_fault: bool| {
            BatchResultErrorEntry::builder()
                .id(id)
                .code(code)
                .sender_fault(sender_fault)
                .message("why")
                .build()
                .unwrap()
        };
        let output = SendMessageBatchOutput::builder()
            .successful(ok("0"))
            .successful(ok("2"))
            .failed(failed("1", "RequestThrottled", false))
            .failed(failed("3", "InvalidMessageContents", true))
            .build()
            .unwrap();
        let outcomes = send_batch_outcomes(4, &output);
        assert_eq!(outcomes[0], Delivery::Delivered);
        assert!(
            matches!(&outcomes[1], Delivery::Transient(w) if w.starts_with("RequestThrottled"))
        );
        assert_eq!(outcomes[2], Delivery::Delivered);
        assert!(
            matches!(&outcomes[3], Delivery::Refused(w) if w.contains("InvalidMessageContents"))
        );
    }
}
