//! Replay to a subscriber: stored events of a range sent again to one subscription, as a
//! resumable job (`hookctl events replay`). Each step queues the next events of the range, after
//! the job's cursor, as that subscription's outbox messages (pending again if they were
//! delivered: the same idempotency keys, so a subscriber deduplicates), moves the cursor and
//! commits; the outbox sender delivers them as any other message. Events whose payload
//! retention purged are skipped and counted. Interrupted, the same command resumes the job.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use super::{Selection, action_of, envelope};
use crate::effects::outbox_key;
use crate::store::StoreError;
use crate::store::subscriptions::{self as stored, ForwardRows, ReplayJob};

/// Events a second when neither the command nor the subscription names a rate.
pub const DEFAULT_RATE: f64 = 100.0;
/// Most events one step reads and queues at once.
const MAX_STEP: i64 = 500;

/// What to replay, to which subscription.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplayRequest {
    pub tenant_id: String,
    pub subscription: String,
    #[serde(default)]
    pub source_id: Option<String>,
    /// Narrows the subscription's own types further (exact names or globs).
    #[serde(default)]
    pub event_types: Vec<String>,
    pub since: chrono::DateTime<chrono::Utc>,
    pub until: chrono::DateTime<chrono::Utc>,
    /// Events a second (default: the subscription's rate limit, else [`DEFAULT_RATE`]).
    #[serde(default)]
    pub rate: Option<f64>,
}

/// Where a replay stands after a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ReplayProgress {
    pub replay_id: i64,
    /// This run picked up a job an earlier run left.
    pub resumed: bool,
    /// Messages queued (new, or pending again), since the job began.
    pub queued: i64,
    /// Events of the range whose payload retention purged: not sent.
    pub skipped_purged: i64,
    /// Stored events of the range still after the cursor (ones the subscription does not take
    /// included).
    pub remaining: i64,
    pub finished: bool,
    pub rate: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("{0}")]
    Invalid(String),
    #[error("tenant {tenant} has no subscription {name} (hookctl routes list)")]
    NoSuchSubscription { tenant: String, name: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ReplayRequest {
    fn check(&self) -> Result<(), ReplayError> {
        if self.until <= self.since {
            return Err(ReplayError::Invalid(format!(
                "--until ({}) is not after --since ({})",
                self.until, self.since
            )));
        }
        if let Some(rate) = self.rate
            && !(rate.is_finite() && rate > 0.0)
        {
            return Err(ReplayError::Invalid(format!(
                "rate {rate} is not a positive number of events a second"
            )));
        }
        Ok(())
    }
}

/// Runs the replay `request` describes (a new job, or the running one of the same range) until
/// its range is done or `deadline` passes, queueing at most `rate` events a second. Each step
/// commits its messages with the cursor, so an interrupted run loses nothing and repeats
/// nothing but keys the subscriber already holds.
pub async fn run(
    pool: &PgPool,
    request: &ReplayRequest,
    actor: &str,
    reason: Option<&str>,
    deadline: Instant,
) -> Result<ReplayProgress, ReplayError> {
    request.check()?;
    let subscription = stored::find(pool, &request.tenant_id, &request.subscription)
        .await?
        .ok_or_else(|| ReplayError::NoSuchSubscription {
            tenant: request.tenant_id.clone(),
            name: request.subscription.clone(),
        })?;
    let rate = request
        .rate
        .or(subscription.rate_limit)
        .unwrap_or(DEFAULT_RATE);
    let selection = super::selection_of(&subscription);
    let narrowed = Selection {
        event_types: request.event_types.clone(),
        filter: None,
    };
    let source = request.source_id.clone().or(subscription.source_id.clone());
    if let (Some(asked), Some(own)) = (&request.source_id, &subscription.source_id)
        && asked != own
    {
        return Err(ReplayError::Invalid(format!(
            "subscription {} takes source {own} only, not {asked}",
            subscription.name
        )));
    }
    let action = action_of(&subscription.name);
    let step = (rate.ceil() as i64).clamp(1, MAX_STEP);
    let mut resumed = None;
    let mut job: ReplayJob;
    loop {
        let started = Instant::now();
        let mut tx = pool.begin().await.map_err(StoreError::from)?;
        let (current, was_running) = stored::start_or_resume(
            &mut tx,
            &request.tenant_id,
            &subscription.name,
            source.as_deref(),
            &request.event_types,
            request.since,
            request.until,
            rate,
            actor,
            reason,
        )
        .await?;
        job = current;
        resumed.get_or_insert(was_running);
        let events = stored::next_events(&mut *tx, &job, step).await?;
        let finished = (events.len() as i64) < step;
        let mut rows = ForwardRows::default();
        let mut purged = 0;
        for event in &events {
            if event.payload.is_none() {
                purged += 1;
                continue;
            }
            let data = || {
                event
                    .payload
                    .as_deref()
                    .and_then(|p| envelope::data_of(p).as_json())
            };
            if !(selection.takes_type(&event.event_type)
                && narrowed.takes_type(&event.event_type)
                && selection.takes_data(data))
            {
                continue;
            }
            let key = outbox_key(&event.tenant_id, &event.external_id, &action);
            let body = envelope::of(event, &key).to_string();
            rows.push(
                &event.tenant_id,
                &event.external_id,
                action.clone(),
                key,
                body,
            );
        }
        let queued = stored::requeue_forwards(&mut *tx, &rows).await? as i64;
        stored::advance(
            &mut *tx,
            job.replay_id,
            events.last(),
            queued,
            purged,
            finished,
        )
        .await?;
        tx.commit().await.map_err(StoreError::from)?;
        job.queued += queued;
        job.skipped_purged += purged;
        if finished {
            job.status = "finished".into();
            break;
        }
        // The pace: one step of `step` events a second at `rate`.
        let pace = Duration::from_secs_f64(step as f64 / rate);
        let wait = pace.saturating_sub(started.elapsed());
        if Instant::now() + wait >= deadline {
            break;
        }
        tokio::time::sleep(wait).await;
    }
    let finished = job.status == "finished";
    let remaining = if finished {
        0
    } else {
        let mut conn = pool.acquire().await.map_err(StoreError::from)?;
        let fresh = stored::find_job(&mut *conn, job.replay_id).await?;
        stored::remaining(&mut *conn, fresh.as_ref().unwrap_or(&job)).await?
    };
    Ok(ReplayProgress {
        replay_id: job.replay_id,
        resumed: resumed.unwrap_or(false),
        queued: job.queued,
        skipped_purged: job.skipped_purged,
        remaining,
        finished,
        rate,
    })
}
