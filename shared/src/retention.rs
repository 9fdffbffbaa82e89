//! Retention: payload bytes are purged first, event identity (the dedup key) only after a
//! horizon longer than the longest provider retry window, in bounded batches each its own
//! statement. A payload the drain still needed when the purge's cursor passed it (a pending
//! event) is purged by a later pass once the event is processed. An event stays while an open
//! dead letter or an outbox message not yet delivered (pending, or failed and waiting for an
//! operator) needs it; a closed (replayed or discarded) dead letter goes with its event once it
//! has been closed for the identity horizon too. Tombstones, entities and orders are kept; an
//! open dead letter keeps its copy of the payload (its replay reads it once the event's is
//! purged), a closed one loses it after the payload horizon. A delivery arriving after
//! its identity was purged is accepted as new, but its effect is not repeated (the version guard
//! and the payment state machine see it applied) and it is recorded as an anomaly.
//!
//! The digests of signed bodies whose event id is outside the signature (`signed_bodies`, what
//! refuses a GitHub or Shopify body replayed under a fresh id) outlive identity: a signed body
//! stays replayable forever, so they are kept for the replay horizon, a year and more by
//! default, and only then purged. A row is the digest, the source and the first event's id,
//! about 150 bytes with its key: a million such deliveries a day kept 400 days is about 60 GB,
//! ten thousand a day is 600 MB. Shorten `RETENTION_REPLAY_SECONDS` if that is not cheap.

use std::time::Duration;

use serde::Serialize;
use sqlx::PgPool;

use crate::maintenance::{self, RunCounts};
use crate::store::{StoreError, buffer_receipts, retention};

/// Stripe retries for up to three days, Shopify two, Standard Webhooks senders about a day:
/// identity must outlive the longest of them with a margin.
pub const MIN_IDENTITY_HORIZON: Duration = Duration::from_secs(4 * 24 * 3600);

#[derive(Debug, Clone)]
pub struct RetentionSettings {
    pub payload_after: Duration,
    pub identity_after: Duration,
    /// Anomaly records and run rows.
    pub history_after: Duration,
    /// Digests of signed bodies with unsigned ids (`signed_bodies`), counted from first sight:
    /// a body re-posted under a fresh id within this is refused as a replay.
    pub replay_after: Duration,
    pub batch_size: i64,
    pub max_batches: u32,
}

impl Default for RetentionSettings {
    fn default() -> Self {
        Self {
            payload_after: Duration::from_secs(7 * 24 * 3600),
            identity_after: Duration::from_secs(30 * 24 * 3600),
            history_after: Duration::from_secs(90 * 24 * 3600),
            replay_after: Duration::from_secs(400 * 24 * 3600),
            batch_size: 5000,
            max_batches: 20,
        }
    }
}

