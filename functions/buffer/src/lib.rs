//! The buffer consumer Lambda: an SQS batch from the event source mapping in, the messages to
//! keep out (`ReportBatchItemFailures`). The work is `shared::buffer::consumer`; this adapter
//! reads the SQS records.

use aws_lambda_events::sqs::{BatchItemFailure, SqsBatchResponse, SqsEvent, SqsMessage};
use lambda_runtime::{Diagnostic, LambdaEvent};
use shared::buffer::BufferedDelivery;
use shared::buffer::filing::Message;
use shared::store::PgPool;

/// Files the batch. A database failure fails the invocation: the event source mapping leaves
/// every message on the queue, to be handed out again.
pub async fn handler(
    event: LambdaEvent<SqsEvent>,
    pool: &PgPool,
) -> Result<SqsBatchResponse, Diagnostic> {
    let messages: Vec<Message> = event.payload.records.into_iter().map(message).collect();
    // Boxed: inline, the filing's future overflows the compiler's layout query depth in
    // `main` in the release build (`sam build` failed on it; the debug build does not).
    let consumed = Box::pin(shared::buffer::consumer::consume(pool, &messages))
        .await
        .map_err(|e| Diagnostic {
            error_type: e.diagnostic_type().into(),
            error_message: e.to_string(),
        })?;
    let mut response = SqsBatchResponse::default();
    response.batch_item_failures = consumed
        .retry
        .into_iter()
        .map(|id| {
            let mut failure = BatchItemFailure::default();
            failure.item_identifier = id;
            failure
        })
        .collect();
    Ok(response)
}

/// One SQS record as the consumer reads it: its id, and the delivery its body and `body`
/// attribute carry (or why they do not).
pub fn message(record: SqsMessage) -> Message {
    let body = record
        .message_attributes
        .get(shared::buffer::BODY_ATTRIBUTE)
        .and_then(|a| a.binary_value.as_ref())
        .map(|b| b.0.clone());
    Message {
        message_id: record.message_id.unwrap_or_default(),
        delivery: BufferedDelivery::decode(record.body.as_deref().unwrap_or(""), body),
    }
}
