//! Operator actions, one JSON shape for every entry point: the `operator` Lambda, the local
//! runner's `POST /operator`, and `hookctl operator`.
//!
//! ```json
//! {"action": "replay", "filter": {"event_type": "payment_intent.succeeded", "error_contains": "timeout"},
//!  "actor": "alice", "reason": "the pricing service is back"}
//! {"action": "replay", "all": true, "actor": "alice", "reason": "every letter of the outage"}
//! {"action": "list_dead_letters", "filter": {"tenant_id": "acme"}}
//! {"action": "set_dead_letter_status", "dead_letter_id": 7, "status": "investigating",
//!  "actor": "alice", "reason": "looks like a schema change"}
//! {"action": "tombstone", "tenant_id": "acme", "source_id": "stripe-prod", "external_id": "evt_1",
//!  "reason": "test event deleted in the dashboard", "actor": "alice"}
//! {"action": "status"}
//! {"action": "show_dead_letter", "dead_letter_id": 7}
//! {"action": "list_runs", "job": "reconcile", "limit": 20}
//! {"action": "list_checks", "breached_only": true}
//! {"action": "list_gaps", "source_id": "stripe-prod"}
//! {"action": "list_tombstones", "source_id": "stripe-prod", "limit": 50}
//! {"action": "list_failed_outbox", "filter": {"action": "fulfil_order"}}
//! {"action": "list_sent_outbox", "tenant_id": "acme", "outbox_action": "entity.changed", "limit": 20}
//! {"action": "resend_outbox", "filter": {"error_contains": "503"}, "actor": "alice", "reason": "target fixed"}
//! {"action": "discard_outbox", "outbox_ids": [12, 13], "actor": "alice", "reason": "order cancelled"}
//! {"action": "list_actions", "limit": 20}
//! {"action": "file_kept", "anomaly_id": 7, "actor": "alice", "reason": "field map fixed"}
//! ```
//!
//! Every state change (replay, set_dead_letter_status, tombstone, resend_outbox, discard_outbox)
//! needs an `actor` and a `reason`, and is recorded in `operator_actions` with them and with how
//! the request came in ([`Invocation`]), in the change's own transaction. The actor is what the
//! caller says: hookctl fills it from `--actor`, else the OS user; the operator function also
//! records what Lambda said about the invocation (its request id, to look the caller up in
//! CloudTrail). A replay or resend with no filter refuses unless `all` is given.
//!
//! The read actions are what `hookctl` calls with `--function`: the deployed database sits in
//! private subnets, and this function is the operator's way in.

