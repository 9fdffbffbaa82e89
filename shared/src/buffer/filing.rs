//! The buffer's consumer, less its Lambda adapter: files a batch of buffered deliveries with the
//! direct path's semantics, in one transaction.
//!
//! Each delivery is filed once (`buffer_receipts`), under its source as it is now (read fresh,
//! not cached), its fields read exactly as ingest reads them ([`crate::prepare::prepare`]), all
//! of the batch stored by [`webhook_events::upsert_batch`] with the received time ingest
//! recorded; a source disabled since ingest admitted the delivery still files it. A delivery
//! that can never be filed (a body the field map cannot read) is recorded as an ingest anomaly
//! in the same transaction and should be deleted from the queue; one that cannot be filed now (an envelope this build does not read, a source
//! row gone) is left on the queue and reaches its dead-letter queue, which alarms. A database
//! error files nothing: the whole batch stays on the queue.

use std::collections::{HashMap, HashSet};

use sha2::{Digest, Sha256};
use sqlx::PgPool;

use super::{BufferedDelivery, DecodeError};
use crate::batches::ElementCounts;
use crate::domain::SourceId;
use crate::prepare::{self, Prepared};
use crate::sources::{self, Source};
use crate::store::StoreError;
use crate::store::batch_requests::{self, NewBatchRequest};
use crate::store::buffer_receipts;
use crate::store::delivery_hours;
use crate::store::ingest_anomalies::{self, UnreadableDelivery};
use crate::store::webhook_events::{self, BatchedEvent, UpsertError, Upserted};

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
    /// A batch, its elements each stored as its own event, as its direct delivery's would have
    /// been. Delete the message.
    StoredBatch(ElementCounts),
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
            Filed::StoredBatch(counts) => counts.outcome().as_str(),
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
        // Filed whether or not the source is still enabled: ingest admitted the delivery and
        // answered 200, so the provider will not send it again. Disabling a source stops
        // admissions, not what was already admitted.
        let signed = |name: &str| d.signs_header(name);
        let unfilable = match prepare::prepare(
            source,
            &d.header_map(),
            &d.body,
            &signed,
            d.envelope.received_at_micros,
        ) {
            Ok(mut prepared) => {
                prepared.sign_each(&d.element_digests());
                ready.push((c, source, prepared));
                None
            }
            Err(e) => Some((
                e.anomaly_kind(),
                format!(
                    "{}{} could not be filed: {e}",
                    ingest_anomalies::FROM_THE_BUFFER,
                    d.envelope.delivery_id
                ),
            )),
        };
        if let Some((kind, detail)) = unfilable {
            let digest: [u8; 32] = Sha256::digest(&d.body).into();
            let headers = serde_json::to_value(&d.envelope.headers).unwrap_or_default();
            ingest_anomalies::record_unreadable(
                &mut *tx,
                &UnreadableDelivery {
                    tenant_id: source.tenant_id.as_str(),
                    source_id: source.source_id.as_str(),
                    kind,
                    payload: &d.body,
                    payload_sha256: digest,
                    detail: &detail,
                    headers: &headers,
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

    // Every event of every message, each with its message's place in `ready`.
    let mut owners = Vec::new();
    let mut events: Vec<BatchedEvent<'_>> = Vec::new();
    for (at, (c, source, prepared)) in ready.iter().enumerate() {
        let d = c.delivery;
        let these = prepared.events(
            source,
            &d.body,
            &d.envelope.verified_with,
            d.signed_digest(),
            d.envelope.verified_layout.as_deref(),
        );
        // A batch's request is kept once, beside its elements.
        if prepared.batch {
            let headers = serde_json::to_value(&d.envelope.headers).unwrap_or_default();
            batch_requests::record(
                &mut *tx,
                &NewBatchRequest {
                    tenant_id: source.tenant_id.as_str(),
                    source_id: source.source_id.as_str(),
                    received_at: c.received_at,
                    external_ids: these.iter().map(|e| e.external_id).collect(),
                    body: &d.body,
                    body_sha256: Sha256::digest(&d.body).into(),
                    headers: &headers,
                    verified_with: &d.envelope.verified_with,
                },
            )
            .await?;
        }
        for event in these {
            owners.push(at);
            events.push(BatchedEvent {
                event,
                received_at: c.received_at,
                buffered: true,
            });
        }
    }
    let stored = webhook_events::upsert_batch(&mut tx, &events).await?;
    // A delivery received over MARK_AFTER_SECONDS ago lands in an hour the anomaly rollup may
    // not compute again unmarked: marked in this transaction, so the mark is seen with the
    // event. (A repeated event's own hour is marked by the batch statement.) Such an event may
    // also land behind the payload purge's cursor: it is listed for the purge.
    let late: Vec<(&BatchedEvent<'_>, &str)> = owners
        .iter()
        .zip(&events)
        .filter(|(at, _)| delivery_hours::may_be_late(ready[**at].0.received_at))
        .map(|(at, e)| (e, ready[*at].1.source_id.as_str()))
        .collect();
    if !late.is_empty() {
        let hours: Vec<(&str, chrono::DateTime<chrono::Utc>)> = late
            .iter()
            .map(|(e, source)| (*source, e.received_at))
            .collect();
        delivery_hours::mark_late(&mut *tx, &hours).await?;
        let (tenants, ids): (Vec<&str>, Vec<&str>) = late
            .iter()
            .map(|(e, _)| (e.event.tenant_id, e.event.external_id))
            .unzip();
        crate::store::retention::list_filed_behind_payload_cursor(&mut *tx, &tenants, &ids).await?;
    }
    let mut outcomes: Vec<Vec<Upserted>> = vec![Vec::new(); ready.len()];
    for (at, upserted) in owners.into_iter().zip(stored) {
        outcomes[at].push(upserted);
    }
    for ((c, _, prepared), upserted) in ready.iter().zip(outcomes) {
        filed[c.index] = Some(if prepared.batch {
            let mut counts = ElementCounts::default();
            for u in &upserted {
                counts.count(u.outcome);
            }
            Filed::StoredBatch(counts)
        } else {
            match upserted.into_iter().next() {
                Some(u) => Filed::Stored(u),
                None => Filed::Retry {
                    reason: "the upsert answered nothing for it".into(),
                },
            }
        });
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

/// Why a kept delivery was not filed.
#[derive(Debug, thiserror::Error)]
pub enum FileKeptError {
    #[error("no ingest anomaly {0}")]
    NotFound(i64),
    #[error("anomaly {anomaly_id} ({kind}) keeps no delivery to file: {reason}")]
    NothingKept {
        anomaly_id: i64,
        kind: String,
        reason: &'static str,
    },
    #[error("anomaly {anomaly_id} was filed already, as event {external_id}")]
    AlreadyFiled {
        anomaly_id: i64,
        external_id: String,
    },
    #[error("source {0} no longer exists")]
    NoSource(String),
    /// Its source's field map still cannot read it: correct the map (`hookctl sources apply`)
    /// first.
    #[error("source {source_id} still cannot read it: {error}")]
    StillUnreadable {
        source_id: String,
        #[source]
        error: crate::extract::ExtractError,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<UpsertError> for FileKeptError {
    fn from(error: UpsertError) -> Self {
        match error {
            UpsertError::Store(e) => FileKeptError::Store(e),
            UpsertError::BodyNotClaimed => FileKeptError::Store(StoreError::Corrupt {
                what: "replayed body",
                reason: "a body stored by the previous release appeared under it: file it again"
                    .into(),
            }),
        }
    }
}

/// A kept delivery, filed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FiledKept {
    pub anomaly_id: i64,
    pub source_id: String,
    pub external_id: String,
    /// `accepted`, `duplicate` or `conflict`, as the upsert answered.
    pub outcome: String,
}

/// Files the delivery an ingest anomaly kept (a buffered delivery the consumer could not file,
/// or one ingest answered 400 for), in the caller's transaction, as ingest would have filed it:
/// its fields read with the source's field map as it is now, stored by the buffer's set-wise
/// upsert under the time the anomaly was recorded, then the anomaly marked filed. What the
/// signature covered is not known any more: every kept header is taken as unsigned (an id read
/// from one is outside the signature, as GitHub's always is), and the secret recorded as
/// `current`.
pub async fn file_kept(
    conn: &mut sqlx::PgConnection,
    anomaly_id: i64,
) -> Result<FiledKept, FileKeptError> {
    let kept = crate::store::ingest_anomalies::kept_delivery(&mut *conn, anomaly_id)
        .await?
        .ok_or(FileKeptError::NotFound(anomaly_id))?;
    let nothing = |reason| FileKeptError::NothingKept {
        anomaly_id,
        kind: kept.kind.clone(),
        reason,
    };
    if !crate::store::ingest_anomalies::KEPT_DELIVERY_KINDS.contains(&kept.kind.as_str()) {
        return Err(nothing(
            "only an unreadable or unfiled delivery is kept in place of an event",
        ));
    }
    if let Some(external_id) = kept.filed_as.clone() {
        return Err(FileKeptError::AlreadyFiled {
            anomaly_id,
            external_id,
        });
    }
    let payload = kept
        .payload
        .as_deref()
        .ok_or_else(|| nothing("its payload was purged by retention"))?;
    let source = sources::find(
        &mut *conn,
        &SourceId::parse(&kept.source_id)
            .map_err(|_| FileKeptError::NoSource(kept.source_id.clone()))?,
    )
    .await?
    .ok_or_else(|| FileKeptError::NoSource(kept.source_id.clone()))?;
    let mut headers = http::HeaderMap::new();
    if let Some(serde_json::Value::Object(kept_headers)) = &kept.headers {
        for (name, value) in kept_headers {
            if let (Ok(name), Some(Ok(value))) = (
                http::HeaderName::from_bytes(name.as_bytes()),
                value.as_str().map(http::HeaderValue::from_str),
            ) {
                headers.insert(name, value);
            }
        }
    }
    let received_micros = kept.detected_at.timestamp_micros();
    let prepared = prepare::prepare(&source, &headers, payload, &|_| false, received_micros)
        .map_err(|error| FileKeptError::StillUnreadable {
            source_id: kept.source_id.clone(),
            error,
        })?;
    let events: Vec<BatchedEvent<'_>> = prepared
        .events(&source, payload, "current", None, None)
        .into_iter()
        .map(|event| BatchedEvent {
            event,
            received_at: kept.detected_at,
            buffered: false,
        })
        .collect();
    let stored = webhook_events::upsert_batch(&mut *conn, &events).await?;
    let outcome = stored
        .first()
        .map(|u| u.outcome.as_str().to_owned())
        .unwrap_or_default();
    let external_id = prepared
        .first()
        .map(|f| f.external_id.as_str().to_owned())
        .unwrap_or_default();
    crate::store::ingest_anomalies::mark_filed(&mut *conn, anomaly_id, &external_id).await?;
    tracing::info!(anomaly_id, source_id = %kept.source_id, %external_id, %outcome, "kept delivery filed");
    Ok(FiledKept {
        anomaly_id,
        source_id: kept.source_id,
        external_id,
        outcome,
    })
}
