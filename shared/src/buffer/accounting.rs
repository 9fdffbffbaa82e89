//! The buffer's accounting: how many deliveries wait in SQS, and what its dead-letter queue
//! holds, shown and re-driven by the operator (`hookctl status`, `hookctl buffer list|redrive`).
//!
//! A delivery waiting in the buffer queue, or in flight to the consumer, is accounted for: it
//! will be filed. One in the dead-letter queue is NOT: the consumer failed on it
//! `maxReceiveCount` times, and it stays there (14 days at most) until an operator re-drives it
//! or it expires. Nothing here prints a body or a header's value.
//!
//! The age of the oldest buffered message is not an SQS queue attribute: it is CloudWatch's
//! `ApproximateAgeOfOldestMessage` (AWS/SQS), the metric the stack's
//! `BufferOldestMessageAgeAlarm` watches.

use std::collections::{HashMap, HashSet};

use aws_sdk_sqs::types::{ChangeMessageVisibilityBatchRequestEntry, QueueAttributeName};
use serde::Serialize;

use super::DecodeError;
use super::queue::{BufferQueue, QueueError, Received, sqs_error};

/// How long a message received to be listed or re-driven stays hidden from other receivers:
/// long enough for one command to go through up to its limit; listed ones are made visible
/// again at once when the listing is done.
const HIDE_WHILE_WORKING_SECONDS: i32 = 60;

/// How long a receive waits for messages (long polling asks every SQS server, so an empty
/// answer means the queue is empty, which short polling does not).
const RECEIVE_WAIT_SECONDS: i32 = 1;

/// The buffer's queues, counted (SQS's approximate counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BufferDepth {
    /// Buffered deliveries waiting for the consumer (`ApproximateNumberOfMessages`).
    pub waiting: u64,
    /// Received by the consumer and neither filed nor returned yet
    /// (`ApproximateNumberOfMessagesNotVisible`).
    pub in_flight: u64,
    /// Sent with a delay and not yet visible (`ApproximateNumberOfMessagesDelayed`).
    pub delayed: u64,
    /// In the dead-letter queue, visible or not: NOT accounted for until re-driven.
    pub dead_letters: u64,
}

impl BufferDepth {
    /// Deliveries in the buffer that will be filed without an operator.
    pub fn buffered(&self) -> u64 {
        self.waiting + self.in_flight + self.delayed
    }

    /// Nothing in either queue.
    pub fn is_empty(&self) -> bool {
        self.buffered() == 0 && self.dead_letters == 0
    }
}

/// What `status` reads of the buffer: its counts, and its oldest delivery's age from CloudWatch
/// (each may fail on its own: the counts stand without the age).
#[derive(Debug)]
pub struct BufferReading {
    pub depth: Result<BufferDepth, QueueError>,
    pub oldest: Result<Option<super::OldestAge>, QueueError>,
}

/// The longest a delivery waits in the buffer behind a consumer that keeps up: SQS's polling and
/// the batching window are seconds.
pub const KEEPING_UP_SECONDS: f64 = 60.0;

/// How recent CloudWatch's datapoint must be to say the consumer keeps up now.
const RECENT_SECONDS: i64 = 15 * 60;

impl BufferReading {
    /// Whether the buffer may hold deliveries older than a consumer that keeps up leaves them
    /// (so an event missing from PostgreSQL may be waiting there): it holds some and CloudWatch
    /// does not show its oldest younger than [`KEEPING_UP_SECONDS`] in a recent datapoint, or it
    /// cannot be counted. In `queue` mode the buffer is never empty; this is what tells a
    /// consumer that keeps up from one that does not.
    pub fn holds_late_deliveries(&self, now: chrono::DateTime<chrono::Utc>) -> bool {
        match &self.depth {
            Err(_) => true,
            Ok(d) if d.buffered() == 0 => false,
            Ok(_) => !matches!(&self.oldest, Ok(Some(age))
                if age.seconds <= KEEPING_UP_SECONDS
                    && (now - age.measured_at).num_seconds() <= RECENT_SECONDS),
        }
    }
}

#[cfg(test)]
impl BufferReading {
    /// A countable buffer with `waiting` deliveries waiting, for the rules' unit tests.
    pub(crate) fn waiting(
        waiting: u64,
        oldest: Result<Option<super::OldestAge>, QueueError>,
    ) -> Self {
        Self {
            depth: Ok(BufferDepth {
                waiting,
                in_flight: 0,
                delayed: 0,
                dead_letters: 0,
            }),
            oldest,
        }
    }
}

/// One message of the dead-letter queue, described without its body or headers' values.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct DeadLetter {
    pub message_id: String,
    /// `None` for a message that is not a buffered delivery (see `unreadable`).
    pub source_id: Option<String>,
    pub delivery_id: Option<String>,
    /// When ingest received the delivery, Unix microseconds.
    pub received_at_micros: Option<i64>,
    /// Size of the raw delivery body, bytes.
    pub body_bytes: Option<usize>,
    /// How many times SQS has handed it out (the consumer's tries, then listings).
    pub receive_count: u32,
    /// When it was sent to the buffer queue, Unix milliseconds.
    pub sent_at_millis: Option<i64>,
    /// Why the message is not a buffered delivery (no content quoted); `None` when it is one.
    pub unreadable: Option<String>,
}