use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::buffer::BufferQueue;
use crate::drain::{self, ReplayOutcome};
use crate::effects::EffectRegistry;
use crate::sources::GapStrategy;
use crate::status::{self, StatusReport, StatusSettings};
use crate::store::StoreError;
use crate::store::anomaly::StoredResult;
use crate::store::dead_letters::{self, DeadLetter, DeadLetterDetail, ReplayFilter};
use crate::store::gaps::{OpenGap, Tombstone};
use crate::store::maintenance_runs::RunRecord;
use crate::store::operator_actions::{self, NewAction, RecordedAction};
use crate::store::outbox::{self, FailedFilter, FailedMessage};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "action", rename_all = "snake_case", deny_unknown_fields)]
pub enum OperatorRequest {
    /// Replay open dead letters matching the filter through the normal processing path. An
    /// empty filter needs `all`.
    Replay {
        #[serde(default)]
        filter: ReplayFilter,
        #[serde(default)]
        all: bool,
        #[serde(default)]
        actor: Option<String>,
        #[serde(default)]
        reason: Option<String>,
    },
    /// List open dead letters matching the filter.
    ListDeadLetters {
        #[serde(default)]
        filter: ReplayFilter,
    },
    /// Triage: `investigating` or `discarded`.
    SetDeadLetterStatus {
        dead_letter_id: i64,
        status: String,
        #[serde(default)]
        actor: Option<String>,
        #[serde(default)]
        reason: Option<String>,
    },
    /// Declares an event ID that will never arrive: gap detection stops flagging it. On a
    /// source whose gaps are found by sequence, the sequence is read from the ID with the
    /// source's id template (a given one must agree).
    Tombstone {
        tenant_id: String,
        source_id: String,
        external_id: String,
        #[serde(default)]
        sequence: Option<i64>,
        #[serde(default)]
        reason: Option<String>,
        /// Recorded as `operator:<actor>` on the tombstone (`operator` is the older name).
        #[serde(default, alias = "operator")]
        actor: Option<String>,
    },
    /// Asks for an open gap to be fetched from the provider by the next backfill pass, without
    /// waiting out its source's grace period (the console's "Backfill now").
    BackfillGap {
        tenant_id: String,
        source_id: String,
        external_id: String,
        #[serde(default)]
        reason: Option<String>,
        #[serde(default)]
        actor: Option<String>,
    },
    /// The verdict (every event accounted for, or what is not) and its evidence.
    Status,
    /// One dead letter, whatever its status, with its headers (less the signatures) and payload.
    ShowDeadLetter { dead_letter_id: i64 },
    /// The latest maintenance runs, newest first.
    ListRuns {
        #[serde(default)]
        job: Option<String>,
        #[serde(default)]
        limit: Option<i64>,
    },
    /// The latest anomaly run's results, breaching first.
    ListChecks {
        #[serde(default)]
        breached_only: bool,
    },
    /// Open gaps, oldest first.
    ListGaps {
        #[serde(default)]
        source_id: Option<String>,
        #[serde(default)]
        limit: Option<i64>,
    },
    /// Tombstones, newest first.
    ListTombstones {
        #[serde(default)]
        source_id: Option<String>,
        #[serde(default)]
        limit: Option<i64>,
    },
    /// Outbox messages that failed for good matching the filter, oldest first.
    ListFailedOutbox {
        #[serde(default)]
        filter: FailedFilter,
    },
    /// The latest delivered outbox messages and where each went (issue 24), newest first.
    ListSentOutbox {
        #[serde(default)]
        tenant_id: Option<String>,
        /// The messages' action (`entity.changed`...): `action` names the request.
        #[serde(default)]
        outbox_action: Option<String>,
        #[serde(default)]
        limit: Option<i64>,
    },
    /// Sends the failed messages matching the filter again (once the target is fixed): due at
    /// once, a fresh attempt budget, the same Idempotency-Key. An empty filter needs `all`.
    ResendOutbox {
        #[serde(default)]
        filter: FailedFilter,
        #[serde(default)]
        all: bool,
        #[serde(default)]
        actor: Option<String>,
        #[serde(default)]
        reason: Option<String>,
    },
    /// Closes failed messages whose effect is not wanted.
    DiscardOutbox {
        outbox_ids: Vec<i64>,
        #[serde(default)]
        actor: Option<String>,
        #[serde(default)]
        reason: Option<String>,
    },
    /// The buffer's dead letters (deliveries the consumer failed on repeatedly: NOT accounted
    /// for), oldest first; never a body or a header's value. They stay where they are.
    ListBufferDeadLetters {
        #[serde(default)]
        limit: Option<usize>,
    },
    /// Sends the buffer's dead letters back to the buffer, each deleted from the dead-letter
    /// queue only after SQS took it back; a message that is not a buffered delivery stays.
    RedriveBuffer {
        #[serde(default)]
        limit: Option<usize>,
        #[serde(default)]
        actor: Option<String>,
        #[serde(default)]
        reason: Option<String>,
    },
    /// Files the delivery an ingest anomaly kept with its payload (a buffered delivery the
    /// consumer could not read, one ingest answered 400 for, or one an earlier release kept when
    /// its source was disabled), once its source can read it: the event is stored as ingest
    /// would have, and the anomaly marked filed.
    FileKept {
        anomaly_id: i64,
        #[serde(default)]
        actor: Option<String>,
        #[serde(default)]
        reason: Option<String>,
    },
    /// Every subscription with its undelivered and failed counts, its oldest undelivered age,
    /// and whether it is paused.
    ListSubscriptions,
    /// Pauses a subscription: its messages wait, parked, until it is resumed; none is dropped.
    PauseSubscription {
        tenant_id: String,
        subscription: String,
        #[serde(default)]
        actor: Option<String>,
        #[serde(default)]
        reason: Option<String>,
    },
    /// Resumes a paused subscription (an operator's pause or a 410 Gone's): its parked
    /// messages are due at once.
    ResumeSubscription {
        tenant_id: String,
        subscription: String,
        #[serde(default)]
        actor: Option<String>,
        #[serde(default)]
        reason: Option<String>,
    },
    /// Sends stored events of a range to one subscription again (or for the first time), as a
    /// resumable job: runs for up to `seconds` (default 10, at most 600) and answers where it
    /// stands; asked again with the same range, it resumes.
    ReplayToSubscription {
        #[serde(flatten)]
        replay: crate::subscriptions::replay::ReplayRequest,
        #[serde(default)]
        seconds: Option<u64>,
        #[serde(default)]
        actor: Option<String>,
        #[serde(default)]
        reason: Option<String>,
    },
    /// One stored event: what it is, where it stands, and its data (the envelope's `data`) unless
    /// retention purged it. What a subscriber calls for an envelope sent without its data.
    ShowEvent {
        tenant_id: String,
        external_id: String,
    },
    /// The latest recorded state changes, newest first: who asked, why, what they touched.
    ListActions {
        #[serde(default)]
        limit: Option<i64>,
    },
    /// What became of one event: how it was filed, its place in the queue, its outbox messages
    /// and where each went, its dead letters and replays, the anomalies it raised (the
    /// console's event page, beside `show_event`).
    EventHistory {
        tenant_id: String,
        external_id: String,
    },
    /// Deliveries of known sources refused before anything was stored, newest first, with
    /// what the last day's add up to per source and check (`hookctl refused`).
    ListRefused {
        #[serde(default)]
        source_id: Option<String>,
        #[serde(default)]
        limit: Option<i64>,
    },
    /// How many open dead letters a job over this filter would take now: its estimate.
    EstimateJob {
        kind: JobKind,
        #[serde(default)]
        filter: ReplayFilter,
    },
    /// Starts a job over every open dead letter the filter matches (at most its `limit`, when
    /// it gives one): replay them all, or discard them all. An empty filter needs `all`.
    /// Answers the job with its estimate; `run_job` runs it.
    StartJob {
        kind: JobKind,
        #[serde(default)]
        filter: ReplayFilter,
        #[serde(default)]
        all: bool,
        #[serde(default)]
        actor: Option<String>,
        #[serde(default)]
        reason: Option<String>,
    },
    /// Runs a job for up to `seconds` (10 by default, at most 60) in steps of 50 letters, its
    /// counts and cursor stored after each; an abort is seen between steps. Answers the job as
    /// it stands: asked again, it resumes where it stopped.
    RunJob {
        job_id: i64,
        #[serde(default)]
        seconds: Option<u64>,
    },
    /// Stops a running job at its next step.
    AbortJob {
        job_id: i64,
        #[serde(default)]
        actor: Option<String>,
        #[serde(default)]
        reason: Option<String>,
    },
    /// One job: its estimate, progress and status.
    ShowJob { job_id: i64 },
    /// The newest jobs first.
    ListJobs {
        #[serde(default)]
        limit: Option<i64>,
    },
    /// One check's results over its latest anomaly runs, newest first (the console's chart).
    CheckHistory {
        check_name: String,
        /// The source of a per-source check; empty for a global one.
        #[serde(default)]
        subject: String,
        /// 48 when not given.
        #[serde(default)]
        runs: Option<i64>,
    },
    /// Every source's last hours against the same hours of the four weeks before (the
    /// console's overview chart), as fresh as the last anomaly run.
    SourceHours {
        /// 24 when not given; at most a week.
        #[serde(default)]
        hours: Option<i64>,
    },
    /// Stored events matching a search, newest first, a page at a time (the console's events).
    ListEvents {
        #[serde(default)]
        search: crate::store::webhook_events::EventSearch,
        /// At most 500; 100 when not given.
        #[serde(default)]
        limit: Option<i64>,
    },
}

/// What a job does to each dead letter it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JobKind {
    /// Processed again through the normal path, as `replay` does.
    ReplayDeadLetters,
    /// Closed without processing.
    DiscardDeadLetters,
}

impl JobKind {
    pub fn as_str(self) -> &'static str {
        match self {
            JobKind::ReplayDeadLetters => "replay_dead_letters",
            JobKind::DiscardDeadLetters => "discard_dead_letters",
        }
    }

    /// The operator action that records a job of this kind.
    fn action(self) -> &'static str {
        match self {
            JobKind::ReplayDeadLetters => "replay",
            JobKind::DiscardDeadLetters => "discard_dead_letters",
        }
    }
}

/// Letters a job takes in one step.
const JOB_STEP: i64 = 50;
/// The longest `run_job` runs, whatever it is asked: under the operator function's timeout
/// (tests/deployment.rs holds the two together), so a step answers before Lambda ends it.
pub const MAX_JOB_SECONDS: u64 = 60;

/// How often the backfill pass runs in AWS (the backfill function's schedule in template.yaml):
/// a gap asked to be backfilled now is fetched within this long.
pub const BACKFILL_PASS_SECONDS: u64 = 300;

