//! Retention: payload bytes are purged first, event identity (the dedup key) only after a
//! horizon longer than the longest provider retry window, in bounded batches each its own
//! statement. A run takes batch after batch, each purge in turn, until nothing is past its
//! horizon or its time is up (a scheduled run: its invocation's deadline less a margin), so
//! what it purges follows the rate events arrive at: a cap on batches per run (once 20 of
//! 5000, 2.4 M events a day at the hourly schedule) let a steady 100 events/s (8.64 M a day)
//! outgrow it for good. A payload the drain still needed when the purge's cursor passed it (a pending
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
//!
//! The drain's latency records (`processing_completions`, a row per batch) are forgotten after
//! the two hours the anomaly pass reads, which forgets them too: a stopped anomaly function
//! does not make the table grow.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::PgPool;

use crate::maintenance::{self, RunCounts};
use crate::store::{
    StoreError, batch_requests, buffer_receipts, processing_completions, retention,
};

/// Stripe retries for up to three days, Shopify two, Standard Webhooks senders about a day:
/// identity must outlive the longest of them with a margin.
pub const MIN_IDENTITY_HORIZON: Duration = Duration::from_secs(4 * 24 * 3600);

/// The most rows one purge statement may take, so that none holds its row locks for long.
pub const MAX_BATCH_SIZE: i64 = 50_000;

#[derive(Debug, Clone)]
pub struct RetentionSettings {
    pub payload_after: Duration,
    pub identity_after: Duration,
    /// Anomaly records and run rows.
    pub history_after: Duration,
    /// Digests of signed bodies with unsigned ids (`signed_bodies`), counted from first sight:
    /// a body re-posted under a fresh id within this is refused as a replay.
    pub replay_after: Duration,
    /// Rows a purge statement takes at most: its locks last one batch.
    pub batch_size: i64,
}

impl Default for RetentionSettings {
    fn default() -> Self {
        Self {
            payload_after: Duration::from_secs(7 * 24 * 3600),
            identity_after: Duration::from_secs(30 * 24 * 3600),
            history_after: Duration::from_secs(90 * 24 * 3600),
            replay_after: Duration::from_secs(400 * 24 * 3600),
            batch_size: 5000,
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
        if !(1..=MAX_BATCH_SIZE).contains(&self.batch_size) {
            return Err(format!(
                "batch size {} is outside 1..={MAX_BATCH_SIZE}",
                self.batch_size
            ));
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
    /// The drain's latency records (`processing_completions`) past the two hours the anomaly
    /// pass reads: it forgets them too, but the table's size must not depend on its schedule.
    #[serde(default)]
    pub latency_records_purged: u64,
    /// Batched requests' bytes (`batch_requests`) past the payload horizon: their elements'
    /// payloads go at the same age.
    #[serde(default)]
    pub batch_requests_purged: u64,
    /// The purges the run's time ran out on before a batch came back short: what is still past
    /// their horizons waits for the next run. Empty when the run caught up.
    #[serde(default)]
    pub cut_short: Vec<&'static str>,
}

/// How long a pass started outside Lambda (`hookctl retention`, the local runner, the drill)
/// may purge: what one scheduled invocation has, its 300 s timeout less the default 3 s
/// margin (`DEADLINE_MARGIN_MS`).
pub const RUN_TIME: Duration = Duration::from_secs(297);

/// A run's counts as its run row keeps them: what it purged (`repaired`), and the identity
/// horizon it purged to with the purges it cut short (`found`). The anomaly check
/// `identity_purge_lag_seconds` measures against that horizon.
struct Recorded {
    outcome: RetentionOutcome,
    identity_horizon: Duration,
}

impl RunCounts for Recorded {
    fn found(&self) -> serde_json::Value {
        serde_json::json!({
            "identity_horizon_seconds": self.identity_horizon.as_secs(),
            "cut_short": self.outcome.cut_short,
        })
    }
    fn repaired(&self) -> serde_json::Value {
        let mut counts = maintenance::json(&self.outcome);
        if let Some(fields) = counts.as_object_mut() {
            fields.remove("cut_short");
        }
        counts
    }
}

/// One retention pass with [`RUN_TIME`] to purge.
pub async fn run_once(
    pool: &PgPool,
    settings: &RetentionSettings,
    trigger: &str,
) -> Result<RetentionOutcome, StoreError> {
    run_until(pool, settings, trigger, Instant::now() + RUN_TIME).await
}

/// One retention pass: each purge runs batch after batch, in turn with the others, until a
/// batch comes back short (nothing more is past its horizon) or `stop_at` is too close to
/// start another (no batch starts unless the slowest of the run so far would end before it).
/// Each batch is its own statement of at most `batch_size` rows, so its locks last as long as
/// one batch; how many batches a run makes follows how many events came in, not a cap.
#[tracing::instrument(skip(pool, settings, stop_at), err)]
pub async fn run_until(
    pool: &PgPool,
    settings: &RetentionSettings,
    trigger: &str,
    stop_at: Instant,
) -> Result<RetentionOutcome, StoreError> {
    let (_, Recorded { outcome, .. }) =
        maintenance::recorded(pool, "retention", trigger, |_| async {
            let mut outcome = RetentionOutcome::default();
            let result = purge(pool, settings, stop_at, &mut outcome).await;
            let recorded = Recorded {
                outcome,
                identity_horizon: settings.identity_after,
            };
            (recorded, result)
        })
        .await?;
    let o = &outcome;
    if !o.cut_short.is_empty() {
        tracing::warn!(
            payloads_purged = o.payloads_purged,
            identities_purged = o.identities_purged,
            cut_short = %o.cut_short.join(","),
            "retention ran out of time with rows perhaps still past their horizons: the next run goes on"
        );
    } else if o.payloads_purged
        + o.identities_purged
        + o.history_purged
        + o.dead_letter_payloads_purged
        + o.closed_dead_letters_purged
        + o.signed_bodies_purged
        + o.buffer_receipts_purged
        + o.latency_records_purged
        + o.batch_requests_purged
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
            latency_records_purged = o.latency_records_purged,
            batch_requests_purged = o.batch_requests_purged,
            "retention pass finished"
        );
    } else {
        tracing::debug!("retention pass: nothing past its horizon");
    }
    Ok(outcome)
}

/// One of a pass's purges, in the order a round takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Purge {
    /// Events the payload cursor passed while they were pending, and processed since.
    AwaitedPayloads,
    Payloads,
    DeadLetterPayloads,
    Identities,
    History,
    SignedBodies,
    BufferReceipts,
    LatencyRecords,
    BatchRequests,
}

