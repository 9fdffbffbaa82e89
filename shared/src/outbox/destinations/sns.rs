//! The SNS destination: `PublishBatch`, the envelope as the message, `action` and `tenant_id`
//! as message attributes (subscription filter policies can select on them); on a FIFO topic the
//! entity as `MessageGroupId` and the idempotency key as `MessageDeduplicationId`.

use aws_sdk_sns::operation::publish_batch::PublishBatchOutput;
use aws_sdk_sns::types::{MessageAttributeValue, PublishBatchRequestEntry};

use super::{Delivery, Outgoing, by_entry_id, call_failed, entry_failed, group_of};

fn attribute(value: &str) -> Option<MessageAttributeValue> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .ok()
}

pub(super) async fn publish_batch(
    client: &aws_sdk_sns::Client,
    topic_arn: &str,
    fifo: bool,
    call: &[Outgoing<'_>],
) -> Vec<Delivery> {
    let mut entries = Vec::with_capacity(call.len());
    for (i, o) in call.iter().enumerate() {
        let m = o.message;
        let mut entry = PublishBatchRequestEntry::builder()
            .id(i.to_string())
            .message(&o.body)
            .set_message_attributes(Some(
                [
                    ("action", attribute(&m.action)),
                    ("tenant_id", attribute(&m.tenant_id)),
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
        .publish_batch()
        .topic_arn(topic_arn)
        .set_publish_batch_request_entries(Some(entries))
        .send()
        .await
    {
        Ok(output) => publish_batch_outcomes(call.len(), &output),
        Err(error) => vec![call_failed("SNS PublishBatch", error); call.len()],
    }
}

/// One outcome per entry of a `PublishBatch` of `len` entries (ids "0".."len-1").
pub fn publish_batch_outcomes(len: usize, output: &PublishBatchOutput) -> Vec<Delivery> {
    by_entry_id(
        len,
        output
            .successful
            .iter()
            .flatten()
            .filter_map(|s| s.id.clone()),
        output.failed.iter().flatten().map(|f| {
            (
                f.id.clone(),
                entry_failed(&f.code, f.message.as_deref().unwrap_or(""), f.sender_fault),
            )
        }),
    )
}