impl OperatorRequest {
    /// Whether the request changes state (and so carries an actor and a reason, recorded in
    /// `operator_actions`), rather than only reading. The console answers these only when
    /// started with `--write`. Every request is named: a new one must say which it is.
    pub fn changes_state(&self) -> bool {
        match self {
            OperatorRequest::Replay { .. }
            | OperatorRequest::SetDeadLetterStatus { .. }
            | OperatorRequest::Tombstone { .. }
            | OperatorRequest::BackfillGap { .. }
            | OperatorRequest::ResendOutbox { .. }
            | OperatorRequest::DiscardOutbox { .. }
            | OperatorRequest::RedriveBuffer { .. }
            | OperatorRequest::FileKept { .. }
            | OperatorRequest::PauseSubscription { .. }
            | OperatorRequest::ResumeSubscription { .. }
            | OperatorRequest::ReplayToSubscription { .. }
            | OperatorRequest::StartJob { .. }
            | OperatorRequest::RunJob { .. }
            | OperatorRequest::AbortJob { .. } => true,
            OperatorRequest::ListDeadLetters { .. }
            | OperatorRequest::Status
            | OperatorRequest::ShowDeadLetter { .. }
            | OperatorRequest::ListRuns { .. }
            | OperatorRequest::ListChecks { .. }
            | OperatorRequest::ListGaps { .. }
            | OperatorRequest::ListTombstones { .. }
            | OperatorRequest::ListFailedOutbox { .. }
            | OperatorRequest::ListSentOutbox { .. }
            | OperatorRequest::ListBufferDeadLetters { .. }
            | OperatorRequest::ListSubscriptions
            | OperatorRequest::ShowEvent { .. }
            | OperatorRequest::ListActions { .. }
            | OperatorRequest::EventHistory { .. }
            | OperatorRequest::ListRefused { .. }
            | OperatorRequest::SourceHours { .. }
            | OperatorRequest::CheckHistory { .. }
            | OperatorRequest::EstimateJob { .. }
            | OperatorRequest::ShowJob { .. }
            | OperatorRequest::ListJobs { .. }
            | OperatorRequest::ListEvents { .. } => false,
        }
    }
}

/// How a request came in: recorded with every state change it makes.
#[derive(Debug, Clone)]
pub struct Invocation {
    pub via: Via,
    /// What the runtime says about the caller (for the operator function: the Lambda request
    /// id and function ARN, and a Cognito identity when there is one); `{}` otherwise.
    pub context: serde_json::Value,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// hookctl against DATABASE_URL.
    Hookctl,
    /// The operator Lambda.
    Function,
    /// The local runner's `POST /operator`.
    LocalRunner,
    /// A program calling [`handle`] itself.
    Direct,
}

impl Via {
    pub fn as_str(self) -> &'static str {
        match self {
            Via::Hookctl => "hookctl",
            Via::Function => "function",
            Via::LocalRunner => "local_runner",
            Via::Direct => "direct",
        }
    }
}

impl Invocation {
    /// A request with nothing known about it but the way it came.
    pub fn via(via: Via) -> Self {
        Invocation {
            via,
            context: serde_json::json!({}),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("invalid request: {0}")]
    BadRequest(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The buffer's SQS queues could not answer (or none is configured).
    #[error("the buffer: {0}")]
    Buffer(#[from] crate::buffer::QueueError),
}

/// The answer, as JSON: each shape has its own top-level keys, so a caller that knows what it
/// asked for reads it back with the matching type.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum OperatorResponse {
    Replay(ReplayOutcome),
    DeadLetters {
        dead_letters: Vec<DeadLetter>,
    },
    StatusChanged {
        dead_letter_id: i64,
        status: String,
    },
    Tombstoned {
        external_id: String,
        created: bool,
    },
    /// The gap will be fetched by the next backfill pass.
    BackfillRequested {
        external_id: String,
        next_pass_within_seconds: u64,
    },
    Status(Box<StatusReport>),
    DeadLetter {
        dead_letter: Box<DeadLetterDetail>,
    },
    Runs {
        runs: Vec<RunRecord>,
    },
    Checks {
        checks: Vec<StoredResult>,
    },
    Gaps {
        gaps: Vec<OpenGap>,
    },
    Tombstones {
        tombstones: Vec<Tombstone>,
    },
    FailedOutbox {
        failed_outbox: Vec<FailedMessage>,
    },
    SentOutbox {
        sent_outbox: Vec<crate::store::outbox::SentMessage>,
    },
    Resent {
        resent: Vec<i64>,
    },
    Actions {
        actions: Vec<RecordedAction>,
    },
    BufferDeadLetters {
        buffer_dead_letters: Vec<crate::buffer::accounting::DeadLetter>,
    },
    BufferRedriven {
        action_id: i64,
        redriven: crate::buffer::accounting::Redriven,
    },
    KeptFiled {
        filed_kept: crate::buffer::filing::FiledKept,
    },
    Subscriptions {
        subscriptions: Vec<crate::store::subscriptions::Undelivered>,
    },
    SubscriptionPaused {
        tenant_id: String,
        subscription: String,
        /// False: it was paused already (the first pause's record stands).
        newly: bool,
    },
    SubscriptionResumed {
        tenant_id: String,
        subscription: String,
        /// The pause lifted (none: it was not paused).
        lifted: Option<crate::store::subscriptions::Pause>,
        /// Parked messages made due.
        due: u64,
    },
    Replayed {
        replay: crate::subscriptions::replay::ReplayProgress,
    },
    History {
        history: Box<crate::store::event_history::EventHistory>,
    },
    SourceHours {
        source_hours: Vec<crate::store::delivery_hours::SourceHour>,
    },
    Estimate {
        estimate: i64,
    },
    CheckHistory {
        check_history: Vec<StoredResult>,
    },
    Job {
        job: Box<crate::store::operator_jobs::Job>,
    },
    Jobs {
        jobs: Vec<crate::store::operator_jobs::Job>,
    },
    Refused {
        refused: Vec<crate::store::refused_deliveries::Refusal>,
        /// The last day's refusals, per source and check.
        last_day: Vec<crate::store::refused_deliveries::SourceRefusals>,
    },
    Events {
        events: Vec<crate::store::webhook_events::ListedEvent>,
        /// The next page's `search.after`, when this page was full.
        next: Option<crate::store::webhook_events::EventCursor>,
    },
    Event {
        event: Box<crate::store::webhook_events::StoredEvent>,
        /// JSON, or a form's fields, as the envelope carries it.
        data: Option<serde_json::Value>,
        /// Anything else, base64.
        data_base64: Option<String>,
        /// Retention purged the payload.
        purged: bool,
    },
    OutboxDiscarded {
        discarded: Vec<i64>,
        /// Asked for but not failed (pending, delivered, already discarded, or no such id):
        /// left as they were.
        not_failed: Vec<i64>,
    },
}

/// Limits of the listing actions.
const DEFAULT_LIMIT: i64 = 100;
/// The most events one page of `ListEvents` holds.
const MAX_EVENTS_LISTED: i64 = 500;
/// Longest actor and reason recorded.
const MAX_ACTOR_CHARS: usize = 200;
const MAX_REASON_CHARS: usize = 2000;

/// Who asked for a state change and why, checked: both given, not blank, not unbounded.
struct Asked<'a> {
    action: &'static str,
    actor: &'a str,
    reason: &'a str,
}

fn asked<'a>(
    action: &'static str,
    actor: &'a Option<String>,
    reason: &'a Option<String>,
) -> Result<Asked<'a>, OperatorError> {
    let actor = actor.as_deref().map(str::trim).unwrap_or_default();
    let reason = reason.as_deref().map(str::trim).unwrap_or_default();
    if actor.is_empty() {
        return Err(OperatorError::BadRequest(format!(
            "{action} needs the actor who asks for it (\"actor\"; hookctl sends --actor, else the OS user)"
        )));
    }
    if reason.is_empty() {
        return Err(OperatorError::BadRequest(format!(
            "{action} needs a reason (\"reason\"; hookctl --reason)"
        )));
    }
    if actor.chars().count() > MAX_ACTOR_CHARS || reason.chars().count() > MAX_REASON_CHARS {
        return Err(OperatorError::BadRequest(format!(
            "{action}: the actor is at most {MAX_ACTOR_CHARS} characters, the reason at most {MAX_REASON_CHARS}"
        )));
    }
    Ok(Asked {
        action,
        actor,
        reason,
    })
}