impl Purge {
    const ALL: [Purge; 9] = [
        Purge::AwaitedPayloads,
        Purge::Payloads,
        Purge::DeadLetterPayloads,
        Purge::Identities,
        Purge::History,
        Purge::SignedBodies,
        Purge::BufferReceipts,
        Purge::LatencyRecords,
        Purge::BatchRequests,
    ];

    fn name(self) -> &'static str {
        match self {
            Purge::AwaitedPayloads => "awaited_payloads",
            Purge::Payloads => "payloads",
            Purge::DeadLetterPayloads => "dead_letter_payloads",
            Purge::Identities => "identities",
            Purge::History => "history",
            Purge::SignedBodies => "signed_bodies",
            Purge::BufferReceipts => "buffer_receipts",
            Purge::LatencyRecords => "latency_records",
            Purge::BatchRequests => "batch_requests",
        }
    }

    /// One batch, counted into `outcome`; true when it came back full (there may be more).
    async fn batch(
        self,
        pool: &PgPool,
        s: &RetentionSettings,
        outcome: &mut RetentionOutcome,
    ) -> Result<bool, StoreError> {
        let limit = s.batch_size;
        let full = |n: u64| n >= limit as u64;
        Ok(match self {
            Purge::AwaitedPayloads => {
                let pass = retention::purge_processed_since_passed(pool, limit).await?;
                outcome.payloads_purged += pass.purged;
                full(pass.examined)
            }
            Purge::Payloads => {
                let batch =
                    retention::purge_payloads(pool, s.payload_after.as_secs_f64(), limit).await?;
                outcome.payloads_purged += batch.purged;
                full(batch.examined)
            }
            Purge::DeadLetterPayloads => {
                let n = retention::purge_closed_dead_letter_payloads(
                    pool,
                    s.payload_after.as_secs_f64(),
                    limit,
                )
                .await?;
                outcome.dead_letter_payloads_purged += n;
                full(n)
            }
            Purge::Identities => {
                let n = retention::purge_identities(pool, s.identity_after.as_secs_f64(), limit)
                    .await?;
                outcome.identities_purged += n.events;
                outcome.closed_dead_letters_purged += n.closed_dead_letters;
                full(n.events)
            }
            Purge::History => {
                let n =
                    retention::purge_history(pool, s.history_after.as_secs_f64(), limit).await?;
                outcome.history_purged += n;
                full(n)
            }
            Purge::SignedBodies => {
                let n = retention::purge_signed_bodies(pool, s.replay_after.as_secs_f64(), limit)
                    .await?;
                outcome.signed_bodies_purged += n;
                full(n)
            }
            Purge::BufferReceipts => {
                let n = buffer_receipts::prune_older_than(
                    pool,
                    buffer_receipts::RECEIPT_HORIZON,
                    limit,
                )
                .await?;
                outcome.buffer_receipts_purged += n;
                full(n)
            }
            Purge::LatencyRecords => {
                let n = processing_completions::forget_old(pool, limit).await?;
                outcome.latency_records_purged += n;
                full(n)
            }
            Purge::BatchRequests => {
                let n =
                    batch_requests::purge_older_than(pool, s.payload_after.as_secs_f64(), limit)
                        .await?;
                outcome.batch_requests_purged += n;
                full(n)
            }
        })
    }
}

/// Round after round, one batch of each purge that may have more, until none has or `stop_at`
/// is nearer than the slowest batch so far: a backlog in one purge (payloads after an outage)
/// never starves the others.
async fn purge(
    pool: &PgPool,
    s: &RetentionSettings,
    stop_at: Instant,
    outcome: &mut RetentionOutcome,
) -> Result<(), StoreError> {
    let mut left: VecDeque<Purge> = Purge::ALL.into();
    let mut slowest = Duration::ZERO;
    while let Some(purge) = left.pop_front() {
        if Instant::now() + slowest >= stop_at {
            left.push_back(purge);
            let mut cut: Vec<Purge> = left.into();
            cut.sort();
            outcome.cut_short = cut.into_iter().map(Purge::name).collect();
            break;
        }
        let started = Instant::now();
        let more = purge.batch(pool, s, outcome).await?;
        slowest = slowest.max(started.elapsed());
        if more {
            left.push_back(purge);
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
        for batch_size in [0, MAX_BATCH_SIZE + 1] {
            let batch = RetentionSettings {
                batch_size,
                ..Default::default()
            };
            assert!(batch.validate().unwrap_err().contains("batch size"));
        }
    }
}
