//! The buffer's consumer: a batch of SQS messages in, the ones to leave on the queue out. The
//! Lambda on the queue's event source mapping and the local runner's poller both call
//! [`consume`]; what to keep is decided here once.

use sqlx::PgPool;

use super::filing::{self, Filed, Message};
use crate::store::StoreError;

/// What one batch came to.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Consumed {
    /// Filed now: accepted, duplicate or conflict, as the direct path would have answered.
    pub stored: u64,
    /// Filed before (SQS delivered the message again, or the SDK retried a send).
    pub already_filed: u64,
    /// Could never be filed (source disabled, body the field map cannot read): recorded as an
    /// ingest anomaly and deleted.
    pub unfilable: u64,
    /// Left on the queue: SQS hands them out again, and after the redrive policy's receive
    /// count moves them to the dead-letter queue, which alarms.
    pub retry: Vec<String>,
}

impl Consumed {
    /// How many messages the batch held.
    pub fn received(&self) -> u64 {
        self.stored + self.already_filed + self.unfilable + self.retry.len() as u64
    }
}

/// Files a batch. A database failure is an error: nothing of the batch was committed, and
/// every message stays on the queue.
pub async fn consume(pool: &PgPool, messages: &[Message]) -> Result<Consumed, StoreError> {
    let filed = filing::file_batch(pool, messages).await?;
    let mut consumed = Consumed::default();
    for (message, filed) in messages.iter().zip(filed) {
        match filed {
            Filed::Stored(_) | Filed::StoredBatch(_) => consumed.stored += 1,
            Filed::AlreadyFiled => consumed.already_filed += 1,
            Filed::Unfilable { kind, detail } => {
                tracing::warn!(message_id = %message.message_id, kind, %detail, "buffered delivery cannot be filed: recorded as an anomaly");
                consumed.unfilable += 1;
            }
            Filed::Retry { reason } => {
                tracing::warn!(message_id = %message.message_id, %reason, "buffered delivery left on the queue");
                consumed.retry.push(message.message_id.clone());
            }
        }
    }
    tracing::info!(
        stored = consumed.stored,
        already_filed = consumed.already_filed,
        unfilable = consumed.unfilable,
        retry = consumed.retry.len(),
        "buffered batch filed"
    );
    Ok(consumed)
}
