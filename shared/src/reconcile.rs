//! Reconciliation: re-checks written vs processed vs effects, repairs what is safe through the
//! normal path, and records what it found. One pass at a time across all environments: the
//! pass holds a session-level advisory lock on one connection for its whole duration; a
//! trigger that finds it held records a `skipped` run and returns at once.
//!
//! The scan of `webhook_events` reads bounded chunks by primary key from a persisted cursor,
//! each its own short statement, so a pass over a large table holds no long lock and starves
//! no ingestion; a pass covers at most `max_chunks` chunks and the next pass continues.
//!
//! What it finds lost and cannot repair (payload purged, or a repair that failed) is kept in
//! `unrepaired_losses` until a later scan finds the event consistent, so the status verdict
//! sees every standing loss whichever part of the table the latest pass covered.

use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::PgPool;

use crate::drain::{DrainOutcome, Drainer};
use crate::maintenance::{self, Run, RunCounts};
use crate::store::{
    StoreError, maintenance_runs as runs, reconcile as checks, unrepaired_losses as losses,
};

/// Advisory lock key of the reconcile pass ("reconcil" in ASCII).
pub const RECONCILE_LOCK: i64 = 0x7265_636f_6e63_696c;

#[derive(Debug, Clone)]
pub struct ReconcileSettings {
    /// An event waiting longer than this is reported (and drained) as stuck.
    pub pending_sla: Duration,
    /// An outbox row undelivered longer than this is reported and made due.
    pub outbox_window: Duration,
    /// A dead letter still `new` after this long is reported.
    pub untriaged_after: Duration,
    pub chunk_size: i64,
    pub max_chunks: usize,
    /// How long the pass may drain what it re-queued.
    pub drain_for: Duration,
}

impl Default for ReconcileSettings {
    fn default() -> Self {
        Self {
            pending_sla: Duration::from_secs(15 * 60),
            outbox_window: Duration::from_secs(60 * 60),
            untriaged_after: Duration::from_secs(24 * 60 * 60),
            chunk_size: 2000,
            max_chunks: 50,
            drain_for: Duration::from_secs(20),
        }
    }
}

/// What a pass found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Found {
    pub events_scanned: u64,
    pub pending_past_sla: i64,
    pub orphaned_pending: u64,
    pub missing_effects: u64,
    pub missing_outbox: u64,
    /// Of the missing effects and outbox rows: events whose payload retention purged, so their
    /// handler cannot re-run. Reported, never re-queued.
    pub unrepairable: u64,
    pub outbox_undelivered_past_window: i64,
    pub outbox_failed: i64,
    pub dead_letters_untriaged: i64,
}

/// What a pass repaired.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Repaired {
    pub requeued: u64,
    /// What the re-queued events had lost (they add up to `requeued` unless an event changed
    /// while the pass ran). Every one is the symptom
    /// of a bug elsewhere: published as the `ReconcileRepairs` metric by `Kind`, and counted by
    /// the `reconcile_repairs_last_day` check, whose expected range is zero.
    pub requeued_by_kind: RepairsByKind,
    pub outbox_made_due: u64,
    pub drained: DrainOutcome,
}

/// The events a pass re-queued, by what they had lost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RepairsByKind {
    /// Pending events that had lost their queue row: nothing would ever have processed them.
    pub orphaned_pending: u64,
    /// Processed events whose projection was missing or older than the event.
    pub missing_effects: u64,
    /// Processed events whose announcement (an outbox row) was missing.
    pub missing_outbox: u64,
}

impl RepairsByKind {
    pub fn total(&self) -> u64 {
        self.orphaned_pending + self.missing_effects + self.missing_outbox
    }

