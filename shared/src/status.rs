//! The operator's one question, "did we lose anything?", answered from the database: a verdict
//! first (every event accounted for, or the list of what is not), then the evidence per source,
//! the queue and the maintenance passes. The operator function and `hookctl` both call
//! [`report`], so a verdict read through the deployed function and one read directly are the
//! same computation; the CLI only renders it.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::store::anomaly::{SourceFlow, StoredResult};
use crate::store::maintenance_runs::LatestRun;
use crate::store::outbox::OutboxCounts;
use crate::store::unrepaired_losses::LossCounts;
use crate::store::webhook_events::SourceActivity;
use crate::store::{self, StoreError};

/// What counts as "needs a human". The defaults match the reconciler's SLA and the anomaly
/// checks' machinery ranges, so `status` and the alarms agree.
#[derive(Debug, Clone)]
pub struct StatusSettings {
    /// An event waiting longer than this is pending past its SLA (reconcile's `pending_sla`).
    pub pending_sla: Duration,
    /// How long after its grace period a gap may stay open while backfill works on it.
    pub gap_allowance: Duration,
    /// An outbox message waiting longer than this is overdue (the `outbox_overdue_rows` check).
    pub outbox_overdue: Duration,
    /// Per job, how long since its last completed run before it has stopped running: three
    /// schedule periods, the ranges of the `last_*_age_seconds` checks.
    pub pass_max_age: Vec<(&'static str, Duration)>,
    /// The oldest buffered delivery waiting longer than this needs a human: the default of the
    /// stack's `BufferOldestAgeThresholdSeconds`.
    pub buffer_oldest_age: Duration,
    /// While the SQS buffer holds deliveries, a gap younger than this (plus the allowance) is
    /// not missing yet: backfill's `BUFFER_GAP_HOLD_SECONDS`.
    pub buffer_gap_hold: Duration,
}

impl Default for StatusSettings {
    fn default() -> Self {
        Self {
            pending_sla: Duration::from_secs(15 * 60),
            gap_allowance: Duration::from_secs(15 * 60),
            outbox_overdue: Duration::from_secs(60 * 60),
            pass_max_age: vec![
                ("reconcile", Duration::from_secs(45 * 60)),
                ("backfill", Duration::from_secs(30 * 60)),
                ("retention", Duration::from_secs(3 * 3600)),
                ("anomaly", Duration::from_secs(30 * 60)),
            ],
            buffer_oldest_age: Duration::from_secs(300),
            buffer_gap_hold: Duration::from_secs(3600),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Every event accounted for: nothing waits on a human.
    AccountedFor,
    /// Something needs a human: see the findings.
    NeedsAttention,
}

/// What keeps the verdict from "accounted for".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    PendingPastSla,
    OpenDeadLetters,
    OpenGaps,
    BreachingChecks,
    FailedOutbox,
    OverdueOutbox,
    /// Processed events whose effect or outbox row reconcile found missing and could not
    /// repair (payload purged, or the repair failed).
    UnrepairedLosses,
    PassStopped,
    /// Buffered deliveries in the SQS buffer's dead-letter queue: the consumer failed on each
    /// repeatedly; none is stored until it is re-driven.
    BufferDeadLetters,
    /// The SQS buffer could not be counted: what it holds is not known to be accounted for.
    BufferUnknown,
    /// The oldest buffered delivery has waited past the limit: the buffer function is not
    /// filing (the database refuses it, or it fails), or cannot keep up.
    BufferNotDraining,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    pub kind: FindingKind,
    pub count: i64,
    /// What it is, in a sentence.
    pub detail: String,
    /// The command that shows more or acts on it.
    pub next: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceStatus {
    #[serde(flatten)]
    pub activity: SourceActivity,
    /// Signed deliveries refused in the last day (400: unreadable, no id, unusable field).
    pub refused_last_day: i64,
    /// The last complete hour against the same hour of the week in the source's own history
    /// (from the anomaly views; `None` when the views have no row for it yet).
    pub usual_hour: Option<SourceFlow>,
    /// Its events waiting in the queue, and how long the oldest has waited (0 when none). Read
    /// over the earliest ready [`SOURCE_BACKLOG_CAP`] queue rows: past that, a lower bound, and
    /// `pending_capped` says so.
    #[serde(default)]
    pub pending: i64,
    #[serde(default)]
    pub oldest_pending_age_seconds: f64,
    #[serde(default)]
    pub pending_capped: bool,
    /// Its open gaps, in grace or past it.
    #[serde(default)]
    pub open_gaps: i64,
}

/// How many queue rows the per-source backlog reads at most (the whole queue's depth is exact).
pub const SOURCE_BACKLOG_CAP: i64 = 10_000;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueueStatus {
    pub depth: i64,
    pub oldest_pending_age_seconds: f64,
    pub pending_past_sla: i64,
    pub pending_sla_seconds: f64,
}

/// The SQS buffer (issue 21): deliveries SQS acknowledged and the consumer has not filed yet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BufferStatus {
    /// Waiting for the consumer: accounted for (they will be filed).
    pub waiting: u64,
    /// Received by the consumer, not yet filed or returned: accounted for.
    pub in_flight: u64,
    /// Sent with a delay, not yet visible: accounted for.
    pub delayed: u64,
    /// In the buffer's dead-letter queue: NOT accounted for until re-driven
    /// (`hookctl buffer list`, `hookctl buffer redrive`).
    pub dead_letters: u64,
    /// Why the buffer could not be counted (then the counts are 0 and mean nothing).
    pub unknown: Option<String>,
    /// How long the oldest buffered delivery has waited: CloudWatch's
    /// `ApproximateAgeOfOldestMessage`, its newest datapoint of the last 15 minutes (`None`: no
    /// datapoint that recent, as for a queue idle for hours, or see `oldest_age_unknown`).
    #[serde(default)]
    pub oldest_age_seconds: Option<f64>,
    /// When CloudWatch measured that age.
    #[serde(default)]
    pub oldest_measured_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Why the age could not be read (the counts above still stand).
    #[serde(default)]
    pub oldest_age_unknown: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PassStatus {
    #[serde(flatten)]
    pub latest: LatestRun,
    /// Whether this pass has work here (backfill only with a source that has gap detection).
    pub expected: bool,
    pub max_age_seconds: f64,
    pub stopped: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatusReport {
    pub verdict: Verdict,
    pub findings: Vec<Finding>,
    pub sources: Vec<SourceStatus>,
    pub queue: QueueStatus,
    pub outbox: OutboxCounts,
    /// What reconcile found lost and could not repair, standing now.
    #[serde(default)]
    pub unrepaired_losses: LossCounts,
    pub open_dead_letters: i64,
    /// Open gaps past their grace period and allowance, and those still being handled.
    pub open_gaps: i64,
    pub gaps_in_grace: i64,
    /// Of `open_gaps`, those young enough that an SQS buffer holding deliveries explains them
    /// (backfill holds them too): [`StatusReport::with_buffer`] counts them in grace then. Read
    /// for that alone, never shown.
    #[serde(skip)]
    gaps_within_buffer_hold: i64,
    pub passes: Vec<PassStatus>,
    /// Every subscription: its undelivered and failed messages, the oldest's age, paused or not.
    #[serde(default)]
    pub subscriptions: Vec<crate::store::subscriptions::Undelivered>,
    /// The checks that breached in the latest anomaly run.
    pub breaching_checks: Vec<StoredResult>,
    /// When the latest anomaly run measured (`None`: never).
    pub checks_measured_at: Option<chrono::DateTime<chrono::Utc>>,
    /// The SQS buffer, when one is configured (see [`StatusReport::with_buffer`]). The age of its
    /// oldest message is CloudWatch's `ApproximateAgeOfOldestMessage`, not a queue attribute.
    #[serde(default)]
    pub buffer: Option<BufferStatus>,
}

impl StatusReport {
    /// Adds the SQS buffer's counts and its oldest delivery's age (or why they could not be read)
    /// and their findings: any dead letter in the buffer, a buffer that cannot be counted, or
    /// one whose oldest delivery has waited past `settings.buffer_oldest_age` needs a human.
    pub fn with_buffer(
        mut self,
        reading: crate::buffer::BufferReading,
        settings: &StatusSettings,
    ) -> Self {
        // A buffered event is not missing: while the buffer may hold late deliveries (or cannot
        // be counted), gaps within the hold are in grace, as backfill treats them.
        let holding = reading.holds_late_deliveries(chrono::Utc::now());
        let mut buffer = match reading.depth {
            Ok(d) => BufferStatus {
                waiting: d.waiting,
                in_flight: d.in_flight,
                delayed: d.delayed,
                dead_letters: d.dead_letters,
                unknown: None,
                oldest_age_seconds: None,
                oldest_measured_at: None,
                oldest_age_unknown: None,
            },
            Err(error) => BufferStatus {
                waiting: 0,
                in_flight: 0,
                delayed: 0,
                dead_letters: 0,
                unknown: Some(error.to_string()),
                oldest_age_seconds: None,
                oldest_measured_at: None,
                oldest_age_unknown: None,
            },
        };
        if holding {
            let held = self.gaps_within_buffer_hold.min(self.open_gaps);
            self.open_gaps -= held;
            self.gaps_in_grace += held;
        }
        self.gaps_within_buffer_hold = 0;
        match reading.oldest {
            Ok(age) => {
                buffer.oldest_age_seconds = age.map(|a| a.seconds);
                buffer.oldest_measured_at = age.map(|a| a.measured_at);
            }
            Err(error) => buffer.oldest_age_unknown = Some(error.to_string()),
        }
        // The findings again, from the counts as the buffer leaves them.
        self.findings = findings(
            &self.queue,
            &self.outbox,
            &self.unrepaired_losses,
            self.open_dead_letters,
            self.open_gaps,
            &self.passes,
            &self.breaching_checks,
        );
        self.findings
            .extend(buffer_findings(&buffer, settings.buffer_oldest_age));
        self.verdict = if self.findings.is_empty() {
            Verdict::AccountedFor
        } else {
            Verdict::NeedsAttention
        };
        self.buffer = Some(buffer);
        self
    }

    /// The process exit code `hookctl status` gives: 0 accounted for, 1 needs a human.
    pub fn exit_code(&self) -> u8 {
        match self.verdict {
            Verdict::AccountedFor => 0,
            Verdict::NeedsAttention => 1,
        }
    }
}

/// Reads everything `status` shows and decides the verdict.
#[tracing::instrument(skip_all, err)]
pub async fn report(pool: &PgPool, settings: &StatusSettings) -> Result<StatusReport, StoreError> {
    let sla = settings.pending_sla.as_secs_f64();
    let (depth, oldest) = store::event_queue::backlog(pool).await?;
    let queue = QueueStatus {
        depth,
        oldest_pending_age_seconds: oldest,
        pending_past_sla: store::reconcile::pending_past_sla(pool, sla).await?,
        pending_sla_seconds: sla,
    };
    let outbox = store::outbox::counts(pool, settings.outbox_overdue.as_secs_f64()).await?;
    // A table as small as the losses, whichever part of `webhook_events` reconcile last read.
    let unrepaired_losses = store::unrepaired_losses::counts(pool).await?;
    let open_dead_letters = store::dead_letters::count_open(pool).await?;
    let gaps = store::gaps::count_open_past_grace(
        pool,
        settings.gap_allowance.as_secs_f64(),
        settings.buffer_gap_hold.as_secs_f64(),
    )
    .await?;
    let (open_gaps, gaps_in_grace) = (gaps.past_grace, gaps.in_grace);
    let subscriptions = store::subscriptions::undelivered(pool).await?;
    let checks = store::anomaly::latest_results(pool).await?;
    let checks_measured_at = checks.first().map(|c| c.measured_at);
    let breaching_checks: Vec<StoredResult> = checks.into_iter().filter(|c| c.breached).collect();

    let refused = store::ingest_anomalies::refused_last_day_by_source(pool).await?;
    let flows = store::anomaly::source_flow(pool).await?;
    let (backlogs, pending_capped) =
        store::event_queue::backlog_by_source(pool, SOURCE_BACKLOG_CAP).await?;
    let gaps_by_source = store::gaps::count_open_by_source(pool).await?;
    let sources: Vec<SourceStatus> = store::webhook_events::activity_by_source(pool)
        .await?
        .into_iter()
        .map(|activity| {
            let backlog = backlogs.iter().find(|b| b.source_id == activity.source_id);
            SourceStatus {
                pending: backlog.map_or(0, |b| b.pending),
                oldest_pending_age_seconds: backlog.map_or(0.0, |b| b.oldest_pending_age_seconds),
                pending_capped,
                open_gaps: gaps_by_source
                    .iter()
                    .find(|(id, _)| *id == activity.source_id)
                    .map_or(0, |(_, n)| *n),
                refused_last_day: refused
                    .iter()
                    .find(|(id, _)| *id == activity.source_id)
                    .map_or(0, |(_, n)| *n),
                usual_hour: flows
                    .iter()
                    .find(|f| f.source_id == activity.source_id)
                    .cloned(),
                activity,
            }
        })
        .collect();

    let has_gap_sources = crate::sources::list(pool)
        .await?
        .iter()
        .any(|s| s.enabled && s.gaps.is_some());
    let running_for = store::sources::oldest_age_seconds(pool).await?;
    let passes: Vec<PassStatus> = store::maintenance_runs::latest_by_job(pool)
        .await?
        .into_iter()
        .map(|latest| {
            let max_age = settings
                .pass_max_age
                .iter()
                .find(|(job, _)| *job == latest.job)
                .map_or(f64::INFINITY, |(_, d)| d.as_secs_f64());
            let expected = latest.job != "backfill" || has_gap_sources;
            // Never completed: stopped once the system has been up longer than the allowance.
            let age = latest.completed_age_seconds.or(running_for);
            let stopped = expected && age.is_some_and(|a| a > max_age);
            PassStatus {
                latest,
                expected,
                max_age_seconds: max_age,
                stopped,
            }
        })
        .collect();

    let findings = findings(
        &queue,
        &outbox,
        &unrepaired_losses,
        open_dead_letters,
        open_gaps,
        &passes,
        &breaching_checks,
    );
    Ok(StatusReport {
        verdict: if findings.is_empty() {
            Verdict::AccountedFor
        } else {
            Verdict::NeedsAttention
        },
        findings,
        sources,
        queue,
        outbox,
        unrepaired_losses,
        open_dead_letters,
        open_gaps,
        gaps_in_grace,
        gaps_within_buffer_hold: gaps.within_buffer_hold,
        passes,
        subscriptions,
        breaching_checks,
        checks_measured_at,
        buffer: None,
    })
}

/// What in the SQS buffer needs a human. Pure.
pub fn buffer_findings(buffer: &BufferStatus, oldest_limit: Duration) -> Vec<Finding> {
    let mut out = Vec::new();
    if let Some(reason) = &buffer.unknown {
        out.push(Finding {
            kind: FindingKind::BufferUnknown,
            count: 1,
            detail: format!(
                "the SQS buffer could not be counted ({reason}): deliveries buffered there are \
                 not known to be accounted for"
            ),
            next: "hookctl buffer list".into(),
        });
    }
    if buffer.dead_letters > 0 {
        out.push(Finding {
            kind: FindingKind::BufferDeadLetters,
            count: i64::try_from(buffer.dead_letters).unwrap_or(i64::MAX),
            detail: format!(
                "{} buffered delivery(ies) in the buffer's dead-letter queue are NOT accounted \
                 for: the consumer failed on each repeatedly and none is stored; SQS deletes \
                 them 14 days after they were buffered",
                buffer.dead_letters
            ),
            next: "hookctl buffer list, then hookctl buffer redrive".into(),
        });
    }
    // Only while something is buffered: the metric's last datapoint outlives the message by up
    // to a minute or two.
    if let Some(age) = buffer.oldest_age_seconds
        && age > oldest_limit.as_secs_f64()
        && buffer.unknown.is_none()
        && buffer.waiting + buffer.in_flight + buffer.delayed > 0
    {
        out.push(Finding {
            kind: FindingKind::BufferNotDraining,
            count: i64::try_from(buffer.waiting + buffer.in_flight + buffer.delayed)
                .unwrap_or(i64::MAX),
            detail: format!(
                "the oldest buffered delivery has waited {age:.0} s (more than {} s): the buffer \
                 function is not filing them (database down or refusing, errors in its log) or \
                 cannot keep up; each is accounted for while it waits, until the consumer has \
                 failed on it maxReceiveCount times (the stack: 5) and SQS moves it to the \
                 dead-letter queue",
                oldest_limit.as_secs()
            ),
            next: "aws logs tail /aws/lambda/<stack>-buffer --since 1h".into(),
        });
    }
    out
}

/// What needs a human, most urgent first. Pure: the verdict is a function of the counts.
pub fn findings(
    queue: &QueueStatus,
    outbox: &OutboxCounts,
    losses: &LossCounts,
    open_dead_letters: i64,
    open_gaps: i64,
    passes: &[PassStatus],
    breaching: &[StoredResult],
) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut add = |kind, count: i64, detail: String, next: &str| {
        if count > 0 {
            out.push(Finding {
                kind,
                count,
                detail,
                next: next.to_owned(),
            });
        }
    };
    add(
        FindingKind::PendingPastSla,
        queue.pending_past_sla,
        format!(
            "{} event(s) waiting longer than the {:.0} s SLA (oldest {:.0} s)",
            queue.pending_past_sla, queue.pending_sla_seconds, queue.oldest_pending_age_seconds
        ),
        "hookctl runs list --job reconcile",
    );
    add(
        FindingKind::OpenDeadLetters,
        open_dead_letters,
        format!("{open_dead_letters} open dead letter(s): replay or discard each"),
        "hookctl dead-letters list",
    );
    add(
        FindingKind::OpenGaps,
        open_gaps,
        format!("{open_gaps} event(s) the provider sent that backfill has not recovered"),
        "hookctl gaps list",
    );
    let names: Vec<String> = breaching
        .iter()
        .map(|c| {
            if c.subject.is_empty() {
                c.check_name.clone()
            } else {
                format!("{}:{}", c.check_name, c.subject)
            }
        })
        .collect();
    add(
        FindingKind::BreachingChecks,
        breaching.len() as i64,
        format!(
            "{} anomaly check(s) outside their range: {}",
            breaching.len(),
            names.join(", ")
        ),
        "hookctl checks list",
    );
    add(
        FindingKind::FailedOutbox,
        outbox.failed,
        format!(
            "{} outbox message(s) failed for good: their side effect never reached the target",
            outbox.failed
        ),
        "hookctl outbox list",
    );
    add(
        FindingKind::OverdueOutbox,
        outbox.overdue,
        format!(
            "{} outbox message(s) undelivered for over an hour",
            outbox.overdue
        ),
        "hookctl runs list --job reconcile",
    );
    add(
        FindingKind::UnrepairedLosses,
        losses.total(),
        format!(
            "{} processed event(s) lost an effect or outbox row that reconcile cannot repair \
             ({} with the payload purged, {} whose repair failed)",
            losses.total(),
            losses.payload_purged,
            losses.repair_failed
        ),
        "hookctl runs list --job reconcile",
    );
    let stopped: Vec<&str> = passes
        .iter()
        .filter(|p| p.stopped)
        .map(|p| p.latest.job.as_str())
        .collect();
    add(
        FindingKind::PassStopped,
        stopped.len() as i64,
        format!(
            "maintenance pass(es) not completed within three schedule periods: {}",
            stopped.join(", ")
        ),
        "hookctl runs list",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Duration = Duration::from_secs(300);

    fn buffer(dead_letters: u64, unknown: Option<&str>) -> BufferStatus {
        BufferStatus {
            waiting: 5,
            in_flight: 2,
            delayed: 0,
            dead_letters,
            unknown: unknown.map(Into::into),
            oldest_age_seconds: None,
            oldest_measured_at: None,
            oldest_age_unknown: None,
        }
    }

    #[test]
    fn buffer_dead_letters_are_not_accounted_for_and_name_the_commands() {
        assert!(
            buffer_findings(&buffer(0, None), LIMIT).is_empty(),
            "waiting is accounted for"
        );
        let dead = buffer_findings(&buffer(3, None), LIMIT);
        assert_eq!(dead.len(), 1);
        assert_eq!(
            (dead[0].kind, dead[0].count),
            (FindingKind::BufferDeadLetters, 3)
        );
        assert!(
            dead[0].detail.contains("NOT accounted for"),
            "{}",
            dead[0].detail
        );
        assert!(dead[0].next.contains("hookctl buffer list"));
        assert!(dead[0].next.contains("hookctl buffer redrive"));
        let unknown = buffer_findings(&buffer(0, Some("SQS GetQueueAttributes failed")), LIMIT);
        assert_eq!(unknown[0].kind, FindingKind::BufferUnknown);
    }

    #[test]
    fn a_buffer_waiting_past_the_limit_needs_a_human_and_an_unknown_age_does_not() {
        let aged = |age: Option<f64>, waiting: u64| BufferStatus {
            oldest_age_seconds: age,
            waiting,
            in_flight: 0,
            ..buffer(0, None)
        };
        let late = buffer_findings(&aged(Some(301.0), 4), LIMIT);
        assert_eq!(
            late.iter().map(|f| (f.kind, f.count)).collect::<Vec<_>>(),
            [(FindingKind::BufferNotDraining, 4)]
        );
        assert!(late[0].detail.contains("301 s"), "{}", late[0].detail);
        assert!(buffer_findings(&aged(Some(299.0), 4), LIMIT).is_empty());
        // The metric's last datapoint outlives the message: an empty buffer is not late.
        assert!(buffer_findings(&aged(Some(900.0), 0), LIMIT).is_empty());
        let unknown_age = BufferStatus {
            oldest_age_unknown: Some("CloudWatch GetMetricData failed".into()),
            ..aged(None, 4)
        };
        assert!(buffer_findings(&unknown_age, LIMIT).is_empty());
    }

    fn queue(past_sla: i64) -> QueueStatus {
        QueueStatus {
            depth: past_sla,
            oldest_pending_age_seconds: 0.0,
            pending_past_sla: past_sla,
            pending_sla_seconds: 900.0,
        }
    }

    #[test]
    fn nothing_outstanding_is_no_finding_and_each_count_is_one() {
        let none = findings(
            &queue(0),
            &OutboxCounts::default(),
            &LossCounts::default(),
            0,
            0,
            &[],
            &[],
        );
        assert!(none.is_empty());
        let outbox = OutboxCounts {
            pending: 3,
            overdue: 1,
            failed: 2,
        };
        let losses = LossCounts {
            payload_purged: 1,
            repair_failed: 1,
        };
        let kinds: Vec<FindingKind> = findings(&queue(4), &outbox, &losses, 1, 5, &[], &[])
            .into_iter()
            .map(|f| f.kind)
            .collect();
        assert_eq!(
            kinds,
            [
                FindingKind::PendingPastSla,
                FindingKind::OpenDeadLetters,
                FindingKind::OpenGaps,
                FindingKind::FailedOutbox,
                FindingKind::OverdueOutbox,
                FindingKind::UnrepairedLosses
            ]
        );
    }
}
