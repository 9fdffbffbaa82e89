//! The drain: turns queued events into trusted state, exactly once.
//!
//! A batch is one transaction over up to `batch_size` ready events, claimed with `FOR UPDATE
//! SKIP LOCKED` (so concurrent drainers never wait on each other), each handler's events
//! applied together, set-wise. A drainer that dies mid-batch commits nothing; its rows unlock
//! and are claimed again.
//!
//! Almost every batch succeeds whole, so a batch is first taken as one: one statement claims
//! it and completes it as if every event succeeds (queue rows deleted, events marked processed
//! with what their handlers declare they expect, latencies recorded), then the effects are
//! applied group by group with no savepoint, and the batch commits: one statement and one
//! round trip a batch fewer than claiming and completing apart, and the completion finds its
//! rows by the addresses the claim locked, not by key again (docs/benchmarks.md: one drainer's
//! rate did not change measurably). When any group fails, the batch is rolled back (its
//! completions with it: nothing of it stays) and claimed again with a savepoint per group: a
//! failing group is rolled back and split until each failing event stands alone, so one bad
//! event never rolls back its batch, and the batch is finished with one statement each to
//! complete, reschedule and dead-letter. The drainer keeps its savepoints until a batch has no
//! failure, so a run of poison events costs one wasted attempt, not one per batch.
//!
//! A processed event that reconcile re-queued is a repair: its handler runs again to re-assert
//! its effects, and whatever that does, the event row stays as it was (never retried, never
//! dead-lettered, never rewritten); the repair only leaves the queue.
//!
//! Finished work leaves `event_queue` by DELETE, so the claim index holds only what waits; the
//! drainer itself vacuums the queue as it goes (besides autovacuum) so dead index entries do
//! not pile up at the head of the queue and slow every claim.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::Rng;
use serde::{Deserialize, Serialize};
use sqlx::{Connection, PgConnection, PgPool};

use crate::effects::{Effect, EffectError, EffectHandler, EffectRegistry};
use crate::store::dead_letters::{self, ReplayFilter};
use crate::store::event_queue::{self, ClaimedEvent};
use crate::store::unrepaired_losses;
use crate::store::{self, StoreError};
use crate::subscriptions;

/// Drain settings, with the defaults named here.
#[derive(Debug, Clone)]
pub struct DrainSettings {
    pub batch_size: i64,
    /// Attempts an event gets before a retryable failure dead-letters it.
    pub max_attempts: i32,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// Vacuum the queue after this many rows left it (and at most every `vacuum_interval`).
    pub vacuum_after_rows: u64,
    pub vacuum_interval: Duration,
    /// How long a pass that found nothing ready waits before looking again, when it stays in
    /// its invocation for new work ([`Drainer::stay_until`]); zero: it returns instead.
    pub idle_poll: Duration,
}

impl Default for DrainSettings {
    fn default() -> Self {
        Self {
            batch_size: 100,
            max_attempts: 8,
            backoff_base: Duration::from_secs(1),
            backoff_cap: Duration::from_secs(15 * 60),
            vacuum_after_rows: 20_000,
            vacuum_interval: Duration::from_secs(5),
            idle_poll: Duration::from_millis(100),
        }
    }
}

impl DrainSettings {
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=10_000).contains(&self.batch_size) {
            return Err(format!(
                "batch size {} is outside 1..=10000",
                self.batch_size
            ));
        }
        if self.max_attempts < 1 {
            return Err("max attempts must be at least 1".into());
        }
        if self.backoff_base.is_zero() || self.backoff_cap < self.backoff_base {
            return Err("backoff base must be positive and not above the cap".into());
        }
        Ok(())
    }
}

/// `min(cap, base · 2^attempts)` with full jitter: a uniform delay in `[0, that]`.
pub fn retry_delay(attempts_before: i32, base: Duration, cap: Duration) -> Duration {
    let exponent = attempts_before.clamp(0, 30) as u32;
    let ceiling = base.saturating_mul(1u32 << exponent).min(cap);
    let millis = ceiling.as_millis() as u64;
    Duration::from_millis(rand::rng().random_range(0..=millis))
}

/// The instant `margin` before `deadline` (a Lambda invocation's, say): when a pass stops
/// starting new batches.
pub fn stop_before(deadline: std::time::SystemTime, margin: Duration) -> Instant {
    let remaining = deadline
        .duration_since(std::time::SystemTime::now())
        .unwrap_or(Duration::ZERO);
    Instant::now() + remaining.saturating_sub(margin)
}

