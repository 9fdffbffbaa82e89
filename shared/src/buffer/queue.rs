//! The buffer's SQS queue: ingest sends to it; the local runner's consumer receives and
//! deletes (in AWS, the event source mapping does). One client per process.

use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::{MessageAttributeValue, MessageSystemAttributeName};

use super::{BODY_ATTRIBUTE, BufferedDelivery, DecodeError};
use crate::aws::AwsEndpoint;

/// How long one attempt at an SQS call may take, and all of its retries together. Ingest
/// spills after `SPILLOVER_AFTER_MS` (2 s): the send must answer well inside the function's
/// 10 s, so an SQS endpoint that does not answer (no NAT, no VPC endpoint) costs a 503 in
/// 2 + 4 s, not a Lambda timeout.
const ATTEMPT_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(1500);
const OPERATION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(4);

/// Where the buffer is.
#[derive(Debug, Clone)]
pub struct QueueSettings {
    /// `BUFFER_QUEUE_URL`.
    pub queue_url: String,
    /// `BUFFER_DEAD_LETTER_QUEUE_URL`: read by the operator's commands only.
    pub dead_letter_queue_url: Option<String>,
    /// `SQS_ENDPOINT` overrides AWS's (moto in tests, a VPC endpoint in production).
    pub endpoint: AwsEndpoint,
    /// `CLOUDWATCH_ENDPOINT` overrides AWS's for the oldest message's age (read by `status`
    /// only); never the SQS override.
    pub metrics_endpoint_url: Option<String>,
}

/// Why SQS did not take or give a message.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("SQS {operation} failed: {reason}")]
    Sqs {
        operation: &'static str,
        reason: String,
    },
    #[error("a buffered delivery of {size} bytes exceeds one SQS message")]
    TooLarge { size: usize },
    #[error("CloudWatch {operation} failed: {reason}")]
    CloudWatch {
        operation: &'static str,
        reason: String,
    },
    #[error("no dead-letter queue is configured (BUFFER_DEAD_LETTER_QUEUE_URL)")]
    NoDeadLetterQueue,
}

/// A message received from a queue.
#[derive(Debug)]
pub struct Received {
    pub message_id: String,
    pub receipt_handle: String,
    /// How many times SQS has handed it out, this time included.
    pub receive_count: u32,
    /// When ingest sent it, as Unix milliseconds.
    pub sent_at_millis: Option<i64>,
    /// The SQS message body, as received (the envelope's JSON).
    pub message_body: String,
    /// The delivery, or why the message is not one.
    pub delivery: Result<BufferedDelivery, DecodeError>,
}

/// The buffer's queues.
#[derive(Debug, Clone)]
pub struct BufferQueue {
    client: aws_sdk_sqs::Client,
    queue_url: String,
    dead_letter_queue_url: Option<String>,
    /// Kept for the CloudWatch client the age reader builds (see `age`).
    sdk_config: std::sync::Arc<aws_config::SdkConfig>,
    metrics_endpoint_url: Option<String>,
}

/// The SDK timeouts every buffer call has (see `ATTEMPT_TIMEOUT`).
pub(super) fn timeouts() -> aws_sdk_sqs::config::timeout::TimeoutConfig {
    aws_sdk_sqs::config::timeout::TimeoutConfig::builder()
        .operation_attempt_timeout(ATTEMPT_TIMEOUT)
        .operation_timeout(OPERATION_TIMEOUT)
        .build()
}

pub(super) fn sqs_error<E: std::error::Error + 'static>(
    operation: &'static str,
) -> impl FnOnce(aws_sdk_sqs::error::SdkError<E>) -> QueueError {
    move |error| QueueError::Sqs {
        operation,
        reason: DisplayErrorContext(error).to_string(),
    }
}

impl BufferQueue {
    pub async fn connect(settings: &QueueSettings) -> Self {
        let sdk_config = crate::aws::sdk_config(&settings.endpoint).await;
        let config = aws_sdk_sqs::config::Builder::from(&sdk_config)
            .timeout_config(timeouts())
            .build();
        Self {
            client: aws_sdk_sqs::Client::from_conf(config),
            queue_url: settings.queue_url.clone(),
            dead_letter_queue_url: settings.dead_letter_queue_url.clone(),
            sdk_config: std::sync::Arc::new(sdk_config),
            metrics_endpoint_url: settings.metrics_endpoint_url.clone(),
        }
    }