impl Asked<'_> {
    fn record<'r>(
        &'r self,
        invocation: &'r Invocation,
        request: &'r serde_json::Value,
        affected: &'r serde_json::Value,
        outcome: Option<&'r serde_json::Value>,
        finished: bool,
    ) -> NewAction<'r> {
        NewAction {
            action: self.action,
            actor: self.actor,
            reason: self.reason,
            via: invocation.via.as_str(),
            invocation: &invocation.context,
            request,
            affected,
            outcome,
            finished,
        }
    }
}

/// An empty filter acts on everything: only when the caller says `all`.
fn bounded(action: &str, everything: &str, empty: bool, all: bool) -> Result<(), OperatorError> {
    if empty && !all {
        return Err(OperatorError::BadRequest(format!(
            "{action} with no filter would act on {everything}: narrow the filter, or say so with \"all\": true (hookctl --all)"
        )));
    }
    Ok(())
}

/// A job's counts, as its operator action records them: a replay's under the names a
/// `replay` request's outcome has (`selected`, `replayed`, `failed`, `skipped`), a discard's
/// `discarded`, with the job's id, status and estimate.
fn job_counts(job: &crate::store::operator_jobs::Job) -> serde_json::Value {
    let done = if job.kind == JobKind::DiscardDeadLetters.as_str() {
        "discarded"
    } else {
        "replayed"
    };
    serde_json::json!({
        "job_id": job.job_id, "status": job.status, "estimate": job.estimate,
        "selected": job.done + job.failed + job.skipped, done: job.done,
        "failed": job.failed, "skipped": job.skipped,
    })
}

/// Runs a job for up to `seconds`: steps of [`JOB_STEP`] letters in id order from its cursor,
/// each step's counts and cursor stored as it ends; it ends `finished` when no letter is left,
/// and stops early when an abort ended it. A job not running is answered as it is.
async fn run_job(
    pool: &PgPool,
    registry: &EffectRegistry,
    job_id: i64,
    seconds: u64,
) -> Result<crate::store::operator_jobs::Job, OperatorError> {
    use crate::store::operator_jobs;
    let mut job = operator_jobs::get(pool, job_id)
        .await?
        .ok_or_else(|| OperatorError::BadRequest(format!("no job {job_id}")))?;
    let filter: ReplayFilter = serde_json::from_value(job.filter.clone())
        .map_err(|e| OperatorError::BadRequest(format!("job {job_id}'s filter: {e}")))?;
    let kind: JobKind = serde_json::from_value(serde_json::Value::String(job.kind.clone()))
        .map_err(|e| OperatorError::BadRequest(format!("job {job_id}'s kind: {e}")))?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
    while job.status == "running" {
        // A filter's limit caps the letters the job takes.
        let taken = job.done + job.failed + job.skipped;
        let step = filter
            .limit
            .map_or(JOB_STEP, |limit| JOB_STEP.min(limit - taken).max(0));
        let letters = if step == 0 {
            Vec::new()
        } else {
            dead_letters::select_open_after(pool, &filter, job.after_id, step).await?
        };
        let Some(last) = letters.last().map(|l| l.dead_letter_id) else {
            if let Some(ended) = operator_jobs::end(pool, job_id, "finished").await? {
                operator_actions::finish(pool, ended.action_id, &job_counts(&ended)).await?;
                job = ended;
            }
            break;
        };
        // The job's record names every letter it takes, before acting on it.
        let ids: Vec<i64> = letters.iter().map(|l| l.dead_letter_id).collect();
        operator_actions::add_affected(pool, job.action_id, &to_json(&ids)).await?;
        let (done, failed, skipped) = match kind {
            JobKind::ReplayDeadLetters => {
                let outcome = drain::replay_letters(pool, registry, &letters).await?;
                (outcome.replayed, outcome.failed, outcome.skipped)
            }
            JobKind::DiscardDeadLetters => {
                let discarded = dead_letters::discard_open(pool, &ids).await?;
                (discarded, 0, ids.len() as u64 - discarded)
            }
        };
        let as_i64 = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        job = operator_jobs::advance(
            pool,
            job_id,
            as_i64(done),
            as_i64(failed),
            as_i64(skipped),
            last,
        )
        .await?
        .unwrap_or(job);
        if std::time::Instant::now() >= deadline {
            break;
        }
    }
    Ok(job)
}

fn to_json<T: Serialize>(value: &T) -> serde_json::Value {
    serde_json::to_value(value).unwrap_or_default()
}

/// Parses a request from JSON, saying what is wrong with it when it does not parse.
pub fn parse(json: serde_json::Value) -> Result<OperatorRequest, OperatorError> {
    serde_json::from_value(json).map_err(|e| OperatorError::BadRequest(e.to_string()))
}

/// Answers a request from a program that calls it itself (recorded as `direct`).
pub async fn handle(
    pool: &PgPool,
    registry: &EffectRegistry,
    request: OperatorRequest,
) -> Result<OperatorResponse, OperatorError> {
    handle_invoked(pool, registry, None, request, &Invocation::via(Via::Direct)).await
}