/// What a drain run did, counted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainOutcome {
    pub batches: u64,
    pub claimed: u64,
    pub processed: u64,
    pub retried: u64,
    pub dead_lettered: u64,
    pub vacuums: u64,
    /// Of `processed`: repairs, processed events reconcile re-queued, whose handler re-ran.
    pub repairs: u64,
    /// Repairs whose handler failed: left out of the queue, their events untouched (the next
    /// reconcile pass finds them again).
    pub repairs_failed: u64,
    /// Claimed but left undecided, queued as they were: their batch had used its
    /// subtransactions ([`MAX_SUBTRANSACTIONS`]) isolating failing events.
    #[serde(default)]
    pub deferred: u64,
    /// Batches whose effects failed as one unit: rolled back whole and claimed again with a
    /// savepoint per group (not counted in `batches` or `claimed`; nothing of them committed).
    #[serde(default)]
    pub redone: u64,
    /// Outbox messages written for subscriptions: one per (processed event, subscription that
    /// takes it).
    #[serde(default)]
    pub forwarded: u64,
}

impl DrainOutcome {
    /// Counts what the batches committed, as metrics.
    fn publish(&self) {
        crate::metrics::drained(self.processed, self.retried, self.dead_lettered);
    }

    /// Adds another pass's counts to these.
    pub fn add(&mut self, other: &DrainOutcome) {
        self.batches += other.batches;
        self.claimed += other.claimed;
        self.processed += other.processed;
        self.retried += other.retried;
        self.dead_lettered += other.dead_lettered;
        self.vacuums += other.vacuums;
        self.repairs += other.repairs;
        self.repairs_failed += other.repairs_failed;
        self.deferred += other.deferred;
        self.redone += other.redone;
        self.forwarded += other.forwarded;
    }
}

pub struct Drainer {
    pool: PgPool,
    registry: Arc<EffectRegistry>,
    settings: DrainSettings,
    left_since_vacuum: AtomicU64,
    last_vacuum: std::sync::Mutex<Instant>,
    /// The last batch had a failing event: the next one applies under savepoints from the start.
    isolating: AtomicBool,
}

