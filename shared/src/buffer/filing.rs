//! The buffer's consumer, less its Lambda adapter: files a batch of buffered deliveries with the
//! direct path's semantics, in one transaction.
//!
//! Each delivery is filed once (`buffer_receipts`), under its source as it is now (read fresh,
//! not cached), its fields read exactly as ingest reads them ([`crate::prepare::prepare`]), all
//! of the batch stored by [`webhook_events::upsert_batch`] with the received time ingest
//! recorded. A delivery that can never be filed (its source disabled since, a body the field map
//! cannot read) is recorded as an ingest anomaly in the same transaction and should be deleted
//! from the queue; one that cannot be filed now (an envelope this build does not read, a source
//! row gone) is left on the queue and reaches its dead-letter queue, which alarms. A database
//! error files nothing: the whole batch stays on the queue.

use std::collections::{HashMap, HashSet};

use sha2::{Digest, Sha256};
use sqlx::PgPool;

use super::{BufferedDelivery, DecodeError};
use crate::domain::SourceId;
use crate::prepare::{self, Prepared};
use crate::sources::{self, Source};
use crate::store::StoreError;
use crate::store::buffer_receipts;
use crate::store::delivery_hours;
use crate::store::ingest_anomalies::{self, UnreadableDelivery};
use crate::store::webhook_events::{self, BatchedEvent, UpsertError, Upserted};

/// The anomaly kind of a buffered delivery whose source was disabled before it was filed.
pub const SOURCE_UNAVAILABLE: &str = "buffered_source_unavailable";

/// One SQS message, as the consumer received it.
#[derive(Debug)]
pub struct Message {
    /// SQS's id for the message (what a batch item failure names).
    pub message_id: String,
    pub delivery: Result<BufferedDelivery, DecodeError>,
}

/// What became of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Filed {
    /// Stored, as its direct delivery would have been. Delete the message.
    Stored(Upserted),
    /// Its delivery id was filed before (SQS delivered it twice, or the SDK retried a send
    /// SQS had taken): nothing counted. Delete the message.
    AlreadyFiled,
    /// It can never be filed: recorded as an ingest anomaly of `kind`. Delete the message.
    Unfilable { kind: &'static str, detail: String },
    /// It cannot be filed by this build or now: leave it on the queue (report it as a batch
    /// item failure). If it keeps failing it reaches the dead-letter queue.
    Retry { reason: String },
}

impl Filed {
    /// The `Outcome` dimension of [`crate::metrics::BUFFERED_DELIVERIES_FILED`].
    pub fn metric_outcome(&self) -> &'static str {
        match self {
            Filed::Stored(u) => u.outcome.as_str(),
            Filed::AlreadyFiled => "already_filed",
            Filed::Unfilable { .. } => "unfilable",
            Filed::Retry { .. } => "retry",
        }
    }

    /// Whether the consumer deletes the message (everything but [`Filed::Retry`]).
    pub fn is_done(&self) -> bool {
        !matches!(self, Filed::Retry { .. })
    }
}

/// How often a batch is filed again when a body stored by the previous release under another
/// unsigned id was written between the statement's read and its insert.
const ATTEMPTS: usize = 3;

/// How often a batch is filed again when its transaction lost a race with another (a deadlock
/// or a serialization failure), and the most it waits before the next try (jittered).
const LOST_RACE_ATTEMPTS: usize = 5;
const LOST_RACE_WAIT_MS: u64 = 50;

/// Files `messages` in one transaction and returns what became of each, in order. `Err`: a
/// database error; nothing was committed, and every message stays on the queue.
#[tracing::instrument(skip_all, fields(messages = messages.len()), err)]
pub async fn file_batch(pool: &PgPool, messages: &[Message]) -> Result<Vec<Filed>, StoreError> {
    let mut lost_races = 0;
    let mut body_attempts = 0;
    while body_attempts < ATTEMPTS {
        match file_once(pool, messages).await {
            Err(UpsertError::Store(e))
                if e.is_lost_race() && lost_races + 1 < LOST_RACE_ATTEMPTS =>
            {
                lost_races += 1;
                let wait = rand::random_range(1..=LOST_RACE_WAIT_MS);
                tracing::info!(error = %e, attempt = lost_races, wait_ms = wait, "the batch lost a race with another transaction: filing again");
                tokio::time::sleep(std::time::Duration::from_millis(wait)).await;
                continue;
            }
            Ok(filed) => {
                for f in &filed {
                    crate::metrics::buffered_filed(f.metric_outcome());
                }
                return Ok(filed);
            }
            Err(UpsertError::Store(e)) => return Err(e),
            Err(UpsertError::BodyNotClaimed) => {
                body_attempts += 1;
                tracing::info!(
                    "a body stored by the previous release appeared under the batch: filing again"
                );
            }
        }
    }
    Err(StoreError::Corrupt {
        what: "replayed body",
        reason: "the stored body it replays keeps changing under it".into(),
    })
}

/// A message whose delivery can be looked at: decoded, its source known.
struct Candidate<'m> {
    index: usize,
    delivery: &'m BufferedDelivery,
    source_key: String,
    received_at: chrono::DateTime<chrono::Utc>,
}