/// Answers a request that came in as `invocation` says; a state change is recorded with it.
#[tracing::instrument(skip_all, err)]
pub async fn handle_invoked(
    pool: &PgPool,
    registry: &EffectRegistry,
    buffer: Option<&BufferQueue>,
    request: OperatorRequest,
    invocation: &Invocation,
) -> Result<OperatorResponse, OperatorError> {
    let buffer_queue = || {
        buffer.ok_or_else(|| {
            OperatorError::BadRequest(
                "no buffer is configured here (BUFFER_QUEUE_URL, BUFFER_DEAD_LETTER_QUEUE_URL)"
                    .into(),
            )
        })
    };
    match request {
        OperatorRequest::ListBufferDeadLetters { limit } => {
            Ok(OperatorResponse::BufferDeadLetters {
                buffer_dead_letters: buffer_queue()?
                    .list_dead_letters(limit.unwrap_or(DEFAULT_LIMIT as usize))
                    .await?,
            })
        }
        OperatorRequest::RedriveBuffer {
            limit,
            actor,
            reason,
        } => {
            let asked = asked("redrive_buffer", &actor, &reason)?;
            let queue = buffer_queue()?;
            let limit = limit.unwrap_or(DEFAULT_LIMIT as usize);
            // Recorded first and finished with the counts: the messages move one by one.
            let request = serde_json::json!({"limit": limit});
            let action_id = operator_actions::record(
                pool,
                &asked.record(invocation, &request, &serde_json::json!([]), None, false),
            )
            .await?;
            let redriven = queue.redrive(limit).await?;
            operator_actions::finish(pool, action_id, &to_json(&redriven)).await?;
            tracing::info!(
                action_id,
                actor = asked.actor,
                "buffer dead letters re-driven"
            );
            Ok(OperatorResponse::BufferRedriven {
                action_id,
                redriven,
            })
        }
        OperatorRequest::Replay {
            filter,
            all,
            actor,
            reason,
        } => {
            let asked = asked("replay", &actor, &reason)?;
            bounded("replay", "every open dead letter", filter.is_empty(), all)?;
            let letters = dead_letters::select_open(pool, &filter).await?;
            let ids: Vec<i64> = letters.iter().map(|l| l.dead_letter_id).collect();
            // Each letter commits on its own: the action is recorded before the first, and
            // finished with the counts after the last (unfinished: it stopped part-way).
            let request = serde_json::json!({"filter": filter, "all": all});
            let affected = to_json(&ids);
            let action_id = operator_actions::record(
                pool,
                &asked.record(invocation, &request, &affected, None, false),
            )
            .await?;
            let outcome = drain::replay_letters(pool, registry, &letters).await?;
            operator_actions::finish(pool, action_id, &to_json(&outcome)).await?;
            tracing::info!(
                action_id,
                actor = asked.actor,
                selected = outcome.selected,
                "replay recorded"
            );
            Ok(OperatorResponse::Replay(outcome))
        }
        OperatorRequest::ListDeadLetters { filter } => {
            let dead_letters = dead_letters::select_open(pool, &filter).await?;
            Ok(OperatorResponse::DeadLetters { dead_letters })
        }
        OperatorRequest::SetDeadLetterStatus {
            dead_letter_id,
            status,
            actor,
            reason,
        } => {
            if !matches!(status.as_str(), "investigating" | "discarded") {
                return Err(OperatorError::BadRequest(format!(
                    "status {status:?}: an operator sets investigating or discarded; replayed is set by a successful replay"
                )));
            }
            let asked = asked("set_dead_letter_status", &actor, &reason)?;
            let mut tx = pool.begin().await.map_err(StoreError::from)?;
            if !dead_letters::set_status(&mut *tx, dead_letter_id, &status).await? {
                return Err(OperatorError::BadRequest(format!(
                    "dead letter {dead_letter_id} is not open"
                )));
            }
            let request = serde_json::json!({"dead_letter_id": dead_letter_id, "status": status});
            let affected = serde_json::json!([dead_letter_id]);
            operator_actions::record(
                &mut *tx,
                &asked.record(invocation, &request, &affected, None, true),
            )
            .await?;
            tx.commit().await.map_err(StoreError::from)?;
            Ok(OperatorResponse::StatusChanged {
                dead_letter_id,
                status,
            })
        }
        OperatorRequest::Tombstone {
            tenant_id,
            source_id,
            external_id,
            sequence,
            reason,
            actor,
        } => {
            let asked = asked("tombstone", &actor, &reason)?;
            let sequence =
                tombstone_sequence(pool, &tenant_id, &source_id, &external_id, sequence).await?;
            let by = format!("operator:{}", asked.actor);
            let mut tx = pool.begin().await.map_err(StoreError::from)?;
            let created = crate::store::gaps::tombstone(
                &mut *tx,
                &tenant_id,
                &source_id,
                &external_id,
                sequence,
                asked.reason,
                &by,
            )
            .await?;
            let request = serde_json::json!({
                "tenant_id": tenant_id, "source_id": source_id, "external_id": external_id,
                "sequence": sequence,
            });
            let affected = if created {
                serde_json::json!([external_id])
            } else {
                serde_json::json!([])
            };
            operator_actions::record(
                &mut *tx,
                &asked.record(invocation, &request, &affected, None, true),
            )
            .await?;
            tx.commit().await.map_err(StoreError::from)?;
            Ok(OperatorResponse::Tombstoned {
                external_id,
                created,
            })
        }
        OperatorRequest::BackfillGap {
            tenant_id,
            source_id,
            external_id,
            reason,
            actor,
        } => {
            let asked = asked("backfill_gap", &actor, &reason)?;
            let mut tx = pool.begin().await.map_err(StoreError::from)?;
            let open = crate::store::gaps::request_backfill(
                &mut *tx,
                &tenant_id,
                &source_id,
                &external_id,
            )
            .await?;
            match open {
                crate::store::gaps::BackfillAsk::Requested => {}
                crate::store::gaps::BackfillAsk::NotOpen => {
                    return Err(OperatorError::BadRequest(format!(
                        "no open gap {external_id} of source {source_id} (tenant {tenant_id}): it arrived, was backfilled or tombstoned"
                    )));
                }
                crate::store::gaps::BackfillAsk::NoProviderApi => {
                    return Err(OperatorError::BadRequest(format!(
                        "source {source_id} has no provider API to fetch gap {external_id} from \
                         (its [source.gaps] names no api_base_url): re-read what the provider \
                         holds, then tombstone the number (hookctl tombstones add)"
                    )));
                }
            }
            let request = serde_json::json!({
                "tenant_id": tenant_id, "source_id": source_id, "external_id": external_id,
            });
            operator_actions::record(
                &mut *tx,
                &asked.record(
                    invocation,
                    &request,
                    &serde_json::json!([external_id]),
                    None,
                    true,
                ),
            )
            .await?;
            tx.commit().await.map_err(StoreError::from)?;
            Ok(OperatorResponse::BackfillRequested {
                external_id,
                next_pass_within_seconds: BACKFILL_PASS_SECONDS,
            })
        }
        OperatorRequest::Status => {
            let settings = StatusSettings::default();
            let report = status::report(pool, &settings).await?;
            let report = match buffer {
                Some(queue) => report.with_buffer(queue.read().await, &settings),
                None => report,
            };
            Ok(OperatorResponse::Status(Box::new(report)))
        }
        OperatorRequest::ShowDeadLetter { dead_letter_id } => {
            match dead_letters::find(pool, dead_letter_id).await? {
                Some(dead_letter) => Ok(OperatorResponse::DeadLetter {
                    dead_letter: Box::new(dead_letter),
                }),
                None => Err(OperatorError::BadRequest(format!(
                    "no dead letter {dead_letter_id}"
                ))),
            }
        }
        OperatorRequest::ListRuns { job, limit } => {
            if let Some(job) = job.as_deref()
                && !crate::store::maintenance_runs::JOBS.contains(&job)
            {
                return Err(OperatorError::BadRequest(format!(
                    "job {job:?}: one of {}",
                    crate::store::maintenance_runs::JOBS.join(", ")
                )));
            }
            let runs = crate::store::maintenance_runs::list(
                pool,
                job.as_deref(),
                limit.unwrap_or(DEFAULT_LIMIT),
            )
            .await?;
            Ok(OperatorResponse::Runs { runs })
        }
        OperatorRequest::ListChecks { breached_only } => {
            let mut checks = crate::store::anomaly::latest_results(pool).await?;
            if breached_only {
                checks.retain(|c| c.breached);
            }
            Ok(OperatorResponse::Checks { checks })
        }
        OperatorRequest::ListGaps { source_id, limit } => {
            let gaps = crate::store::gaps::open_gaps(
                pool,
                source_id.as_deref(),
                limit.unwrap_or(DEFAULT_LIMIT),
            )
            .await?;
            Ok(OperatorResponse::Gaps { gaps })
        }
        OperatorRequest::ListTombstones { source_id, limit } => {
            let tombstones = crate::store::gaps::list_tombstones(
                pool,
                source_id.as_deref(),
                limit.unwrap_or(DEFAULT_LIMIT),
            )
            .await?;
            Ok(OperatorResponse::Tombstones { tombstones })
        }
        OperatorRequest::ListFailedOutbox { filter } => Ok(OperatorResponse::FailedOutbox {
            failed_outbox: outbox::select_failed(pool, &filter).await?,
        }),
        OperatorRequest::ListSentOutbox {
            tenant_id,
            outbox_action,
            limit,
        } => Ok(OperatorResponse::SentOutbox {
            sent_outbox: outbox::select_sent(
                pool,
                tenant_id.as_deref(),
                outbox_action.as_deref(),
                limit.unwrap_or(DEFAULT_LIMIT),
            )
            .await?,
        }),
        OperatorRequest::ResendOutbox {
            filter,
            all,
            actor,
            reason,
        } => {
            let asked = asked("resend_outbox", &actor, &reason)?;
            bounded(
                "resend_outbox",
                "every failed outbox message",
                filter.is_empty(),
                all,
            )?;
            let mut tx = pool.begin().await.map_err(StoreError::from)?;
            let resent = outbox::resend_failed(&mut *tx, &filter).await?;
            let request = serde_json::json!({"filter": filter, "all": all});
            let affected = to_json(&resent);
            operator_actions::record(
                &mut *tx,
                &asked.record(invocation, &request, &affected, None, true),
            )
            .await?;
            tx.commit().await.map_err(StoreError::from)?;
            tracing::info!(
                resent = resent.len(),
                actor = asked.actor,
                "failed outbox messages resent"
            );
            Ok(OperatorResponse::Resent { resent })
        }
        OperatorRequest::DiscardOutbox {
            outbox_ids,
            actor,
            reason,
        } => {
            if outbox_ids.is_empty() {
                return Err(OperatorError::BadRequest(
                    "discard_outbox needs the outbox_ids to discard".into(),
                ));
            }
            let asked = asked("discard_outbox", &actor, &reason)?;
            let mut tx = pool.begin().await.map_err(StoreError::from)?;
            let discarded = outbox::discard_failed(&mut *tx, &outbox_ids).await?;
            let not_failed: Vec<i64> = outbox_ids
                .iter()
                .copied()
                .filter(|id| !discarded.contains(id))
                .collect();
            let request = serde_json::json!({"outbox_ids": outbox_ids});
            let affected = to_json(&discarded);
            let outcome = serde_json::json!({"not_failed": not_failed});
            operator_actions::record(
                &mut *tx,
                &asked.record(invocation, &request, &affected, Some(&outcome), true),
            )
            .await?;
            tx.commit().await.map_err(StoreError::from)?;
            tracing::info!(
                discarded = discarded.len(),
                not_failed = not_failed.len(),
                "failed outbox messages discarded"
            );
            Ok(OperatorResponse::OutboxDiscarded {
                discarded,
                not_failed,
            })
        }
        OperatorRequest::FileKept {
            anomaly_id,
            actor,
            reason,
        } => {
            use crate::buffer::filing::{self, FileKeptError};
            let asked = asked("file_kept", &actor, &reason)?;
            let mut tx = pool.begin().await.map_err(StoreError::from)?;
            let filed = match filing::file_kept(&mut tx, anomaly_id).await {
                Ok(filed) => filed,
                Err(FileKeptError::Store(e)) => return Err(e.into()),
                Err(refused) => return Err(OperatorError::BadRequest(refused.to_string())),
            };
            let request = serde_json::json!({"anomaly_id": anomaly_id});
            let affected = serde_json::json!([filed.external_id]);
            let outcome = to_json(&filed);
            operator_actions::record(
                &mut *tx,
                &asked.record(invocation, &request, &affected, Some(&outcome), true),
            )
            .await?;
            tx.commit().await.map_err(StoreError::from)?;
            Ok(OperatorResponse::KeptFiled { filed_kept: filed })
        }
        OperatorRequest::ListSubscriptions => Ok(OperatorResponse::Subscriptions {
            subscriptions: crate::store::subscriptions::undelivered(pool).await?,
        }),
        OperatorRequest::PauseSubscription {
            tenant_id,
            subscription,
            actor,
            reason,
        } => {
            let asked = asked("pause_subscription", &actor, &reason)?;
            let mut tx = pool.begin().await.map_err(StoreError::from)?;
            known_subscription(&mut tx, &tenant_id, &subscription).await?;
            let newly = crate::store::subscriptions::pause(
                &mut *tx,
                &tenant_id,
                &subscription,
                asked.reason,
                asked.actor,
            )
            .await?;
            let outcome = serde_json::json!({"newly": newly});
            record_for_subscription(tx, &asked, invocation, &tenant_id, &subscription, &outcome)
                .await?;
            tracing::info!(%tenant_id, %subscription, newly, actor = asked.actor, "subscription paused");
            Ok(OperatorResponse::SubscriptionPaused {
                tenant_id,
                subscription,
                newly,
            })
        }
        OperatorRequest::ResumeSubscription {
            tenant_id,
            subscription,
            actor,
            reason,
        } => {
            let asked = asked("resume_subscription", &actor, &reason)?;
            let mut tx = pool.begin().await.map_err(StoreError::from)?;
            known_subscription(&mut tx, &tenant_id, &subscription).await?;
            let (lifted, due) = crate::store::subscriptions::resume(
                &mut tx,
                &tenant_id,
                &subscription,
                &crate::subscriptions::action_of(&subscription),
            )
            .await?;
            let outcome = serde_json::json!({"lifted": lifted, "due": due});
            record_for_subscription(tx, &asked, invocation, &tenant_id, &subscription, &outcome)
                .await?;
            tracing::info!(%tenant_id, %subscription, due, actor = asked.actor, "subscription resumed");
            Ok(OperatorResponse::SubscriptionResumed {
                tenant_id,
                subscription,
                lifted,
                due,
            })
        }
        OperatorRequest::ReplayToSubscription {
            replay,
            seconds,
            actor,
            reason,
        } => {
            let asked = asked("replay_to_subscription", &actor, &reason)?;
            let budget = std::time::Duration::from_secs(seconds.unwrap_or(10).clamp(1, 600));
            let deadline = std::time::Instant::now() + budget;
            let progress = crate::subscriptions::replay::run(
                pool,
                &replay,
                asked.actor,
                Some(asked.reason),
                deadline,
            )
            .await
            .map_err(|e| match e {
                crate::subscriptions::replay::ReplayError::Store(e) => OperatorError::from(e),
                other => OperatorError::BadRequest(other.to_string()),
            })?;
            let request = to_json(&replay);
            let affected = serde_json::json!([progress.replay_id]);
            operator_actions::record(
                pool,
                &asked.record(
                    invocation,
                    &request,
                    &affected,
                    Some(&to_json(&progress)),
                    true,
                ),
            )
            .await?;
            Ok(OperatorResponse::Replayed { replay: progress })
        }
        OperatorRequest::EventHistory {
            tenant_id,
            external_id,
        } => {
            let mut conn = pool.acquire().await.map_err(StoreError::from)?;
            let mut history = crate::store::event_history::of(&mut conn, &tenant_id, &external_id)
                .await?
                .ok_or_else(|| {
                    OperatorError::BadRequest(format!(
                        "tenant {tenant_id} has no event {external_id}"
                    ))
                })?;
            if let Some(entity_id) = &history.filing.entity_id {
                let (entity_type, _) = crate::effects::entity::classify(&history.filing.event_type);
                history.entity =
                    crate::store::entities::current(&mut *conn, &tenant_id, entity_type, entity_id)
                        .await?;
            }
            Ok(OperatorResponse::History {
                history: Box::new(history),
            })
        }
        OperatorRequest::CheckHistory {
            check_name,
            subject,
            runs,
        } => Ok(OperatorResponse::CheckHistory {
            check_history: crate::store::anomaly::check_history(
                pool,
                &check_name,
                &subject,
                runs.unwrap_or(48),
            )
            .await?,
        }),
        OperatorRequest::EstimateJob { kind: _, filter } => Ok(OperatorResponse::Estimate {
            estimate: dead_letters::count_matching(pool, &filter)
                .await?
                .min(filter.limit.unwrap_or(i64::MAX)),
        }),
        OperatorRequest::StartJob {
            kind,
            filter,
            all,
            actor,
            reason,
        } => {
            let asked = asked(kind.action(), &actor, &reason)?;
            bounded(
                kind.as_str(),
                "every open dead letter",
                filter.is_empty(),
                all,
            )?;
            let estimate = dead_letters::count_matching(pool, &filter)
                .await?
                .min(filter.limit.unwrap_or(i64::MAX));
            let request = serde_json::json!({"kind": kind, "filter": filter, "all": all});
            let mut tx = pool.begin().await.map_err(StoreError::from)?;
            let action_id = operator_actions::record(
                &mut *tx,
                &asked.record(invocation, &request, &serde_json::json!([]), None, false),
            )
            .await?;
            let job = crate::store::operator_jobs::create(
                &mut *tx,
                &crate::store::operator_jobs::NewJob {
                    kind: kind.as_str(),
                    filter: &to_json(&filter),
                    actor: asked.actor,
                    reason: asked.reason,
                    action_id,
                    estimate,
                },
            )
            .await?;
            tx.commit().await.map_err(StoreError::from)?;
            tracing::info!(
                job_id = job.job_id,
                kind = kind.as_str(),
                estimate,
                actor = asked.actor,
                "job started"
            );
            Ok(OperatorResponse::Job { job: Box::new(job) })
        }
        OperatorRequest::RunJob { job_id, seconds } => {
            let job = run_job(
                pool,
                registry,
                job_id,
                seconds.unwrap_or(10).clamp(1, MAX_JOB_SECONDS),
            )
            .await?;
            Ok(OperatorResponse::Job { job: Box::new(job) })
        }
        OperatorRequest::AbortJob {
            job_id,
            actor,
            reason,
        } => {
            let asked = asked("abort_job", &actor, &reason)?;
            let mut tx = pool.begin().await.map_err(StoreError::from)?;
            let Some(job) = crate::store::operator_jobs::end(&mut *tx, job_id, "aborted").await?
            else {
                return Err(OperatorError::BadRequest(format!(
                    "job {job_id} is not running"
                )));
            };
            operator_actions::record(
                &mut *tx,
                &asked.record(
                    invocation,
                    &serde_json::json!({"job_id": job_id}),
                    &serde_json::json!([job_id]),
                    Some(&to_json(&job_counts(&job))),
                    true,
                ),
            )
            .await?;
            operator_actions::finish(&mut *tx, job.action_id, &to_json(&job_counts(&job))).await?;
            tx.commit().await.map_err(StoreError::from)?;
            Ok(OperatorResponse::Job { job: Box::new(job) })
        }
        OperatorRequest::ShowJob { job_id } => {
            let job = crate::store::operator_jobs::get(pool, job_id)
                .await?
                .ok_or_else(|| OperatorError::BadRequest(format!("no job {job_id}")))?;
            Ok(OperatorResponse::Job { job: Box::new(job) })
        }
        OperatorRequest::ListJobs { limit } => Ok(OperatorResponse::Jobs {
            jobs: crate::store::operator_jobs::list(pool, limit.unwrap_or(DEFAULT_LIMIT)).await?,
        }),
        OperatorRequest::SourceHours { hours } => Ok(OperatorResponse::SourceHours {
            source_hours: crate::store::delivery_hours::recent_against_past_weeks(
                pool,
                hours.unwrap_or(24),
            )
            .await?,
        }),
        OperatorRequest::ListRefused { source_id, limit } => {
            use crate::store::refused_deliveries;
            let refused = refused_deliveries::list(
                pool,
                source_id.as_deref(),
                limit.unwrap_or(DEFAULT_LIMIT),
            )
            .await?;
            let last_day = refused_deliveries::last_day(pool)
                .await?
                .into_iter()
                .filter(|s| source_id.as_deref().is_none_or(|id| s.source_id == id))
                .collect();
            Ok(OperatorResponse::Refused { refused, last_day })
        }
        OperatorRequest::ListEvents { search, limit } => {
            let limit = limit.unwrap_or(DEFAULT_LIMIT).clamp(1, MAX_EVENTS_LISTED);
            let events = crate::store::webhook_events::search(pool, &search, limit).await?;
            let next = events
                .last()
                .filter(|_| events.len() as i64 == limit)
                .map(|last| crate::store::webhook_events::EventCursor {
                    first_received_at: last.first_received_at,
                    tenant_id: last.tenant_id.clone(),
                    external_id: last.external_id.clone(),
                });
            Ok(OperatorResponse::Events { events, next })
        }
        OperatorRequest::ShowEvent {
            tenant_id,
            external_id,
        } => {
            let event = crate::store::webhook_events::find(pool, &tenant_id, &external_id)
                .await?
                .ok_or_else(|| {
                    OperatorError::BadRequest(format!(
                        "tenant {tenant_id} has no event {external_id}"
                    ))
                })?;
            use crate::subscriptions::envelope::{Data, data_of};
            let (data, data_base64) = match event.payload.as_deref().map(data_of) {
                Some(Data::Json(v) | Data::Form(v)) => (Some(v), None),
                Some(Data::Binary(bytes)) => {
                    use base64::Engine as _;
                    (
                        None,
                        Some(base64::engine::general_purpose::STANDARD.encode(bytes)),
                    )
                }
                None => (None, None),
            };
            Ok(OperatorResponse::Event {
                purged: event.payload.is_none(),
                event: Box::new(event),
                data,
                data_base64,
            })
        }
        OperatorRequest::ListActions { limit } => Ok(OperatorResponse::Actions {
            actions: operator_actions::list(pool, limit.unwrap_or(DEFAULT_LIMIT)).await?,
        }),
    }
}