    pub fn queue_url(&self) -> &str {
        &self.queue_url
    }

    pub fn dead_letter_queue_url(&self) -> Result<&str, QueueError> {
        self.dead_letter_queue_url
            .as_deref()
            .ok_or(QueueError::NoDeadLetterQueue)
    }

    pub(super) fn sdk_config(&self) -> &aws_config::SdkConfig {
        &self.sdk_config
    }

    pub(super) fn metrics_endpoint_url(&self) -> Option<&str> {
        self.metrics_endpoint_url.as_deref()
    }

    pub fn client(&self) -> &aws_sdk_sqs::Client {
        &self.client
    }

    /// Sends one delivery; returns SQS's message id once SQS acknowledged it (stored durably
    /// across its availability zones).
    pub async fn send(&self, delivery: BufferedDelivery) -> Result<String, QueueError> {
        self.send_to(&self.queue_url, delivery).await
    }

    /// Sends one delivery to the queue at `queue_url` (the buffer, or a redrive's destination).
    /// Takes the delivery: its body moves into the request, never copied again.
    pub async fn send_to(
        &self,
        queue_url: &str,
        delivery: BufferedDelivery,
    ) -> Result<String, QueueError> {
        let message_body = delivery
            .message_body()
            .map_err(|size| QueueError::TooLarge { size })?;
        let body = MessageAttributeValue::builder()
            .data_type("Binary")
            .binary_value(Blob::new(delivery.body))
            .build()
            .map_err(|e| QueueError::Sqs {
                operation: "SendMessage",
                reason: e.to_string(),
            })?;
        let sent = self
            .client
            .send_message()
            .queue_url(queue_url)
            .message_body(message_body)
            .message_attributes(BODY_ATTRIBUTE, body)
            .send()
            .await
            .map_err(sqs_error("SendMessage"))?;
        Ok(sent.message_id.unwrap_or_default())
    }

    /// Up to `max` (at most 10) messages of the queue at `queue_url`, hidden from other
    /// receivers for `visibility_seconds`; waits up to `wait_seconds` for the first.
    pub async fn receive_from(
        &self,
        queue_url: &str,
        max: i32,
        visibility_seconds: i32,
        wait_seconds: i32,
    ) -> Result<Vec<Received>, QueueError> {
        let output = self
            .client
            .receive_message()
            .queue_url(queue_url)
            .max_number_of_messages(max.clamp(1, 10))
            .visibility_timeout(visibility_seconds)
            .wait_time_seconds(wait_seconds)
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .send()
            .await
            .map_err(sqs_error("ReceiveMessage"))?;
        Ok(output
            .messages
            .unwrap_or_default()
            .into_iter()
            .map(|m| {
                let attributes = m.attributes.unwrap_or_default();
                let system = |name: MessageSystemAttributeName| {
                    attributes.get(&name).and_then(|v| v.parse::<i64>().ok())
                };
                let body = m
                    .message_attributes
                    .as_ref()
                    .and_then(|a| a.get(BODY_ATTRIBUTE))
                    .and_then(|v| v.binary_value.as_ref())
                    .map(|b| b.as_ref().to_vec());
                let message_body = m.body.unwrap_or_default();
                let delivery = BufferedDelivery::decode(&message_body, body);
                Received {
                    message_id: m.message_id.unwrap_or_default(),
                    receipt_handle: m.receipt_handle.unwrap_or_default(),
                    receive_count: system(MessageSystemAttributeName::ApproximateReceiveCount)
                        .and_then(|n| u32::try_from(n).ok())
                        .unwrap_or(1),
                    sent_at_millis: system(MessageSystemAttributeName::SentTimestamp),
                    message_body,
                    delivery,
                }
            })
            .collect())
    }

    /// Deletes a received message from the queue at `queue_url`.
    pub async fn delete_from(
        &self,
        queue_url: &str,
        receipt_handle: &str,
    ) -> Result<(), QueueError> {
        self.client
            .delete_message()
            .queue_url(queue_url)
            .receipt_handle(receipt_handle)
            .send()
            .await
            .map_err(sqs_error("DeleteMessage"))?;
        Ok(())
    }
}
