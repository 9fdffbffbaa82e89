//! The operator's commands: `status`, `dead-letters`, `outbox`, `tombstones`, `gaps`, `runs`,
//! `checks`, `actions`.
//! A command that changes state (replay, discard, resend, tombstone) needs `--reason`, and
//! sends who asks (`--actor`, else the OS user); both are recorded with the change. A replay or
//! resend without a filter refuses unless `--all` is given.
//! Each builds an operator request, sends it through a [`Backend`] and renders the answer: a
//! table for people, `--json` for scripts. Exit codes: 0 all accounted for (or done), 1 needs a
//! human (or something failed again), 2 could not tell.

use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;
use shared::drain::ReplayOutcome;
use shared::operator::OperatorRequest;
use shared::status::StatusReport;
use shared::store::anomaly::StoredResult;
use shared::store::dead_letters::{DeadLetter, DeadLetterDetail, ReplayFilter};
use shared::store::gaps::{OpenGap, Tombstone};
use shared::store::maintenance_runs::RunRecord;
use shared::store::operator_actions::RecordedAction;
use shared::store::outbox::{FailedFilter, FailedMessage};

use crate::backend::{Backend, CallError};
use crate::render;

/// 0: accounted for / done; 1: needs a human; 2: could not tell.
pub type Exit = u8;

/// Which open dead letters: every flag narrows; none matches every open letter.
#[derive(Args, Debug, Clone, Default)]
pub struct LetterFilter {
    /// A dead letter id (repeatable).
    #[arg(long = "id")]
    pub ids: Vec<i64>,
    #[arg(long)]
    pub tenant: Option<String>,
    #[arg(long)]
    pub event_type: Option<String>,
    /// A case-insensitive substring of the recorded error.
    #[arg(long)]
    pub error_contains: Option<String>,
    /// Created at or after (RFC 3339, e.g. 2026-11-30T00:00:00Z).
    #[arg(long)]
    pub since: Option<DateTime<Utc>>,
    /// Created before (RFC 3339).
    #[arg(long)]
    pub until: Option<DateTime<Utc>>,
    /// At most this many.
    #[arg(long, default_value_t = 1000)]
    pub limit: i64,
}

impl LetterFilter {
    fn to_filter(&self) -> ReplayFilter {
        ReplayFilter {
            ids: self.ids.clone(),
            tenant_id: self.tenant.clone(),
            event_type: self.event_type.clone(),
            error_contains: self.error_contains.clone(),
            created_after: self.since,
            created_before: self.until,
            limit: Some(self.limit),
        }
    }
}

/// Who asks for a change and why: sent with it, recorded with it in `operator_actions`.
#[derive(Args, Debug, Clone)]
pub struct Decision {
    /// Why (recorded with the change).
    #[arg(long)]
    pub reason: String,
    /// Who asks (recorded as given; default: the OS user, $USER or $LOGNAME).
    #[arg(long, env = "HOOKCTL_ACTOR", visible_alias = "operator")]
    pub actor: Option<String>,
}

impl Decision {
    /// `--actor`, else the OS user.
    fn actor(&self) -> Result<String, CallError> {
        self.actor
            .clone()
            .or_else(|| std::env::var("USER").ok())
            .or_else(|| std::env::var("LOGNAME").ok())
            .filter(|a| !a.trim().is_empty())
            .ok_or_else(|| {
                CallError::BadRequest(
                    "who asks? no --actor (HOOKCTL_ACTOR) and no OS user ($USER, $LOGNAME)".into(),
                )
            })
    }
}

/// Refused locally, before anything is sent: exit 2 with the reason.
fn refuse(message: &str) -> Exit {
    eprintln!("hookctl: {message}");
    2
}