/// Per-batch decisions, applied with one statement each.
#[derive(Default)]
struct Decisions {
    done: (Vec<String>, Vec<String>, Vec<&'static str>),
    /// Repairs, done or failed: they only leave the queue.
    repairs: (Vec<String>, Vec<String>),
    repairs_failed: u64,
    /// Repairs that failed, with their errors; and those that succeeded: the standing losses
    /// (`unrepaired_losses`) they record and clear.
    failed_repairs: (Vec<String>, Vec<String>, Vec<String>),
    repaired: (Vec<String>, Vec<String>),
    retry: (Vec<String>, Vec<String>, Vec<i64>, Vec<String>),
    dead: (Vec<String>, Vec<String>, Vec<String>, Vec<&'static str>),
}

impl Drainer {
    pub fn new(pool: PgPool, registry: Arc<EffectRegistry>, settings: DrainSettings) -> Self {
        Self {
            pool,
            registry,
            settings,
            left_since_vacuum: AtomicU64::new(0),
            last_vacuum: std::sync::Mutex::new(Instant::now()),
            isolating: AtomicBool::new(false),
        }
    }

    /// Drains until a batch comes back short (nothing more is ready) or `deadline` passes.
    #[tracing::instrument(skip_all, err)]
    pub async fn drain_until(&self, deadline: Instant) -> Result<DrainOutcome, StoreError> {
        self.pass(deadline, false).await
    }

    /// Drains until `deadline`, waiting for new work when nothing is ready (a poll of the
    /// queue's claim index every `idle_poll`) instead of returning: a scheduled invocation stays
    /// in its minute, so an event committed meanwhile is processed within a poll.
    #[tracing::instrument(skip_all, err)]
    pub async fn stay_until(&self, deadline: Instant) -> Result<DrainOutcome, StoreError> {
        self.pass(deadline, true).await
    }

    async fn pass(&self, deadline: Instant, stay: bool) -> Result<DrainOutcome, StoreError> {
        let mut total = DrainOutcome::default();
        // One connection for the whole pass: taken from the pool and given back per batch, it
        // costs a round trip each time (sqlx pings a connection as it returns to the pool).
        let mut conn = self.pool.acquire().await?;
        while Instant::now() < deadline {
            let batch = match self.run_once_on(&mut conn).await {
                Ok(batch) => batch,
                Err(e) => {
                    // What earlier batches committed is counted; the queue is not reported, so
                    // a failing drain goes silent rather than repeating a healthy backlog.
                    total.publish();
                    return Err(e);
                }
            };
            // A poll that found nothing is not a batch worth counting.
            if !(stay && batch.claimed == 0) {
                total.add(&batch);
            }
            if batch.claimed < self.settings.batch_size as u64 && batch.deferred == 0 {
                // An idle poll of zero: return when nothing is ready, as a pass without `stay`.
                if !stay || self.settings.idle_poll.is_zero() {
                    break;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                tokio::time::sleep(self.settings.idle_poll.min(left)).await;
            }
        }
        total.publish();
        let (backlog, oldest) = event_queue::backlog(&mut *conn).await?;
        crate::metrics::queue(backlog, oldest);
        if total.claimed > 0 {
            tracing::info!(
                batches = total.batches,
                claimed = total.claimed,
                processed = total.processed,
                retried = total.retried,
                dead_lettered = total.dead_lettered,
                repairs = total.repairs,
                repairs_failed = total.repairs_failed,
                deferred = total.deferred,
                redone = total.redone,
                forwarded = total.forwarded,
                vacuums = total.vacuums,
                backlog,
                oldest_pending_age_seconds = oldest,
                "drain pass finished"
            );
        } else {
            tracing::debug!(
                backlog,
                oldest_pending_age_seconds = oldest,
                "drain pass: nothing ready"
            );
        }
        Ok(total)
    }

    /// One batch, one transaction: applied as one unit, or, when that fails (or the last batch
    /// had a failing event), rolled back and applied again under a savepoint per group.
    pub async fn run_once(&self) -> Result<DrainOutcome, StoreError> {
        let mut conn = self.pool.acquire().await?;
        self.run_once_on(&mut conn).await
    }

    /// [`Drainer::run_once`] on a connection the caller holds across batches.
    pub async fn run_once_on(&self, conn: &mut PgConnection) -> Result<DrainOutcome, StoreError> {
        let mut redone = 0;
        if !self.isolating.load(Ordering::Relaxed) {
            match self.batch(conn, Isolation::Whole).await? {
                Some(outcome) => return Ok(outcome),
                None => redone = 1,
            }
        }
        // Savepoints isolate every failure: a batch under them is never `None`.
        let mut outcome: DrainOutcome = self
            .batch(conn, Isolation::Savepoints)
            .await?
            .unwrap_or_default();
        let failed =
            outcome.retried + outcome.dead_lettered + outcome.repairs_failed + outcome.deferred;
        self.isolating.store(failed > 0, Ordering::Relaxed);
        outcome.redone = redone;
        Ok(outcome)
    }

    /// One batch, one transaction; `None` when its effects, applied as one unit, failed and the
    /// transaction was rolled back.
    async fn batch(
        &self,
        conn: &mut PgConnection,
        isolation: Isolation,
    ) -> Result<Option<DrainOutcome>, StoreError> {
        match isolation {
            Isolation::Whole => self.whole_batch(conn).await,
            Isolation::Savepoints => self.isolating_batch(conn).await.map(Some),
        }
    }

    /// A batch that succeeds whole or not at all: claimed and completed in one statement (every
    /// event assumed to succeed), its effects applied group by group with no savepoint; `None`
    /// when any group failed and the transaction, completions and all, was rolled back.
    async fn whole_batch(
        &self,
        conn: &mut PgConnection,
    ) -> Result<Option<DrainOutcome>, StoreError> {
        let mut tx = conn.begin().await?;
        let declared = self.registry.declared_expectations();
        let claimed =
            event_queue::claim_completed(&mut tx, self.settings.batch_size, &declared).await?;
        if claimed.is_empty() {
            tx.rollback().await?;
            return Ok(Some(DrainOutcome {
                batches: 1,
                ..DrainOutcome::default()
            }));
        }
        let (claimed, recorded): (Vec<ClaimedEvent>, Vec<Option<String>>) =
            claimed.into_iter().map(|c| (c.event, c.expects)).unzip();
        let handlers: Vec<&dyn EffectHandler> = claimed
            .iter()
            .map(|event| self.registry.handler_for(event))
            .collect();
        for (handler, members) in groups(&handlers) {
            if !apply_whole(&mut tx, handler, &claimed, members).await? {
                tx.rollback().await?;
                return Ok(None);
            }
        }
        // What the claim could not record (a handler that declares nothing, or declares other
        // than it answers), and the repairs, which leave their events as they were.
        let mut unrecorded: (Vec<String>, Vec<String>, Vec<&'static str>) = Default::default();
        let mut repaired: (Vec<String>, Vec<String>) = Default::default();
        for ((event, recorded), handler) in claimed.iter().zip(&recorded).zip(&handlers) {
            if event.repair {
                repaired.0.push(event.tenant_id.clone());
                repaired.1.push(event.external_id.clone());
                continue;
            }
            let expects = handler.expects(event).as_str();
            if recorded.as_deref() != Some(expects) {
                unrecorded.0.push(event.tenant_id.clone());
                unrecorded.1.push(event.external_id.clone());
                unrecorded.2.push(expects);
            }
        }
        let u = &unrecorded;
        event_queue::record_expectations(&mut *tx, &u.0, &u.1, &u.2).await?;
        unrepaired_losses::clear(&mut *tx, &repaired.0, &repaired.1).await?;
        // Subscriptions hear of the events this batch processed, in its transaction. A repair
        // re-asserts effects only: a subscription made after its event is served by a replay.
        let processed: Vec<&ClaimedEvent> = claimed.iter().filter(|e| !e.repair).collect();
        let forwarded = subscriptions::fan_out(&mut tx, &processed).await?;
        tx.commit().await?;

        let mut outcome = DrainOutcome {
            batches: 1,
            claimed: claimed.len() as u64,
            processed: claimed.len() as u64,
            repairs: repaired.0.len() as u64,
            forwarded,
            ..DrainOutcome::default()
        };
        if self.vacuum_due(outcome.claimed) {
            event_queue::vacuum(&mut *conn).await?;
            outcome.vacuums = 1;
        }
        Ok(Some(outcome))
    }

    /// A batch applied under a savepoint per group, each failing group rolled back and split
    /// until each failing event stands alone: the rest completes, the failing events are retried
    /// or dead-lettered (repairs only leave the queue), and what is past the subtransaction
    /// budget stays queued as it was.
    async fn isolating_batch(&self, conn: &mut PgConnection) -> Result<DrainOutcome, StoreError> {
        let mut tx = conn.begin().await?;
        let claimed = event_queue::claim(&mut tx, self.settings.batch_size).await?;
        if claimed.is_empty() {
            tx.rollback().await?;
            return Ok(DrainOutcome {
                batches: 1,
                ..DrainOutcome::default()
            });
        }
        let mut verdicts: Vec<Option<Result<Effect, EffectError>>> =
            claimed.iter().map(|_| None).collect();
        let mut kept = 0;
        // Each event's handler, looked up once for applying and for what it expects.
        let handlers: Vec<&dyn EffectHandler> = claimed
            .iter()
            .map(|event| self.registry.handler_for(event))
            .collect();
        for (handler, members) in groups(&handlers) {
            apply_group(
                &mut tx,
                handler,
                &claimed,
                members,
                &mut verdicts,
                &mut kept,
            )
            .await?
        }
        let mut decisions = Decisions::default();
        let mut done: Vec<&ClaimedEvent> = Vec::new();
        let mut deferred = 0;
        for ((event, verdict), handler) in claimed.iter().zip(verdicts).zip(&handlers) {
            let Some(applied) = verdict else {
                // Past the subtransaction budget: left queued as it was, for the next batch.
                deferred += 1;
                continue;
            };
            if event.repair {
                // A processed event stays processed whatever its repair does: never retried
                // into another attempt, never dead-lettered, never rewritten.
                match applied {
                    Err(EffectError::Aborted(error)) => return Err(error),
                    Err(error) => {
                        tracing::warn!(tenant_id = %event.tenant_id, external_id = %event.external_id, %error, "repair of a processed event failed");
                        decisions.repairs_failed += 1;
                        decisions.failed_repairs.0.push(event.tenant_id.clone());
                        decisions.failed_repairs.1.push(event.external_id.clone());
                        decisions.failed_repairs.2.push(error.to_string());
                    }
                    Ok(_) => {
                        decisions.repaired.0.push(event.tenant_id.clone());
                        decisions.repaired.1.push(event.external_id.clone());
                    }
                }
                decisions.repairs.0.push(event.tenant_id.clone());
                decisions.repairs.1.push(event.external_id.clone());
                continue;
            }
            match applied {
                Ok(_) => {
                    let expects = handler.expects(event);
                    done.push(event);
                    decisions.done.0.push(event.tenant_id.clone());
                    decisions.done.1.push(event.external_id.clone());
                    decisions.done.2.push(expects.as_str());
                }
                Err(EffectError::Aborted(error)) => return Err(error),
                Err(EffectError::Retryable(why))
                    if event.attempts + 1 < self.settings.max_attempts =>
                {
                    let delay = retry_delay(
                        event.attempts,
                        self.settings.backoff_base,
                        self.settings.backoff_cap,
                    );
                    decisions.retry.0.push(event.tenant_id.clone());
                    decisions.retry.1.push(event.external_id.clone());
                    decisions.retry.2.push(delay.as_millis() as i64);
                    decisions.retry.3.push(why);
                }
                Err(error) => {
                    let reason = if matches!(error, EffectError::Fatal(_)) {
                        "fatal"
                    } else {
                        "exhausted"
                    };
                    tracing::warn!(tenant_id = %event.tenant_id, external_id = %event.external_id, reason, %error, "dead-lettering");
                    decisions.dead.0.push(event.tenant_id.clone());
                    decisions.dead.1.push(event.external_id.clone());
                    decisions.dead.2.push(error.to_string());
                    decisions.dead.3.push(reason);
                }
            }
        }
        let (d, r, x) = (&decisions.done, &decisions.retry, &decisions.dead);
        let fixed = &decisions.repairs;
        event_queue::complete(&mut *tx, &d.0, &d.1, &d.2).await?;
        event_queue::dequeue(&mut *tx, &fixed.0, &fixed.1).await?;
        let (failed, repaired) = (&decisions.failed_repairs, &decisions.repaired);
        unrepaired_losses::record_failed_repairs(&mut *tx, &failed.0, &failed.1, &failed.2).await?;
        unrepaired_losses::clear(&mut *tx, &repaired.0, &repaired.1).await?;
        event_queue::retry_later(&mut *tx, &r.0, &r.1, &r.2, &r.3).await?;
        dead_letters::bury(&mut *tx, &x.0, &x.1, &x.2, &x.3).await?;
        let forwarded = subscriptions::fan_out(&mut tx, &done).await?;
        tx.commit().await?;

        let mut outcome = DrainOutcome {
            batches: 1,
            claimed: claimed.len() as u64,
            processed: d.0.len() as u64 + fixed.0.len() as u64 - decisions.repairs_failed,
            retried: r.0.len() as u64,
            dead_lettered: x.0.len() as u64,
            vacuums: 0,
            repairs: fixed.0.len() as u64 - decisions.repairs_failed,
            repairs_failed: decisions.repairs_failed,
            deferred,
            redone: 0,
            forwarded,
        };
        if self.vacuum_due(d.0.len() as u64 + fixed.0.len() as u64 + outcome.dead_lettered) {
            event_queue::vacuum(&mut *conn).await?;
            outcome.vacuums = 1;
        }
        Ok(outcome)
    }

    fn vacuum_due(&self, left: u64) -> bool {
        let total = self.left_since_vacuum.fetch_add(left, Ordering::Relaxed) + left;
        if total < self.settings.vacuum_after_rows {
            return false;
        }
        let mut last = self.last_vacuum.lock().expect("lock poisoned");
        if last.elapsed() < self.settings.vacuum_interval {
            return false;
        }
        *last = Instant::now();
        self.left_since_vacuum.store(0, Ordering::Relaxed);
        true
    }
}

/// How a batch applies its groups of effects.
#[derive(Clone, Copy)]
enum Isolation {
    /// Every group with no savepoint: one failure rolls back the batch.
    Whole,
    /// Each group under a savepoint, split on failure until each failing event stands alone.
    Savepoints,
}

/// Applies one handler's group of events with no savepoint of its own. `false` when the group
/// failed: the transaction then holds partial writes (or is aborted) and must be rolled back.
/// `Err` means the transaction itself is gone.
async fn apply_whole(
    conn: &mut sqlx::PgConnection,
    handler: &dyn EffectHandler,
    claimed: &[ClaimedEvent],
    members: Vec<usize>,
) -> Result<bool, StoreError> {
    let events: Vec<&ClaimedEvent> = members.iter().map(|&i| &claimed[i]).collect();
    match handler.apply_all(&mut *conn, &events).await {
        Ok(effects) if effects.len() == members.len() => {
            tracing::debug!(handler = handler.name(), events = members.len(), "applied");
            Ok(true)
        }
        Err(EffectError::Aborted(error)) => Err(error),
        Ok(_) | Err(_) => {
            tracing::debug!(
                handler = handler.name(),
                events = members.len(),
                "group failed as one unit: the batch is redone under savepoints"
            );
            Ok(false)
        }
    }
}

/// The batch's events by handler (`handlers[i]` is event i's), each group in claim order,
/// groups in order of their first event. Handlers touch disjoint state, so applying one group
/// before the next gives what applying the events one at a time would.
fn groups<'a>(handlers: &[&'a dyn EffectHandler]) -> Vec<(&'a dyn EffectHandler, Vec<usize>)> {
    let mut groups: Vec<(&dyn EffectHandler, Vec<usize>)> = Vec::new();
    for (i, &handler) in handlers.iter().enumerate() {
        match groups
            .iter_mut()
            .find(|(h, _)| std::ptr::addr_eq(*h, handler))
        {
            Some((_, members)) => members.push(i),
            None => groups.push((handler, vec![i])),
        }
    }
    groups
}

/// PostgreSQL caches the ids of 64 subtransactions per backend (`PGPROC_MAX_CACHED_SUBXIDS`);
/// while one transaction has more, every other session's visibility checks read `pg_subtrans`.
/// A batch keeps at most this many savepoints, counting the one being tried.
pub const MAX_SUBTRANSACTIONS: usize = 64;

/// Applies one handler's group of events under one savepoint. When that fails, rolls it back
/// and splits the group in halves, each tried the same way (left first, so claim order holds),
/// until each failing event stands alone with its own error: one poison event costs about
/// 2·log2(group) tries, and the rest of its batch still commits. `kept` counts the savepoints
/// that succeeded in this transaction; once [`MAX_SUBTRANSACTIONS`] are kept, what is left is
/// not tried (its verdicts stay `None`: the events stay queued, untouched, for another batch).
/// `Err` means the transaction itself is gone.
async fn apply_group(
    conn: &mut sqlx::PgConnection,
    handler: &dyn EffectHandler,
    claimed: &[ClaimedEvent],
    members: Vec<usize>,
    verdicts: &mut [Option<Result<Effect, EffectError>>],
    kept: &mut usize,
) -> Result<(), StoreError> {
    let mut parts = vec![members];
    while let Some(mut part) = parts.pop() {
        if *kept >= MAX_SUBTRANSACTIONS {
            break;
        }
        store::savepoint(&mut *conn).await?;
        let events: Vec<&ClaimedEvent> = part.iter().map(|&i| &claimed[i]).collect();
        let result = match handler.apply_all(&mut *conn, &events).await {
            Ok(effects) if effects.len() != part.len() => Err(EffectError::Fatal(format!(
                "handler {} returned {} effects for {} events",
                handler.name(),
                effects.len(),
                part.len()
            ))),
            other => other,
        };
        match result {
            Ok(effects) => {
                *kept += 1;
                tracing::debug!(handler = handler.name(), events = part.len(), "applied");
                for (i, effect) in part.into_iter().zip(effects) {
                    verdicts[i] = Some(Ok(effect));
                }
            }
            Err(EffectError::Aborted(error)) => return Err(error),
            Err(error) => {
                store::rollback_to_savepoint(&mut *conn).await?;
                if let [only] = part[..] {
                    verdicts[only] = Some(Err(error));
                } else {
                    tracing::debug!(handler = handler.name(), events = part.len(), %error, "group failed: splitting it");
                    let right = part.split_off(part.len() / 2);
                    parts.push(right);
                    parts.push(part);
                }
            }
        }
    }
    Ok(())
}

/// Applies one event's effect under a savepoint: rolled back to on failure, so the batch's
/// transaction stays usable and the event's partial writes vanish. A successful savepoint is
/// not released (that would be one more round trip per event); the batch's commit commits it.
/// `Aborted` means the transaction itself is gone.
async fn apply_under_savepoint(
    conn: &mut sqlx::PgConnection,
    registry: &EffectRegistry,
    event: &ClaimedEvent,
) -> Result<Effect, EffectError> {
    store::savepoint(&mut *conn)
        .await
        .map_err(EffectError::Aborted)?;
    let handler = registry.handler_for(event);
    match handler.apply(&mut *conn, event).await {
        Ok(effect) => {
            tracing::debug!(handler = handler.name(), external_id = %event.external_id, ?effect, "applied");
            Ok(effect)
        }
        Err(error) => {
            store::rollback_to_savepoint(&mut *conn)
                .await
                .map_err(EffectError::Aborted)?;
            Err(error)
        }
    }
}

/// What a replay did, counted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayOutcome {
    /// Open dead letters the filter matched.
    pub selected: u64,
    /// Processed this time: their letters are now `replayed`.
    pub replayed: u64,
    /// Failed again: their letters stay open with the new error.
    pub failed: u64,
    /// Taken by a concurrent replay, or closed meanwhile.
    pub skipped: u64,
}

/// Replays open dead letters through the normal processing path: the same registry, the same
/// handlers, one transaction per event. A success closes the letter as `replayed` and marks the
/// event processed; a failure keeps the letter open with the new error. Replayed letters are
/// not open, so replaying the same filter again selects nothing.
#[tracing::instrument(skip_all, err)]
pub async fn replay(
    pool: &PgPool,
    registry: &EffectRegistry,
    filter: &ReplayFilter,
) -> Result<ReplayOutcome, StoreError> {
    let letters = dead_letters::select_open(pool, filter).await?;
    replay_letters(pool, registry, &letters).await
}

/// Replays these letters, each in its own transaction; one that is no longer open (replayed or
/// discarded since it was selected) or that another replay holds is skipped.
pub async fn replay_letters(
    pool: &PgPool,
    registry: &EffectRegistry,
    letters: &[dead_letters::DeadLetter],
) -> Result<ReplayOutcome, StoreError> {
    let mut outcome = ReplayOutcome {
        selected: letters.len() as u64,
        ..ReplayOutcome::default()
    };
    for letter in letters {
        let mut tx = pool.begin().await?;
        let Some(event) = dead_letters::claim_for_replay(&mut tx, letter.dead_letter_id).await?
        else {
            outcome.skipped += 1;
            continue;
        };
        match apply_under_savepoint(&mut tx, registry, &event).await {
            Ok(_) => {
                let expects = registry.handler_for(&event).expects(&event);
                dead_letters::mark_replayed(&mut *tx, letter.dead_letter_id, expects.as_str())
                    .await?;
                subscriptions::fan_out(&mut tx, &[&event]).await?;
                outcome.replayed += 1;
            }
            Err(EffectError::Aborted(error)) => return Err(error),
            Err(error) => {
                dead_letters::record_failed_replay(
                    &mut *tx,
                    letter.dead_letter_id,
                    &error.to_string(),
                )
                .await?;
                outcome.failed += 1;
            }
        }
        tx.commit().await?;
    }
    tracing::info!(
        selected = outcome.selected,
        replayed = outcome.replayed,
        failed = outcome.failed,
        skipped = outcome.skipped,
        "replay finished"
    );
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_grow_to_the_cap_with_full_jitter() {
        let (base, cap) = (Duration::from_millis(100), Duration::from_secs(2));
        for attempt in 0..40 {
            let ceiling = Duration::from_millis(100 * (1u64 << attempt.min(30))).min(cap);
            for _ in 0..50 {
                assert!(retry_delay(attempt, base, cap) <= ceiling);
            }
        }
        // Full jitter: delays spread over the whole range, not just near the ceiling.
        let samples: Vec<_> = (0..400).map(|_| retry_delay(10, base, cap)).collect();
        assert!(samples.iter().any(|d| *d < Duration::from_millis(500)));
        assert!(samples.iter().any(|d| *d > Duration::from_millis(1500)));
    }

    #[test]
    fn settings_are_validated() {
        assert!(DrainSettings::default().validate().is_ok());
        assert!(
            DrainSettings {
                batch_size: 0,
                ..DrainSettings::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            DrainSettings {
                backoff_cap: Duration::from_millis(1),
                ..DrainSettings::default()
            }
            .validate()
            .is_err()
        );
    }
}