/// What a redrive did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Redriven {
    /// Sent back to the buffer queue (acknowledged by SQS), then deleted from the dead-letter
    /// queue.
    pub moved: u64,
    /// Not buffered deliveries: left in the dead-letter queue.
    pub skipped: u64,
}

/// Why a message is not a buffered delivery, in words that quote none of it.
fn unreadable(error: &DecodeError) -> &'static str {
    match error {
        DecodeError::Envelope(_) => "the message body is not a buffered delivery's envelope",
        DecodeError::Version(_) => "an envelope version this build does not read",
        DecodeError::NoBody => "no body attribute",
    }
}

impl DeadLetter {
    fn of(message: &Received) -> Self {
        let delivery = message.delivery.as_ref().ok();
        Self {
            message_id: message.message_id.clone(),
            source_id: delivery.map(|d| d.envelope.source_id.clone()),
            delivery_id: delivery.map(|d| d.envelope.delivery_id.clone()),
            received_at_micros: delivery.map(|d| d.envelope.received_at_micros),
            body_bytes: delivery.map(|d| d.body.len()),
            receive_count: message.receive_count,
            sent_at_millis: message.sent_at_millis,
            unreadable: message
                .delivery
                .as_ref()
                .err()
                .map(|e| unreadable(e).to_owned()),
        }
    }
}

impl BufferQueue {
    /// The counts and the oldest delivery's age, read at once.
    pub async fn read(&self) -> BufferReading {
        let (depth, oldest) = tokio::join!(self.depth(), self.oldest_age());
        BufferReading { depth, oldest }
    }

    /// Both queues' counts (GetQueueAttributes on each).
    pub async fn depth(&self) -> Result<BufferDepth, QueueError> {
        let dead_letter_queue_url = self.dead_letter_queue_url()?.to_owned();
        let buffer = self
            .counts(
                self.queue_url(),
                &[
                    QueueAttributeName::ApproximateNumberOfMessages,
                    QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
                    QueueAttributeName::ApproximateNumberOfMessagesDelayed,
                ],
            )
            .await?;
        let dead = self
            .counts(
                &dead_letter_queue_url,
                &[
                    QueueAttributeName::ApproximateNumberOfMessages,
                    QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
                ],
            )
            .await?;
        let count = |counts: &HashMap<QueueAttributeName, u64>, name| {
            counts.get(&name).copied().unwrap_or(0)
        };
        Ok(BufferDepth {
            waiting: count(&buffer, QueueAttributeName::ApproximateNumberOfMessages),
            in_flight: count(
                &buffer,
                QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
            ),
            delayed: count(
                &buffer,
                QueueAttributeName::ApproximateNumberOfMessagesDelayed,
            ),
            dead_letters: count(&dead, QueueAttributeName::ApproximateNumberOfMessages)
                + count(
                    &dead,
                    QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
                ),
        })
    }