#[derive(Subcommand, Debug)]
pub enum DeadLettersAction {
    /// Open dead letters (new, investigating), oldest first.
    List(LetterFilter),
    /// One dead letter with its error, headers (signatures withheld) and payload.
    Show { id: i64 },
    /// Replay the matching open letters through the normal processing path. Without a filter,
    /// only with --all.
    Replay {
        #[command(flatten)]
        filter: LetterFilter,
        /// Replay every open letter (no filter).
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        decision: Decision,
    },
    /// Close letters without replaying them (the event is not wanted).
    Discard {
        #[arg(required = true)]
        ids: Vec<i64>,
        #[command(flatten)]
        decision: Decision,
    },
}

/// Which failed outbox messages: every flag narrows; none matches every failed message.
#[derive(Args, Debug, Clone, Default)]
pub struct OutboxFilter {
    /// An outbox message id (repeatable).
    #[arg(long = "id")]
    pub ids: Vec<i64>,
    #[arg(long)]
    pub tenant: Option<String>,
    /// The message's action (`entity.changed`, `fulfil_order`).
    #[arg(long)]
    pub action: Option<String>,
    /// A case-insensitive substring of the last error.
    #[arg(long)]
    pub error_contains: Option<String>,
    /// At most this many.
    #[arg(long, default_value_t = 1000)]
    pub limit: i64,
}