/// Records a pause or resume of one subscription with the change it made, and commits both.
async fn record_for_subscription(
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    asked: &Asked<'_>,
    invocation: &Invocation,
    tenant_id: &str,
    subscription: &str,
    outcome: &serde_json::Value,
) -> Result<(), OperatorError> {
    let request = serde_json::json!({"tenant_id": tenant_id, "subscription": subscription});
    let affected = serde_json::json!([request]);
    operator_actions::record(
        &mut *tx,
        &asked.record(invocation, &request, &affected, Some(outcome), true),
    )
    .await?;
    tx.commit().await.map_err(StoreError::from)?;
    Ok(())
}

/// Refuses a request naming a subscription the route file does not hold.
async fn known_subscription(
    conn: &mut sqlx::PgConnection,
    tenant_id: &str,
    name: &str,
) -> Result<(), OperatorError> {
    match crate::store::subscriptions::find(&mut *conn, tenant_id, name).await? {
        Some(_) => Ok(()),
        None => Err(OperatorError::BadRequest(format!(
            "tenant {tenant_id} has no subscription {name} (hookctl routes list)"
        ))),
    }
}

/// The sequence number a tombstone fills. On a source whose gaps are found by sequence, it is
/// the number the ID stands for under the source's id template (a given `sequence` must agree):
/// a tombstone without one would leave its gap open and the watermark pinned below it forever.
/// Elsewhere it is whatever was given.
async fn tombstone_sequence(
    pool: &PgPool,
    tenant_id: &str,
    source_id: &str,
    external_id: &str,
    given: Option<i64>,
) -> Result<Option<i64>, OperatorError> {
    let id = crate::domain::SourceId::parse(source_id)
        .map_err(|_| OperatorError::BadRequest(format!("no source {source_id:?}")))?;
    let source = crate::sources::find(pool, &id)
        .await?
        .ok_or_else(|| OperatorError::BadRequest(format!("no source {source_id:?}")))?;
    if source.tenant_id.as_str() != tenant_id {
        return Err(OperatorError::BadRequest(format!(
            "source {source_id:?} does not belong to tenant {tenant_id:?}"
        )));
    }
    let Some(GapStrategy::Sequence { id_template }) = source.gaps.map(|g| g.strategy) else {
        return Ok(given);
    };
    match (
        crate::sources::sequence_of_id(&id_template, external_id),
        given,
    ) {
        (Some(n), None) => Ok(Some(n)),
        (Some(n), Some(g)) if n == g => Ok(Some(n)),
        (Some(n), Some(g)) => Err(OperatorError::BadRequest(format!(
            "{external_id:?} is sequence {n} under the source's id template {id_template:?}, not {g}"
        ))),
        (None, _) => Err(OperatorError::BadRequest(format!(
            "{external_id:?} does not follow the source's id template {id_template:?}: gap detection could never place it"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_from_the_documented_json() {
        let r = parse(serde_json::json!({"action": "replay", "filter": {"ids": [1, 2], "error_contains": "timeout"}})).unwrap();
        assert!(matches!(r, OperatorRequest::Replay { filter, .. } if filter.ids == [1, 2]));
        assert!(matches!(
            parse(serde_json::json!({"action": "replay"})).unwrap(),
            OperatorRequest::Replay { .. }
        ));
        let err = parse(serde_json::json!({"action": "replay", "filter": {"typo": 1}}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("typo"), "{err}");
        assert!(parse(serde_json::json!({"action": "drop_tables"})).is_err());
        assert!(matches!(
            parse(serde_json::json!({"action": "status"})).unwrap(),
            OperatorRequest::Status
        ));
        assert!(matches!(
            parse(serde_json::json!({"action": "list_runs", "job": "reconcile"})).unwrap(),
            OperatorRequest::ListRuns { job: Some(j), limit: None } if j == "reconcile"
        ));
        assert!(matches!(
            parse(serde_json::json!({"action": "show_dead_letter", "dead_letter_id": 3})).unwrap(),
            OperatorRequest::ShowDeadLetter { dead_letter_id: 3 }
        ));
    }
}