async fn file_once(pool: &PgPool, messages: &[Message]) -> Result<Vec<Filed>, UpsertError> {
    let mut filed: Vec<Option<Filed>> = vec![None; messages.len()];
    let mut tx = pool.begin().await.map_err(StoreError::from)?;

    // Decoded, with a time, under a source id that parses.
    let mut candidates = Vec::new();
    let mut wanted: Vec<SourceId> = Vec::new();
    for (index, message) in messages.iter().enumerate() {
        let delivery = match &message.delivery {
            Ok(d) => d,
            Err(e) => {
                filed[index] = Some(Filed::Retry {
                    reason: e.to_string(),
                });
                continue;
            }
        };
        let Some(received_at) =
            chrono::DateTime::from_timestamp_micros(delivery.envelope.received_at_micros)
        else {
            filed[index] = Some(Filed::Retry {
                reason: format!(
                    "received time {} µs is out of range",
                    delivery.envelope.received_at_micros
                ),
            });
            continue;
        };
        let Ok(source_id) = SourceId::parse(&delivery.envelope.source_id) else {
            filed[index] = Some(Filed::Retry {
                reason: format!("source id {:?} is not one", delivery.envelope.source_id),
            });
            continue;
        };
        if !wanted.contains(&source_id) {
            wanted.push(source_id);
        }
        candidates.push(Candidate {
            index,
            delivery,
            source_key: delivery.envelope.source_id.clone(),
            received_at,
        });
    }

    // Each source as it is now.
    let mut found: HashMap<String, Source> = HashMap::new();
    for id in &wanted {
        if let Some(source) = sources::find(&mut *tx, id).await? {
            found.insert(id.as_str().to_owned(), source);
        }
    }
    candidates.retain(|c| {
        if found.contains_key(&c.source_key) {
            true
        } else {
            filed[c.index] = Some(Filed::Retry {
                reason: format!(
                    "source {} no longer exists: nothing can record this delivery against it",
                    c.source_key
                ),
            });
            false
        }
    });

    // Each delivery id once: a copy filed before, or a second copy in this batch, is done.
    let ids: Vec<&str> = candidates
        .iter()
        .map(|c| c.delivery.envelope.delivery_id.as_str())
        .collect();
    let mut new: HashSet<String> = buffer_receipts::claim(&mut *tx, &ids)
        .await?
        .into_iter()
        .collect();
    candidates.retain(|c| {
        if new.remove(&c.delivery.envelope.delivery_id) {
            true
        } else {
            filed[c.index] = Some(Filed::AlreadyFiled);
            false
        }
    });

    // Fields read as ingest reads them; what can never be filed is recorded.
    let mut ready: Vec<(&Candidate<'_>, &Source, Prepared)> = Vec::new();
    for c in &candidates {
        let source = &found[&c.source_key];
        let d = c.delivery;
        let unfilable = if !source.enabled {
            Some((
                SOURCE_UNAVAILABLE,
                format!(
                    "buffered delivery {} could not be filed: source {} was disabled after \
                     ingest verified it",
                    d.envelope.delivery_id, source.source_id
                ),
            ))
        } else {
            let signed = |name: &str| d.signs_header(name);
            match prepare::prepare(
                source,
                &d.header_map(),
                &d.body,
                &signed,
                d.envelope.received_at_micros,
            ) {
                Ok(prepared) => {
                    ready.push((c, source, prepared));
                    None
                }
                Err(e) => Some((e.anomaly_kind(), e.to_string())),
            }
        };
        if let Some((kind, detail)) = unfilable {
            let digest: [u8; 32] = Sha256::digest(&d.body).into();
            ingest_anomalies::record_unreadable(
                &mut *tx,
                &UnreadableDelivery {
                    tenant_id: source.tenant_id.as_str(),
                    source_id: source.source_id.as_str(),
                    kind,
                    payload: &d.body,
                    payload_sha256: digest,
                    detail: &detail,
                },
            )
            .await?;
            tracing::warn!(
                source_id = %source.source_id,
                delivery_id = %d.envelope.delivery_id,
                kind,
                %detail,
                "buffered delivery cannot be filed: recorded as an anomaly"
            );
            filed[c.index] = Some(Filed::Unfilable { kind, detail });
        }
    }

    let events: Vec<BatchedEvent<'_>> = ready
        .iter()
        .map(|(c, source, prepared)| BatchedEvent {
            event: prepared.event(
                source,
                &c.delivery.body,
                &c.delivery.envelope.verified_with,
                c.delivery.signed_digest(),
            ),
            received_at: c.received_at,
        })
        .collect();
    let stored = webhook_events::upsert_batch(&mut tx, &events).await?;
    // A delivery received over MARK_AFTER_SECONDS ago lands in an hour the anomaly rollup may
    // not compute again unmarked: marked in this transaction, so the mark is seen with the
    // event. (A repeated event's own hour is marked by the batch statement.)
    let late: Vec<(&str, chrono::DateTime<chrono::Utc>)> = ready
        .iter()
        .filter(|(c, _, _)| delivery_hours::may_be_late(c.received_at))
        .map(|(c, source, _)| (source.source_id.as_str(), c.received_at))
        .collect();
    if !late.is_empty() {
        delivery_hours::mark_late(&mut *tx, &late).await?;
    }
    for ((c, _, _), upserted) in ready.iter().zip(stored) {
        filed[c.index] = Some(Filed::Stored(upserted));
    }
    tx.commit().await.map_err(StoreError::from)?;

    filed
        .into_iter()
        .map(|f| {
            f.ok_or_else(|| {
                StoreError::Corrupt {
                    what: "buffered batch",
                    reason: "a message was left without an outcome".into(),
                }
                .into()
            })
        })
        .collect()
}