    async fn counts(
        &self,
        queue_url: &str,
        names: &[QueueAttributeName],
    ) -> Result<HashMap<QueueAttributeName, u64>, QueueError> {
        let output = self
            .client()
            .get_queue_attributes()
            .queue_url(queue_url)
            .set_attribute_names(Some(names.to_vec()))
            .send()
            .await
            .map_err(sqs_error("GetQueueAttributes"))?;
        Ok(output
            .attributes
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(name, value)| Some((name, value.parse().ok()?)))
            .collect())
    }

    /// Up to `limit` messages of the dead-letter queue, described; they stay in it (made
    /// visible again at once). Each listing counts as one more receive of each message.
    pub async fn list_dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
        let dead_letter_queue_url = self.dead_letter_queue_url()?.to_owned();
        let mut listed = Vec::new();
        let mut handles = Vec::new();
        let mut seen = HashSet::new();
        let result = async {
            while listed.len() < limit {
                let want = (limit - listed.len()).min(10) as i32;
                let batch = self
                    .receive_from(
                        &dead_letter_queue_url,
                        want,
                        HIDE_WHILE_WORKING_SECONDS,
                        RECEIVE_WAIT_SECONDS,
                    )
                    .await?;
                if batch.is_empty() {
                    break;
                }
                let mut new = false;
                for message in batch {
                    handles.push(message.receipt_handle.clone());
                    if seen.insert(message.message_id.clone()) && listed.len() < limit {
                        listed.push(DeadLetter::of(&message));
                        new = true;
                    }
                }
                if !new {
                    // Only messages listed already (their hiding outlived): all seen.
                    break;
                }
            }
            Ok::<_, QueueError>(())
        }
        .await;
        // Visible again whatever happened: listing never keeps a message from a redrive.
        let shown = self.show_again(&dead_letter_queue_url, &handles).await;
        result?;
        shown?;
        Ok(listed)
    }

    /// Moves up to `limit` buffered deliveries from the dead-letter queue back to the buffer
    /// queue: each is sent (the same delivery, its received time kept) and deleted from the
    /// dead-letter queue only once SQS acknowledged the send. A message that is not a buffered
    /// delivery is left in the dead-letter queue and counted as skipped. Should a delete fail
    /// after its send, the delivery is in both queues: the consumer files a delivery id once.
    pub async fn redrive(&self, limit: usize) -> Result<Redriven, QueueError> {
        let dead_letter_queue_url = self.dead_letter_queue_url()?.to_owned();
        let mut done = Redriven::default();
        let mut left = Vec::new();
        let mut seen = HashSet::new();
        let result = async {
            while ((done.moved + done.skipped) as usize) < limit {
                let room = limit - (done.moved + done.skipped) as usize;
                let batch = self
                    .receive_from(
                        &dead_letter_queue_url,
                        room.min(10) as i32,
                        HIDE_WHILE_WORKING_SECONDS,
                        RECEIVE_WAIT_SECONDS,
                    )
                    .await?;
                if batch.is_empty() {
                    break;
                }
                let mut new = false;
                for message in batch {
                    let first_time = seen.insert(message.message_id.clone());
                    new |= first_time;
                    match message.delivery {
                        Ok(delivery) if first_time => {
                            self.send_to(self.queue_url(), delivery).await?;
                            self.delete_from(&dead_letter_queue_url, &message.receipt_handle)
                                .await?;
                            done.moved += 1;
                        }
                        // Received again within one run (its hiding outlived): already sent.
                        Ok(_) => {
                            self.delete_from(&dead_letter_queue_url, &message.receipt_handle)
                                .await?;
                        }
                        Err(_) => {
                            if first_time {
                                done.skipped += 1;
                            }
                            left.push(message.receipt_handle.clone());
                        }
                    }
                }
                if !new {
                    break;
                }
            }
            Ok::<_, QueueError>(())
        }
        .await;
        let shown = self.show_again(&dead_letter_queue_url, &left).await;
        result?;
        shown?;
        Ok(done)
    }

    /// Makes received messages visible again at once (ChangeMessageVisibility 0, ten a call).
    async fn show_again(&self, queue_url: &str, handles: &[String]) -> Result<(), QueueError> {
        for chunk in handles.chunks(10) {
            let entries = chunk
                .iter()
                .enumerate()
                .map(|(i, handle)| {
                    ChangeMessageVisibilityBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(handle)
                        .visibility_timeout(0)
                        .build()
                        .map_err(|e| QueueError::Sqs {
                            operation: "ChangeMessageVisibilityBatch",
                            reason: e.to_string(),
                        })
                })
                .collect::<Result<Vec<_>, _>>()?;
            self.client()
                .change_message_visibility_batch()
                .queue_url(queue_url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(sqs_error("ChangeMessageVisibilityBatch"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::OldestAge;

    #[test]
    fn an_unreadable_reason_quotes_nothing_of_the_message() {
        let error =
            serde_json::from_str::<super::super::Envelope>(r#"{"v":"hunter2"}"#).unwrap_err();
        assert!(
            error.to_string().contains("hunter2"),
            "serde_json quotes it"
        );
        let reason = unreadable(&DecodeError::Envelope(error));
        assert!(!reason.contains("hunter2"));
    }

    #[test]
    fn buffered_counts_what_the_consumer_will_file() {
        let depth = BufferDepth {
            waiting: 3,
            in_flight: 2,
            delayed: 1,
            dead_letters: 7,
        };
        assert_eq!(depth.buffered(), 6);
    }

    #[test]
    fn late_deliveries_are_held_for_unless_a_recent_datapoint_shows_the_consumer_keeping_up() {
        let reading = BufferReading::waiting;
        let now = chrono::Utc::now();
        let age = |seconds: f64, minutes_ago: i64| {
            Ok(Some(OldestAge {
                seconds,
                measured_at: now - chrono::TimeDelta::minutes(minutes_ago),
            }))
        };
        assert!(
            !reading(0, age(900.0, 1)).holds_late_deliveries(now),
            "empty"
        );
        assert!(
            !reading(50, age(3.0, 2)).holds_late_deliveries(now),
            "queue mode keeping up"
        );
        assert!(
            reading(50, age(600.0, 2)).holds_late_deliveries(now),
            "lagging"
        );
        assert!(
            reading(50, age(3.0, 40)).holds_late_deliveries(now),
            "a datapoint too old to say"
        );
        assert!(
            reading(1, Ok(None)).holds_late_deliveries(now),
            "no datapoint"
        );
        let unreadable = Err(QueueError::CloudWatch {
            operation: "GetMetricData",
            reason: "timeout".into(),
        });
        assert!(reading(1, unreadable).holds_late_deliveries(now));
        let blind = BufferReading {
            depth: Err(QueueError::NoDeadLetterQueue),
            oldest: Ok(None),
        };
        assert!(blind.holds_late_deliveries(now), "not countable");
    }
}