impl OutboxFilter {
    fn to_filter(&self) -> FailedFilter {
        FailedFilter {
            ids: self.ids.clone(),
            tenant_id: self.tenant.clone(),
            action: self.action.clone(),
            error_contains: self.error_contains.clone(),
            limit: Some(self.limit),
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum OutboxAction {
    /// Messages that failed for good (refused by the target, or out of attempts, or without a
    /// route), oldest first, with where each was last tried.
    List(OutboxFilter),
    /// The latest delivered messages and where each went (its route's destination), newest
    /// first.
    Sent {
        #[arg(long)]
        tenant: Option<String>,
        /// The message's action (`entity.changed`, `fulfil_order`).
        #[arg(long)]
        action: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Send the matching failed messages again, once the target is fixed: due at once, with a
    /// fresh attempt budget and the same Idempotency-Key. The outbox function sends them.
    /// Without a filter, only with --all.
    Resend {
        #[command(flatten)]
        filter: OutboxFilter,
        /// Resend every failed message (no filter).
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        decision: Decision,
    },
    /// Close failed messages whose effect is not wanted: never sent, no longer a finding.
    Discard {
        #[arg(required = true)]
        ids: Vec<i64>,
        #[command(flatten)]
        decision: Decision,
    },
}

#[derive(Subcommand, Debug)]
pub enum BufferAction {
    /// The buffer's dead letters: deliveries the consumer failed on repeatedly, NOT accounted
    /// for until re-driven. Ids, source, received time, size, receive count; never a body.
    List {
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Send the buffer's dead letters back to the buffer (once the cause is fixed): each is
    /// deleted from the dead-letter queue only after SQS took it back; a message that is not a
    /// buffered delivery stays there.
    Redrive {
        #[arg(long, default_value_t = 100)]
        limit: usize,
        #[command(flatten)]
        decision: Decision,
    },
    /// File a delivery an ingest anomaly kept with its payload (one the consumer could not
    /// read, answered 200 `buffered` to the provider), once its source reads it: stored as
    /// ingest would have, under the time it was recorded. Needs only the database.
    FileKept {
        /// The anomaly's id (`anomaly_id`).
        anomaly_id: i64,
        #[command(flatten)]
        decision: Decision,
    },
}

/// One event of a tenant's source, by its external id: what a tombstone or a gap names.
#[derive(Args, Debug)]
pub struct SourceEvent {
    #[arg(long)]
    pub tenant: String,
    #[arg(long)]
    pub source: String,
    /// The event's external id.
    #[arg(long = "id")]
    pub external_id: String,
}

#[derive(Subcommand, Debug)]
pub enum TombstonesAction {
    /// Declare an event ID that will never arrive: gap detection stops waiting for it.
    Add {
        #[command(flatten)]
        event: SourceEvent,
        /// Who decided is recorded on the tombstone as operator:<actor>.
        #[command(flatten)]
        decision: Decision,
        /// The sequence number, on a sequence source (read from the id when omitted).
        #[arg(long)]
        sequence: Option<i64>,
    },
    /// Tombstones, newest first.
    List {
        #[arg(long)]
        source: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
}

#[derive(Subcommand, Debug)]
pub enum ActionsAction {
    /// The recorded state changes, newest first: who asked, why, what they touched.
    List {
        #[arg(long, default_value_t = 20)]
        limit: i64,
    },
}

#[derive(Args, Debug)]
pub struct RefusedArgs {
    /// Only this source's.
    #[arg(long)]
    pub source: Option<String>,
    #[arg(long, default_value_t = 20)]
    pub limit: i64,
}

#[derive(Subcommand, Debug)]
pub enum GapsAction {
    /// Open gaps, oldest first: in grace (late events are normal) or due for backfill.
    List {
        #[arg(long)]
        source: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Ask for an open gap to be fetched by the next backfill pass (every 5 minutes in AWS;
    /// `hookctl backfill` runs one here), without waiting out its source's grace period.
    Backfill {
        #[command(flatten)]
        event: SourceEvent,
        #[command(flatten)]
        decision: Decision,
    },
}

#[derive(Subcommand, Debug)]
pub enum RunsAction {
    /// Maintenance runs, newest first, with what each found and repaired.
    List {
        /// reconcile, backfill, retention or anomaly.
        #[arg(long)]
        job: Option<String>,
        #[arg(long, default_value_t = 20)]
        limit: i64,
    },
}

#[derive(Subcommand, Debug)]
pub enum ChecksAction {
    /// The latest anomaly run's results, breaching first.
    List {
        /// Only the breaching ones.
        #[arg(long)]
        breached: bool,
    },
}

/// A spinner for a long pass (a backfill of thousands, a drain of a backlog) on a terminal;
/// drawn on stderr, and nothing at all when stderr is piped.
pub fn spinner(what: &str) -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.set_message(what.to_owned());
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    bar
}

/// Prints the answer as JSON or as `table`.
fn show<T: serde::Serialize>(json: bool, value: &T, table: impl FnOnce(&T) -> String) {
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(value).unwrap_or_default()
        );
    } else {
        print!("{}", table(value));
    }
}

/// One read action answered: shown as a table or JSON, exit 0; or its failure's exit code.
async fn answer<T: serde::de::DeserializeOwned + serde::Serialize>(
    backend: &Backend,
    json: bool,
    request: OperatorRequest,
    table: impl FnOnce(&T) -> String,
) -> Exit {
    match backend.call::<T>(&request).await {
        Ok(value) => {
            show(json, &value, table);
            0
        }
        Err(e) => fail(e),
    }
}

fn fail(error: CallError) -> Exit {
    eprintln!("hookctl: {error}");
    2
}

pub async fn status(backend: &Backend, json: bool) -> Exit {
    match backend.call::<StatusReport>(&OperatorRequest::Status).await {
        Ok(report) => {
            show(json, &report, render::status);
            report.exit_code()
        }
        Err(e) => fail(e),
    }
}

#[derive(Deserialize, serde::Serialize)]
struct Letters {
    dead_letters: Vec<DeadLetter>,
}
#[derive(Deserialize, serde::Serialize)]
struct Letter {
    dead_letter: DeadLetterDetail,
}
#[derive(Deserialize, serde::Serialize)]
struct Changed {
    dead_letter_id: i64,
    status: String,
}

pub async fn dead_letters(backend: &Backend, json: bool, action: DeadLettersAction) -> Exit {
    let result = match action {
        DeadLettersAction::List(filter) => backend
            .call::<Letters>(&OperatorRequest::ListDeadLetters {
                filter: filter.to_filter(),
            })
            .await
            .map(|l| {
                show(json, &l, |l| render::dead_letters(&l.dead_letters));
                0
            }),
        DeadLettersAction::Show { id } => backend
            .call::<Letter>(&OperatorRequest::ShowDeadLetter { dead_letter_id: id })
            .await
            .map(|l| {
                show(json, &l, |l| render::dead_letter(&l.dead_letter));
                0
            }),
        DeadLettersAction::Replay {
            filter,
            all,
            decision,
        } => {
            if filter.to_filter().is_empty() && !all {
                return refuse(
                    "no filter: this would replay every open dead letter; narrow it (--id, --tenant, --event-type, --error-contains, --since, --until) or give --all",
                );
            }
            replay(backend, json, &filter, all, &decision).await
        }
        DeadLettersAction::Discard { ids, decision } => {
            let actor = match decision.actor() {
                Ok(actor) => actor,
                Err(e) => return fail(e),
            };
            let mut changed = Vec::new();
            let mut result = Ok(0);
            for id in ids {
                match backend
                    .call::<Changed>(&OperatorRequest::SetDeadLetterStatus {
                        dead_letter_id: id,
                        status: "discarded".into(),
                        actor: Some(actor.clone()),
                        reason: Some(decision.reason.clone()),
                    })
                    .await
                {
                    Ok(c) => changed.push(c),
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
            show(json, &changed, |c| {
                c.iter()
                    .map(|c| format!("dead letter {} {}\n", c.dead_letter_id, c.status))
                    .collect()
            });
            result
        }
    };
    result.unwrap_or_else(fail)
}

#[derive(Deserialize, serde::Serialize)]
struct JobAnswer {
    job: shared::store::operator_jobs::Job,
}

/// Replays the matching letters as a job (the console's): its estimate counted, then steps of a
/// few seconds until it finishes, with a progress bar on a terminal (nothing when stderr is
/// piped). Interrupted, the job stays running and `run_job` resumes it. Exit 1 when some failed
/// again. The job is one recorded action, finished with its counts.
async fn replay(
    backend: &Backend,
    json: bool,
    filter: &LetterFilter,
    all: bool,
    decision: &Decision,
) -> Result<Exit, CallError> {
    let actor = decision.actor()?;
    let mut job = backend
        .call::<JobAnswer>(&OperatorRequest::StartJob {
            kind: shared::operator::JobKind::ReplayDeadLetters,
            filter: filter.to_filter(),
            all,
            actor: Some(actor),
            reason: Some(decision.reason.clone()),
        })
        .await?
        .job;
    let bar = ProgressBar::new(u64::try_from(job.estimate).unwrap_or(0));
    bar.set_style(
        ProgressStyle::with_template("replaying {bar:40} {pos}/{len} {msg} ({eta} left)")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    if job.status == "running" {
        job = backend
            .run_job(job.job_id, |job| {
                bar.set_position(u64::try_from(job.done + job.failed + job.skipped).unwrap_or(0));
                bar.set_message(format!("{} failed again", job.failed));
            })
            .await?;
    }
    bar.finish_and_clear();
    let count = |n: i64| u64::try_from(n).unwrap_or(0);
    let total = ReplayOutcome {
        selected: count(job.done + job.failed + job.skipped),
        replayed: count(job.done),
        failed: count(job.failed),
        skipped: count(job.skipped),
    };
    show(json, &total, render::replay);
    Ok(if total.failed > 0 { 1 } else { 0 })
}

#[derive(Deserialize, serde::Serialize)]
struct FailedOutbox {
    failed_outbox: Vec<FailedMessage>,
}
#[derive(Deserialize, serde::Serialize)]
struct SentOutbox {
    sent_outbox: Vec<shared::store::outbox::SentMessage>,
}
#[derive(Deserialize, serde::Serialize)]
struct Resent {
    resent: Vec<i64>,
}
#[derive(Deserialize, serde::Serialize)]
struct Discarded {
    discarded: Vec<i64>,
    not_failed: Vec<i64>,
}

#[derive(Deserialize, serde::Serialize)]
struct BufferDeadLetters {
    buffer_dead_letters: Vec<shared::buffer::accounting::DeadLetter>,
}
#[derive(Deserialize, serde::Serialize)]
struct KeptFiled {
    filed_kept: shared::buffer::filing::FiledKept,
}
#[derive(Deserialize, serde::Serialize)]
struct BufferRedriven {
    action_id: i64,
    redriven: shared::buffer::accounting::Redriven,
}

/// Lists or re-drives the buffer's dead letters. Exit 1 when a redrive left messages behind
/// that are not buffered deliveries.
pub async fn buffer(backend: &Backend, json: bool, action: BufferAction) -> Exit {
    match action {
        BufferAction::List { limit } => {
            answer(
                backend,
                json,
                OperatorRequest::ListBufferDeadLetters { limit: Some(limit) },
                |d: &BufferDeadLetters| render::buffer_dead_letters(&d.buffer_dead_letters),
            )
            .await
        }
        BufferAction::Redrive { limit, decision } => {
            let actor = match decision.actor() {
                Ok(actor) => actor,
                Err(e) => return fail(e),
            };
            match backend
                .call::<BufferRedriven>(&OperatorRequest::RedriveBuffer {
                    limit: Some(limit),
                    actor: Some(actor),
                    reason: Some(decision.reason),
                })
                .await
            {
                Ok(r) => {
                    show(json, &r, |r| {
                        format!(
                            "re-drove {} delivery(ies) to the buffer (action {}); {} not buffered deliveries left in the dead-letter queue\n",
                            r.redriven.moved, r.action_id, r.redriven.skipped
                        )
                    });
                    u8::from(r.redriven.skipped > 0)
                }
                Err(e) => fail(e),
            }
        }
        BufferAction::FileKept {
            anomaly_id,
            decision,
        } => {
            let actor = match decision.actor() {
                Ok(actor) => actor,
                Err(e) => return fail(e),
            };
            match backend
                .call::<KeptFiled>(&OperatorRequest::FileKept {
                    anomaly_id,
                    actor: Some(actor),
                    reason: Some(decision.reason),
                })
                .await
            {
                Ok(k) => {
                    show(json, &k, |k| {
                        let f = &k.filed_kept;
                        format!(
                            "filed anomaly {} as event {} of source {} ({})\n",
                            f.anomaly_id, f.external_id, f.source_id, f.outcome
                        )
                    });
                    0
                }
                Err(e) => fail(e),
            }
        }
    }
}

/// Lists, resends or discards failed outbox messages. Exit 1 when a discard named a message
/// that was not failed.
pub async fn outbox(backend: &Backend, json: bool, action: OutboxAction) -> Exit {
    let result = match action {
        OutboxAction::List(filter) => {
            let request = OperatorRequest::ListFailedOutbox {
                filter: filter.to_filter(),
            };
            return answer(backend, json, request, |f: &FailedOutbox| {
                render::failed_outbox(&f.failed_outbox)
            })
            .await;
        }
        OutboxAction::Sent {
            tenant,
            action,
            limit,
        } => {
            let request = OperatorRequest::ListSentOutbox {
                tenant_id: tenant,
                outbox_action: action,
                limit: Some(limit),
            };
            return answer(backend, json, request, |s: &SentOutbox| {
                render::sent_outbox(&s.sent_outbox)
            })
            .await;
        }
        OutboxAction::Resend {
            filter,
            all,
            decision,
        } => {
            let filter = filter.to_filter();
            if filter.is_empty() && !all {
                return refuse(
                    "no filter: this would resend every failed outbox message; narrow it (--id, --tenant, --action, --error-contains) or give --all",
                );
            }
            let actor = match decision.actor() {
                Ok(actor) => actor,
                Err(e) => return fail(e),
            };
            backend
                .call::<Resent>(&OperatorRequest::ResendOutbox {
                    filter,
                    all,
                    actor: Some(actor),
                    reason: Some(decision.reason),
                })
                .await
                .map(|r| {
                    show(json, &r, |r| {
                        format!(
                            "resent {} message(s){}: the next outbox run sends them\n",
                            r.resent.len(),
                            ids(&r.resent)
                        )
                    });
                    0
                })
        }
        OutboxAction::Discard {
            ids: asked,
            decision,
        } => {
            let actor = match decision.actor() {
                Ok(actor) => actor,
                Err(e) => return fail(e),
            };
            backend
                .call::<Discarded>(&OperatorRequest::DiscardOutbox {
                    outbox_ids: asked,
                    actor: Some(actor),
                    reason: Some(decision.reason),
                })
                .await
                .map(|d| {
                    show(json, &d, |d| {
                        let mut out = format!(
                            "discarded {} message(s){}\n",
                            d.discarded.len(),
                            ids(&d.discarded)
                        );
                        if !d.not_failed.is_empty() {
                            out.push_str(&format!(
                                "not failed, left as they were{}\n",
                                ids(&d.not_failed)
                            ));
                        }
                        out
                    });
                    u8::from(!d.not_failed.is_empty())
                })
        }
    };
    result.unwrap_or_else(fail)
}

/// `: 1, 2, 3`, or nothing for no ids.
fn ids(list: &[i64]) -> String {
    if list.is_empty() {
        return String::new();
    }
    let joined: Vec<String> = list.iter().map(i64::to_string).collect();
    format!(": {}", joined.join(", "))
}

#[derive(Deserialize, serde::Serialize)]
struct Tombstoned {
    external_id: String,
    created: bool,
}
#[derive(Deserialize, serde::Serialize)]
struct Tombstones {
    tombstones: Vec<Tombstone>,
}

pub async fn tombstones(backend: &Backend, json: bool, action: TombstonesAction) -> Exit {
    let result = match action {
        TombstonesAction::Add {
            event:
                SourceEvent {
                    tenant,
                    source,
                    external_id,
                },
            decision,
            sequence,
        } => match decision.actor() {
            Err(e) => Err(e),
            Ok(actor) => backend
                .call::<Tombstoned>(&OperatorRequest::Tombstone {
                    tenant_id: tenant,
                    source_id: source,
                    external_id,
                    sequence,
                    reason: Some(decision.reason),
                    actor: Some(actor),
                })
                .await
                .map(|t| {
                    show(json, &t, |t| {
                        if t.created {
                            format!("tombstoned {}\n", t.external_id)
                        } else {
                            format!("{} was already tombstoned\n", t.external_id)
                        }
                    });
                    0
                }),
        },
        TombstonesAction::List { source, limit } => {
            let request = OperatorRequest::ListTombstones {
                source_id: source,
                limit: Some(limit),
            };
            return answer(backend, json, request, |t: &Tombstones| {
                render::tombstones(&t.tombstones)
            })
            .await;
        }
    };
    result.unwrap_or_else(fail)
}

#[derive(Deserialize, serde::Serialize)]
struct Gaps {
    gaps: Vec<OpenGap>,
}

pub async fn gaps(backend: &Backend, json: bool, action: GapsAction) -> Exit {
    match action {
        GapsAction::List { source, limit } => {
            let request = OperatorRequest::ListGaps {
                source_id: source,
                limit: Some(limit),
            };
            answer(backend, json, request, |g: &Gaps| render::gaps(&g.gaps)).await
        }
        GapsAction::Backfill {
            event:
                SourceEvent {
                    tenant,
                    source,
                    external_id,
                },
            decision,
        } => {
            let result = match decision.actor() {
                Err(e) => Err(e),
                Ok(actor) => backend
                    .call::<BackfillRequested>(&OperatorRequest::BackfillGap {
                        tenant_id: tenant,
                        source_id: source,
                        external_id,
                        reason: Some(decision.reason),
                        actor: Some(actor),
                    })
                    .await
                    .map(|b| {
                        show(json, &b, |b| {
                            format!(
                                "{} will be fetched by the next backfill pass (within {} s)\n",
                                b.external_id, b.next_pass_within_seconds
                            )
                        });
                        0
                    }),
            };
            result.unwrap_or_else(fail)
        }
    }
}

#[derive(Deserialize, serde::Serialize)]
struct BackfillRequested {
    external_id: String,
    next_pass_within_seconds: u64,
}

#[derive(Deserialize, serde::Serialize)]
struct Runs {
    runs: Vec<RunRecord>,
}

pub async fn runs(backend: &Backend, json: bool, action: RunsAction) -> Exit {
    let RunsAction::List { job, limit } = action;
    let request = OperatorRequest::ListRuns {
        job,
        limit: Some(limit),
    };
    answer(backend, json, request, |r: &Runs| render::runs(&r.runs)).await
}

#[derive(Deserialize, serde::Serialize)]
struct Checks {
    checks: Vec<StoredResult>,
}

pub async fn checks(backend: &Backend, json: bool, action: ChecksAction) -> Exit {
    let ChecksAction::List { breached } = action;
    let request = OperatorRequest::ListChecks {
        breached_only: breached,
    };
    answer(backend, json, request, |c: &Checks| {
        render::checks(&c.checks)
    })
    .await
}

#[derive(Deserialize, serde::Serialize)]
struct Actions {
    actions: Vec<RecordedAction>,
}

pub async fn actions(backend: &Backend, json: bool, action: ActionsAction) -> Exit {
    let ActionsAction::List { limit } = action;
    let request = OperatorRequest::ListActions { limit: Some(limit) };
    answer(backend, json, request, |a: &Actions| {
        render::actions(&a.actions)
    })
    .await
}

#[derive(Deserialize, serde::Serialize)]
struct Refused {
    refused: Vec<shared::store::refused_deliveries::Refusal>,
    last_day: Vec<shared::store::refused_deliveries::SourceRefusals>,
}

/// `hookctl refused`: deliveries refused before anything was stored, and what the last day's
/// add up to per source and check.
pub async fn refused(backend: &Backend, json: bool, args: RefusedArgs) -> Exit {
    let request = OperatorRequest::ListRefused {
        source_id: args.source,
        limit: Some(args.limit),
    };
    answer(backend, json, request, |r: &Refused| {
        render::refused(&r.last_day, &r.refused)
    })
    .await
}

/// A subscription by tenant and name.
#[derive(Args, Debug, Clone)]
pub struct SubscriptionName {
    #[arg(long)]
    pub tenant: String,
    /// The subscription's name (its route's `name`).
    pub name: String,
}

#[derive(Deserialize, serde::Serialize)]
struct Subscriptions {
    subscriptions: Vec<shared::store::subscriptions::Undelivered>,
}

/// `hookctl routes subscriptions`: every subscription's undelivered and failed counts.
pub async fn list_subscriptions(backend: &Backend, json: bool) -> Exit {
    answer(
        backend,
        json,
        OperatorRequest::ListSubscriptions,
        |s: &Subscriptions| render::subscriptions(&s.subscriptions),
    )
    .await
}

/// `hookctl routes pause|resume`: recorded with who asked and why.
pub async fn pause_or_resume(
    backend: &Backend,
    json: bool,
    pause: bool,
    subscription: SubscriptionName,
    decision: Decision,
) -> Exit {
    let actor = match decision.actor() {
        Ok(actor) => actor,
        Err(e) => return fail(e),
    };
    let (tenant_id, name) = (subscription.tenant, subscription.name);
    let request = if pause {
        OperatorRequest::PauseSubscription {
            tenant_id,
            subscription: name,
            actor: Some(actor),
            reason: Some(decision.reason),
        }
    } else {
        OperatorRequest::ResumeSubscription {
            tenant_id,
            subscription: name,
            actor: Some(actor),
            reason: Some(decision.reason),
        }
    };
    answer(backend, json, request, |v: &serde_json::Value| {
        if pause {
            format!(
                "paused {}{}\n",
                v["subscription"].as_str().unwrap_or("?"),
                if v["newly"].as_bool() == Some(false) {
                    " (it was paused already)"
                } else {
                    ""
                }
            )
        } else {
            format!(
                "resumed {}: {} waiting message(s) due now\n",
                v["subscription"].as_str().unwrap_or("?"),
                v["due"].as_u64().unwrap_or(0)
            )
        }
    })
    .await
}

#[derive(Subcommand)]
pub enum EventsAction {
    /// Send stored events of a range to one subscription again (or for the first time: a new
    /// subscriber catching up, or one recovering from its own outage). A resumable job: its
    /// cursor is stored, so an interrupted run resumes when run again with the same range;
    /// the same idempotency keys, so the subscriber deduplicates. Events whose payload
    /// retention purged are skipped and counted.
    Replay(ReplayArgs),
    /// One stored event: what it is, where it stands, its data.
    Show {
        #[arg(long)]
        tenant: String,
        /// The provider's event id.
        #[arg(long)]
        id: String,
    },
}

#[derive(Args)]
pub struct ReplayArgs {
    /// The subscription's name.
    #[arg(long = "route")]
    pub subscription: String,
    #[arg(long)]
    pub tenant: String,
    /// Only this source's events.
    #[arg(long)]
    pub source: Option<String>,
    /// Only these event types (repeatable; exact names or globs), within the subscription's.
    #[arg(long = "type")]
    pub types: Vec<String>,
    /// First received at or after (RFC 3339).
    #[arg(long)]
    pub since: DateTime<Utc>,
    /// First received before (RFC 3339; default now).
    #[arg(long)]
    pub until: Option<DateTime<Utc>>,
    /// Events a second (default: the subscription's rate limit, else 100).
    #[arg(long)]
    pub rate: Option<f64>,
    #[command(flatten)]
    pub decision: Decision,
}

#[derive(Deserialize, serde::Serialize)]
struct Replayed {
    replay: shared::subscriptions::replay::ReplayProgress,
}

pub async fn events(backend: &Backend, json: bool, action: EventsAction) -> Exit {
    match action {
        EventsAction::Show { tenant, id } => {
            let request = OperatorRequest::ShowEvent {
                tenant_id: tenant,
                external_id: id,
            };
            answer(backend, json, request, |v: &serde_json::Value| {
                serde_json::to_string_pretty(v).unwrap_or_default() + "\n"
            })
            .await
        }
        EventsAction::Replay(args) => replay_to_subscription(backend, json, args).await,
    }
}

/// Runs the replay step by step (each step at most ten seconds of the operator's time) until
/// its range is done: a bar on a terminal, a JSON line per step with `--json`.
async fn replay_to_subscription(backend: &Backend, json: bool, args: ReplayArgs) -> Exit {
    let actor = match args.decision.actor() {
        Ok(actor) => actor,
        Err(e) => return fail(e),
    };
    // Fixed once, so every step (and a run after an interruption, given the same --until)
    // names the same job.
    let until = args.until.unwrap_or_else(Utc::now);
    let replay = shared::subscriptions::replay::ReplayRequest {
        tenant_id: args.tenant,
        subscription: args.subscription,
        source_id: args.source,
        event_types: args.types,
        since: args.since,
        until,
        rate: args.rate,
    };
    let bar = if json {
        ProgressBar::hidden()
    } else {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} events ({msg}) {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    };
    let mut read_before = None;
    loop {
        let request = OperatorRequest::ReplayToSubscription {
            replay: replay.clone(),
            seconds: Some(10),
            actor: Some(actor.clone()),
            reason: Some(args.decision.reason.clone()),
        };
        let progress = match backend.call::<Replayed>(&request).await {
            Ok(r) => r.replay,
            Err(e) => {
                bar.abandon();
                return fail(e);
            }
        };
        if json {
            println!("{}", serde_json::to_string(&progress).unwrap_or_default());
        } else {
            let total = *read_before.get_or_insert(progress.remaining);
            bar.set_length(total.max(1) as u64);
            bar.set_position((total - progress.remaining).max(0) as u64);
            bar.set_message(format!(
                "replay {}, {} queued, {} purged skipped",
                progress.replay_id, progress.queued, progress.skipped_purged
            ));
        }
        if progress.finished {
            bar.finish();
            if !json {
                println!(
                    "replay {} finished: {} message(s) queued for the outbox, {} event(s) skipped (payload purged)",
                    progress.replay_id, progress.queued, progress.skipped_purged
                );
            }
            return 0;
        }
    }
}