impl RetentionSettings {
    pub fn validate(&self) -> Result<(), String> {
        if self.identity_after < MIN_IDENTITY_HORIZON {
            return Err(format!(
                "identity horizon {} s is shorter than the longest provider retry window plus margin ({} s)",
                self.identity_after.as_secs(),
                MIN_IDENTITY_HORIZON.as_secs()
            ));
        }
        if self.payload_after > self.identity_after {
            return Err(
                "payloads cannot outlive identity: payload age exceeds the identity horizon".into(),
            );
        }
        if self.replay_after < self.identity_after {
            return Err(
                "replay protection cannot end before identity: the replay horizon is shorter than the identity horizon"
                    .into(),
            );
        }
        if self.batch_size < 1 || self.max_batches < 1 {
            return Err("batch size and batch count must be positive".into());
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RetentionOutcome {
    pub payloads_purged: u64,
    pub identities_purged: u64,
    pub history_purged: u64,
    /// Signed-body digests past the replay horizon.
    #[serde(default)]
    pub signed_bodies_purged: u64,
    /// Payload copies of dead letters closed (replayed or discarded) past the payload horizon.
    pub dead_letter_payloads_purged: u64,
    /// Closed dead letters deleted with their events at the identity horizon.
    pub closed_dead_letters_purged: u64,
    /// Receipts of buffered deliveries filed more than 15 days ago (longer than SQS keeps a
    /// message), past which no copy of them can arrive.
    #[serde(default)]
    pub buffer_receipts_purged: u64,
}

impl RunCounts for RetentionOutcome {
    fn found(&self) -> serde_json::Value {
        serde_json::json!({})
    }
    fn repaired(&self) -> serde_json::Value {
        maintenance::json(self)
    }
}

#[tracing::instrument(skip(pool, settings), err)]
pub async fn run_once(
    pool: &PgPool,
    settings: &RetentionSettings,
    trigger: &str,
) -> Result<RetentionOutcome, StoreError> {
    let (_, outcome) = maintenance::recorded(pool, "retention", trigger, |_| async {
        let mut outcome = RetentionOutcome::default();
        let result = purge(pool, settings, &mut outcome).await;
        (outcome, result)
    })
    .await?;
    let o = &outcome;
    if o.payloads_purged
        + o.identities_purged
        + o.history_purged
        + o.dead_letter_payloads_purged
        + o.closed_dead_letters_purged
        + o.signed_bodies_purged
        + o.buffer_receipts_purged
        > 0
    {
        tracing::info!(
            payloads_purged = o.payloads_purged,
            identities_purged = o.identities_purged,
            history_purged = o.history_purged,
            dead_letter_payloads_purged = o.dead_letter_payloads_purged,
            closed_dead_letters_purged = o.closed_dead_letters_purged,
            signed_bodies_purged = o.signed_bodies_purged,
            buffer_receipts_purged = o.buffer_receipts_purged,
            "retention pass finished"
        );
    } else {
        tracing::debug!("retention pass: nothing past its horizon");
    }
    Ok(outcome)
}

async fn purge(
    pool: &PgPool,
    s: &RetentionSettings,
    outcome: &mut RetentionOutcome,
) -> Result<(), StoreError> {
    // Events the cursor below passed while they were pending, and processed since.
    for _ in 0..s.max_batches {
        let pass = retention::purge_processed_since_passed(pool, s.batch_size).await?;
        outcome.payloads_purged += pass.purged;
        if pass.examined < s.batch_size as u64 {
            break;
        }
    }
    for _ in 0..s.max_batches {
        let n =
            retention::purge_payloads(pool, s.payload_after.as_secs_f64(), s.batch_size).await?;
        outcome.payloads_purged += n;
        if n == 0 {
            break;
        }
    }
    for _ in 0..s.max_batches {
        let n = retention::purge_closed_dead_letter_payloads(
            pool,
            s.payload_after.as_secs_f64(),
            s.batch_size,
        )
        .await?;
        outcome.dead_letter_payloads_purged += n;
        if n < s.batch_size as u64 {
            break;
        }
    }
    for _ in 0..s.max_batches {
        let n =
            retention::purge_identities(pool, s.identity_after.as_secs_f64(), s.batch_size).await?;
        outcome.identities_purged += n.events;
        outcome.closed_dead_letters_purged += n.closed_dead_letters;
        if n.events < s.batch_size as u64 {
            break;
        }
    }
    for _ in 0..s.max_batches {
        let n = retention::purge_history(pool, s.history_after.as_secs_f64(), s.batch_size).await?;
        outcome.history_purged += n;
        if n < s.batch_size as u64 {
            break;
        }
    }
    for _ in 0..s.max_batches {
        let n = retention::purge_signed_bodies(pool, s.replay_after.as_secs_f64(), s.batch_size)
            .await?;
        outcome.signed_bodies_purged += n;
        if n < s.batch_size as u64 {
            break;
        }
    }
    for _ in 0..s.max_batches {
        let n =
            buffer_receipts::prune_older_than(pool, buffer_receipts::RECEIPT_HORIZON, s.batch_size)
                .await?;
        outcome.buffer_receipts_purged += n;
        if n < s.batch_size as u64 {
            break;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_must_outlive_provider_retries() {
        assert!(RetentionSettings::default().validate().is_ok());
        let short = RetentionSettings {
            identity_after: Duration::from_secs(3600),
            payload_after: Duration::from_secs(60),
            ..Default::default()
        };
        assert!(short.validate().unwrap_err().contains("retry window"));
        let inverted = RetentionSettings {
            payload_after: Duration::from_secs(40 * 24 * 3600),
            ..Default::default()
        };
        assert!(inverted.validate().is_err());
        let forgetful = RetentionSettings {
            replay_after: Duration::from_secs(10 * 24 * 3600),
            ..Default::default()
        };
        assert!(forgetful.validate().unwrap_err().contains("replay horizon"));
    }
}