    /// Each kind with its metric dimension value.
    pub fn kinds(&self) -> [(&'static str, u64); 3] {
        [
            ("orphaned_pending", self.orphaned_pending),
            ("missing_effect", self.missing_effects),
            ("missing_outbox", self.missing_outbox),
        ]
    }

    fn count(&mut self, problem: &str) {
        match problem {
            "orphaned_pending" => self.orphaned_pending += 1,
            "missing_effect" => self.missing_effects += 1,
            "missing_outbox" => self.missing_outbox += 1,
            _ => {}
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum ReconcileOutcome {
    /// Another pass held the lock.
    Skipped { run_id: i64 },
    Completed {
        run_id: i64,
        found: Found,
        repaired: Repaired,
    },
}

/// Runs one pass, or records `skipped` if one is running. `trigger` says why it ran
/// (`schedule`, `alarm:<name>`, `operator`).
#[tracing::instrument(skip(pool, drainer, settings), err)]
pub async fn run_once(
    pool: &PgPool,
    drainer: &Drainer,
    settings: &ReconcileSettings,
    trigger: &str,
) -> Result<ReconcileOutcome, StoreError> {
    let run = maintenance::locked(
        pool,
        "reconcile",
        trigger,
        RECONCILE_LOCK,
        |run_id| async move {
            let mut counts = Counts::default();
            let result = checks_and_repairs(pool, drainer, settings, run_id, &mut counts).await;
            (counts, result)
        },
    )
    .await?;
    Ok(match run {
        Run::Skipped { run_id } => ReconcileOutcome::Skipped { run_id },
        Run::Completed { run_id, counts } => {
            log_pass(run_id, &counts.found, &counts.repaired);
            ReconcileOutcome::Completed {
                run_id,
                found: counts.found,
                repaired: counts.repaired,
            }
        }
    })
}

/// Nothing at info when the pass found and repaired nothing; otherwise every count as a field.
fn log_pass(run_id: i64, f: &Found, r: &Repaired) {
    let quiet = f.pending_past_sla == 0
        && f.orphaned_pending == 0
        && f.missing_effects == 0
        && f.missing_outbox == 0
        && f.unrepairable == 0
        && f.outbox_undelivered_past_window == 0
        && f.outbox_failed == 0
        && f.dead_letters_untriaged == 0
        && r.requeued == 0
        && r.outbox_made_due == 0
        && r.drained.claimed == 0;
    if quiet {
        tracing::debug!(
            run_id,
            events_scanned = f.events_scanned,
            "reconcile pass: all consistent"
        );
        return;
    }
    tracing::info!(
        run_id,
        events_scanned = f.events_scanned,
        pending_past_sla = f.pending_past_sla,
        orphaned_pending = f.orphaned_pending,
        missing_effects = f.missing_effects,
        missing_outbox = f.missing_outbox,
        unrepairable = f.unrepairable,
        outbox_undelivered_past_window = f.outbox_undelivered_past_window,
        outbox_failed = f.outbox_failed,
        dead_letters_untriaged = f.dead_letters_untriaged,
        requeued = r.requeued,
        outbox_made_due = r.outbox_made_due,
        drained = r.drained.processed,
        "reconcile pass finished"
    );
}

#[derive(Default)]
struct Counts {
    found: Found,
    repaired: Repaired,
}

impl RunCounts for Counts {
    fn found(&self) -> serde_json::Value {
        maintenance::json(&self.found)
    }
    fn repaired(&self) -> serde_json::Value {
        maintenance::json(&self.repaired)
    }
}

async fn checks_and_repairs(
    pool: &PgPool,
    drainer: &Drainer,
    settings: &ReconcileSettings,
    run_id: i64,
    Counts { found, repaired }: &mut Counts,
) -> Result<(), StoreError> {
    found.pending_past_sla =
        checks::pending_past_sla(pool, settings.pending_sla.as_secs_f64()).await?;

    // The chunked scan: orphaned queue entries, missing or stale effects, missing outbox rows.
    let (mut tenant, mut id) = checks::cursor(pool).await?;
    let mut to_requeue: (Vec<String>, Vec<String>) = Default::default();
    let mut by_kind = RepairsByKind::default();
    for _ in 0..settings.max_chunks {
        let chunk = checks::scan_chunk(pool, &tenant, &id, settings.chunk_size).await?;
        found.events_scanned += chunk.len() as u64;
        let wrapped = (chunk.len() as i64) < settings.chunk_size;
        let after = (tenant.clone(), id.clone());
        if let Some(last) = chunk.last() {
            (tenant, id) = (last.tenant_id.clone(), last.external_id.clone());
        }
        // What this chunk finds lost (kept in `unrepaired_losses`), and the unrepairable part.
        let mut lost: (Vec<String>, Vec<String>) = Default::default();
        let mut purged: (Vec<String>, Vec<String>, Vec<String>) = Default::default();
        for event in chunk {
            match event.problem.as_deref() {
                Some("orphaned_pending") => found.orphaned_pending += 1,
                Some("missing_effect") => found.missing_effects += 1,
                Some("missing_outbox") => found.missing_outbox += 1,
                _ => continue,
            }
            lost.0.push(event.tenant_id.clone());
            lost.1.push(event.external_id.clone());
            if !event.has_payload {
                // Its handler cannot run again: re-queued, it would only fail. Reported, and
                // kept for the status verdict until the event is consistent again.
                found.unrepairable += 1;
                tracing::warn!(tenant_id = %event.tenant_id, external_id = %event.external_id, problem = event.problem.as_deref().unwrap_or(""), "reconcile found, payload purged: cannot repair");
                purged.0.push(event.tenant_id);
                purged.1.push(event.external_id);
                purged.2.push(event.problem.unwrap_or_default());
                continue;
            }
            tracing::warn!(tenant_id = %event.tenant_id, external_id = %event.external_id, problem = event.problem.as_deref().unwrap_or(""), "reconcile found");
            by_kind.count(event.problem.as_deref().unwrap_or_default());
            to_requeue.0.push(event.tenant_id);
            to_requeue.1.push(event.external_id);
        }
        // The losses recorded in the range this chunk covered stand only if it found them again.
        let through = (!wrapped).then_some((tenant.as_str(), id.as_str()));
        losses::clear_scanned(pool, (&after.0, &after.1), through, (&lost.0, &lost.1)).await?;
        losses::record_purged(pool, &purged.0, &purged.1, &purged.2).await?;
        if wrapped {
            // End of the table: the next pass starts again from the beginning.
            (tenant, id) = Default::default();
            break;
        }
    }
    checks::save_cursor(pool, &tenant, &id).await?;
    repaired.requeued = checks::requeue(pool, &to_requeue.0, &to_requeue.1).await?;
    repaired.requeued_by_kind = by_kind;
    // Published and recorded as soon as the repair is made, whatever happens to the rest of the
    // pass (its drain of what it re-queued may fail, or panic).
    crate::metrics::reconcile_repairs(&by_kind.kinds());
    if repaired.requeued > 0 {
        runs::record_repaired(pool, run_id, &maintenance::json(&*repaired)).await?;
    }

    let window = settings.outbox_window.as_secs_f64();
    (found.outbox_undelivered_past_window, found.outbox_failed) =
        checks::undelivered_outbox(pool, window).await?;
    repaired.outbox_made_due = checks::hurry_outbox(pool, window).await?;
    found.dead_letters_untriaged =
        checks::untriaged_dead_letters(pool, settings.untriaged_after.as_secs_f64()).await?;

    // Stuck, starved and re-queued events go through the normal path now.
    if found.pending_past_sla > 0 || repaired.requeued > 0 {
        repaired.drained = drainer
            .drain_until(Instant::now() + settings.drain_for)
            .await?;
    }
    Ok(())
}
