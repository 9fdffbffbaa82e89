//! The operator's commands: `status`, `dead-letters`, `outbox`, `tombstones`, `gaps`, `runs`,
//! `checks`.
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

#[derive(Subcommand, Debug)]
pub enum DeadLettersAction {
    /// Open dead letters (new, investigating), oldest first.
    List(LetterFilter),
    /// One dead letter with its error, headers and payload.
    Show { id: i64 },
    /// Replay the matching open letters through the normal processing path.
    Replay(LetterFilter),
    /// Close letters without replaying them (the event is not wanted).
    Discard {
        #[arg(required = true)]
        ids: Vec<i64>,
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
    /// Messages that failed for good (refused by the target, or out of attempts), oldest first.
    List(OutboxFilter),
    /// Send the matching failed messages again, once the target is fixed: due at once, with a
    /// fresh attempt budget and the same Idempotency-Key. The outbox function sends them.
    Resend(OutboxFilter),
    /// Close failed messages whose effect is not wanted: never sent, no longer a finding.
    Discard {
        #[arg(required = true)]
        ids: Vec<i64>,
    },
}

#[derive(Subcommand, Debug)]
pub enum TombstonesAction {
    /// Declare an event ID that will never arrive: gap detection stops waiting for it.
    Add {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        source: String,
        /// The event's external id.
        #[arg(long = "id")]
        external_id: String,
        #[arg(long)]
        reason: String,
        /// Who decided (recorded as operator:<name>).
        #[arg(long, env = "USER")]
        operator: String,
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
pub enum GapsAction {
    /// Open gaps, oldest first: in grace (late events are normal) or due for backfill.
    List {
        #[arg(long)]
        source: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: i64,
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
        DeadLettersAction::Replay(filter) => replay(backend, json, &filter).await,
        DeadLettersAction::Discard { ids } => {
            let mut changed = Vec::new();
            let mut result = Ok(0);
            for id in ids {
                match backend
                    .call::<Changed>(&OperatorRequest::SetDeadLetterStatus {
                        dead_letter_id: id,
                        status: "discarded".into(),
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

/// How many letters one replay request carries: small enough that each answers quickly and the
/// progress bar moves, large enough that thousands take a few dozen requests.
const REPLAY_CHUNK: usize = 25;

/// Lists the matching letters, then replays them in chunks by id with a progress bar on a
/// terminal (nothing when stderr is piped). Exit 1 when some failed again.
async fn replay(backend: &Backend, json: bool, filter: &LetterFilter) -> Result<Exit, CallError> {
    let letters = backend
        .call::<Letters>(&OperatorRequest::ListDeadLetters {
            filter: filter.to_filter(),
        })
        .await?
        .dead_letters;
    let bar = ProgressBar::new(letters.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("replaying {bar:40} {pos}/{len} {msg} ({eta} left)")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut total = ReplayOutcome::default();
    for chunk in letters.chunks(REPLAY_CHUNK) {
        let ids = chunk.iter().map(|l| l.dead_letter_id).collect();
        let done = backend
            .call::<ReplayOutcome>(&OperatorRequest::Replay {
                filter: ReplayFilter {
                    ids,
                    ..ReplayFilter::default()
                },
            })
            .await?;
        total.selected += done.selected;
        total.replayed += done.replayed;
        total.failed += done.failed;
        total.skipped += done.skipped;
        bar.inc(chunk.len() as u64);
        bar.set_message(format!("{} failed again", total.failed));
    }
    bar.finish_and_clear();
    show(json, &total, render::replay);
    Ok(if total.failed > 0 { 1 } else { 0 })
}

#[derive(Deserialize, serde::Serialize)]
struct FailedOutbox {
    failed_outbox: Vec<FailedMessage>,
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
        OutboxAction::Resend(filter) => backend
            .call::<Resent>(&OperatorRequest::ResendOutbox {
                filter: filter.to_filter(),
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
            }),
        OutboxAction::Discard { ids: asked } => backend
            .call::<Discarded>(&OperatorRequest::DiscardOutbox { outbox_ids: asked })
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
            }),
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
            tenant,
            source,
            external_id,
            reason,
            operator,
            sequence,
        } => backend
            .call::<Tombstoned>(&OperatorRequest::Tombstone {
                tenant_id: tenant,
                source_id: source,
                external_id,
                sequence,
                reason,
                operator,
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
    let GapsAction::List { source, limit } = action;
    let request = OperatorRequest::ListGaps {
        source_id: source,
        limit: Some(limit),
    };
    answer(backend, json, request, |g: &Gaps| render::gaps(&g.gaps)).await
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
