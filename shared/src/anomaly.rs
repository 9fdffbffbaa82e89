//! The anomaly checks: more than thirty measurements of the pipeline, each with an expected
//! range, in five families (latency, referential, integrity, flow, machinery). A run brings the
//! hourly delivery figures and the last day's changes up to date ([`delivery_hours::roll`]: the
//! hours and events that changed, not the 29 days), refreshes the materialized view
//! `processing_latency` `CONCURRENTLY` (over the latencies the drain recorded in the last
//! hour), sweeps a bounded window of the last day's events for the two consistency checks
//! ([`consistency_sweep`]), measures every check, stores every result in `anomaly_results` and
//! publishes them as metrics; the alarm on `AnomalyBreaches` notifies on-call and invokes
//! reconciliation (for every breach but those in [`ON_CALL_ONLY`]).
//!
//! Fixed thresholds suit most checks; flow per source would either nag or miss with one, so each
//! source's last complete hour is judged against the same hour of the week in its own history
//! (up to four weeks): silence is far fewer events than usual, a spike far more.
//!
//! Beside the SQS buffer ([`run_once_with_buffer`]), a buffered event is not missing: while the
//! buffer may hold deliveries of the judged hour (it holds any, and CloudWatch's age of its oldest
//! does not show them all sent after that hour ended; or it cannot be counted) no source is
//! judged silent, because its events may be waiting there with their received times. In `queue`
//! mode the buffer is never empty, but a consumer that keeps up leaves nothing older than
//! seconds. `buffer_dead_letters` counts what the buffer's consumer gave up on.

use std::collections::HashMap;

use chrono::DurationRound;

use serde::Serialize;
use sqlx::PgPool;

use crate::buffer::{BufferQueue, BufferReading};
use crate::maintenance::{self, RunCounts};
use crate::store::StoreError;
use crate::store::anomaly::{self, CheckResult, GlobalCheck, SourceFlow};
use crate::store::consistency_sweep::{self, Swept};
use crate::store::delivery_hours;

#[derive(Debug, Clone)]
pub struct AnomalySettings {
    /// Replaces a check's expected range: check name → (low, high).
    pub ranges: HashMap<&'static str, (Option<f64>, Option<f64>)>,
    /// A source whose usual hour has fewer events than this is not judged for silence.
    pub silence_min_baseline: f64,
    /// A source needs this many weeks of history before its flow is judged.
    pub min_weeks: i64,
    /// Events of the last day the consistency sweep examines per run, at most (see
    /// [`consistency_sweep`]).
    pub sweep_window_events: i64,
}

impl Default for AnomalySettings {
    fn default() -> Self {
        Self {
            ranges: HashMap::new(),
            silence_min_baseline: 5.0,
            min_weeks: 2,
            sweep_window_events: 50_000,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct AnomalyReport {
    pub run_id: i64,
    pub checks: usize,
    pub breaches: Vec<String>,
}

// Issue 23.
/// Checks whose breach is not counted in `AnomalyBreaches`, whose alarm invokes reconcile: they
/// have alarms of their own that notify on-call only. `reconcile_repairs_last_day` breaches
/// because reconcile repaired something: invoking it again would repair nothing and only hide
/// the signal in its own noise. The breach is stored, listed and shown by `hookctl status`
/// like any other.
pub const ON_CALL_ONLY: &[&str] = &["reconcile_repairs_last_day"];

/// How many global checks there are (the per-source flow checks come on top).
pub fn global_check_count() -> usize {
    anomaly::GLOBAL_CHECKS.len() + 1
}

/// Deliveries in the buffer's dead-letter queue: the consumer failed on each `maxReceiveCount`
/// times and none is stored (measured from SQS, not SQL: the statement is empty).
pub const BUFFER_DEAD_LETTERS: GlobalCheck = GlobalCheck {
    name: "buffer_dead_letters",
    family: "machinery",
    sql: "",
    low: Some(0.0),
    high: Some(0.0),
};

/// One anomaly run, without an SQS buffer.
pub async fn run_once(
    pool: &PgPool,
    settings: &AnomalySettings,
    trigger: &str,
) -> Result<AnomalyReport, StoreError> {
    run_once_with_buffer(pool, settings, trigger, None).await
}

/// One anomaly run, beside the SQS buffer when there is one (`BUFFER_QUEUE_URL`): its depth and
/// its oldest delivery's age are read once, before the checks.
#[tracing::instrument(skip(pool, settings, buffer), err)]
pub async fn run_once_with_buffer(
    pool: &PgPool,
    settings: &AnomalySettings,
    trigger: &str,
    buffer: Option<&BufferQueue>,
) -> Result<AnomalyReport, StoreError> {
    let buffer = match buffer {
        Some(queue) => Some(queue.read().await),
        None => None,
    };
    let buffer = &buffer;
    let (run_id, Results(results)) =
        maintenance::recorded(pool, "anomaly", trigger, |run_id| async move {
            let results = match measure_all(pool, settings, buffer.as_ref()).await {
                Ok(results) => results,
                Err(e) => return (Results(Vec::new()), Err(e)),
            };
            let stored = anomaly::record(pool, run_id, &results).await;
            (Results(results), stored)
        })
        .await?;
    let breaches: Vec<String> = results
        .iter()
        .filter(|r| r.breached)
        .map(|r| {
            if r.subject.is_empty() {
                r.check_name.clone()
            } else {
                format!("{}:{}", r.check_name, r.subject)
            }
        })
        .collect();
    for r in results.iter().filter(|r| r.subject.is_empty()) {
        if let Some(v) = r.value {
            crate::metrics::anomaly_value(&r.check_name, v);
        }
    }
    // The alarm on this count also invokes reconcile: what only pages on-call is left out.
    let for_reconcile = results
        .iter()
        .filter(|r| r.breached && !ON_CALL_ONLY.contains(&r.check_name.as_str()))
        .count();
    crate::metrics::anomaly_breaches(for_reconcile);
    if breaches.is_empty() {
        tracing::debug!(run_id, checks = results.len(), "anomaly checks passed");
    } else {
        tracing::warn!(
            run_id,
            checks = results.len(),
            breaches = %breaches.join(","),
            "anomaly checks breached"
        );
    }
    Ok(AnomalyReport {
        run_id,
        checks: results.len(),
        breaches,
    })
}

/// A run's results; its run row keeps the count and the breaches.
struct Results(Vec<CheckResult>);

impl RunCounts for Results {
    fn found(&self) -> serde_json::Value {
        let breaches: Vec<&CheckResult> = self.0.iter().filter(|r| r.breached).collect();
        serde_json::json!({ "checks": self.0.len(), "breaches": breaches })
    }
    fn repaired(&self) -> serde_json::Value {
        serde_json::json!({})
    }
}

async fn measure_all(
    pool: &PgPool,
    settings: &AnomalySettings,
    buffer: Option<&BufferReading>,
) -> Result<Vec<CheckResult>, StoreError> {
    let mut results = vec![judge(
        &anomaly::VIEW_REFRESH_AGE,
        anomaly::measure(pool, &anomaly::VIEW_REFRESH_AGE).await?,
        settings,
    )];
    let rolled = delivery_hours::roll(pool).await?;
    tracing::debug!(?rolled, "delivery hours rolled up");
    anomaly::refresh_views(pool).await?;
    let swept = consistency_sweep::sweep(pool, settings.sweep_window_events).await?;
    tracing::debug!(?swept, "the last day's events swept");
    for check in anomaly::GLOBAL_CHECKS {
        let mut result = judge(check, anomaly::measure(pool, check).await?, settings);
        if consistency_sweep::CHECKS.contains(&check.name) {
            result.detail = swept_detail(&swept);
        }
        results.push(result);
    }
    // The judged hour is the last complete one: it ended at the top of this hour.
    let judged_hour_end = chrono::Utc::now()
        .duration_trunc(chrono::TimeDelta::hours(1))
        .unwrap_or_else(|_| chrono::Utc::now());
    let holding = buffer.and_then(|b| buffer_holds(b, judged_hour_end));
    for flow in anomaly::source_flow(pool).await? {
        let [silence, spike] = judge_flow(&flow, settings);
        results.push(match &holding {
            Some(why) => not_judged(silence, why),
            None => silence,
        });
        results.push(spike);
    }
    if let Some(reading) = buffer {
        results.push(match &reading.depth {
            Ok(d) => judge(&BUFFER_DEAD_LETTERS, Some(d.dead_letters as f64), settings),
            Err(error) => CheckResult {
                detail: format!("the buffer could not be counted: {error}"),
                ..judge(&BUFFER_DEAD_LETTERS, None, settings)
            },
        });
    }
    Ok(results)
}

/// What a swept check's value counts, and what this run's sweep examined.
fn swept_detail(swept: &Swept) -> String {
    let window = match (swept.from, swept.through) {
        (Some(from), Some(through)) => format!(
            "the {} events first received from {} to {} UTC",
            swept.events,
            from.format("%Y-%m-%d %H:%M:%S"),
            through.format("%Y-%m-%d %H:%M:%S")
        ),
        _ if swept.new_cycle => "no event: none was first received in the last day".to_owned(),
        _ => "no event: none in the day is older than the last window's".to_owned(),
    };
    let cycle = if swept.cycle_ended {
        "the cycle reached the day's oldest event; the next run starts again from the newest"
    } else {
        "the cycle goes on from here at the next run"
    };
    format!(
        "events of the last day the sweep found faulty and has not found repaired since; this run \
         checked {} of them again ({} repaired or a day old) and examined {window}, newest first, \
         in the cycle started {} UTC: {cycle}",
        swept.rechecked,
        swept.dropped,
        swept.cycle_started_at.format("%Y-%m-%d %H:%M:%S")
    )
}

/// Why silence is not judged now: the buffer may hold deliveries of the judged hour (any
/// source's: SQS cannot say whose), or it cannot be counted. `None` when it is empty, or when
/// CloudWatch's newest age of its oldest delivery shows every one sent after the hour ended.
fn buffer_holds(
    reading: &BufferReading,
    judged_hour_end: chrono::DateTime<chrono::Utc>,
) -> Option<String> {
    let depth = match &reading.depth {
        Ok(d) if d.buffered() == 0 => return None,
        Ok(d) => d,
        Err(error) => {
            return Some(format!(
                "the SQS buffer could not be counted ({error}): silence is judged once it can be"
            ));
        }
    };
    if let Ok(Some(oldest)) = &reading.oldest {
        let sent =
            oldest.measured_at - chrono::TimeDelta::milliseconds((oldest.seconds * 1000.0) as i64);
        if sent >= judged_hour_end {
            return None;
        }
    }
    let since = match &reading.oldest {
        Ok(Some(oldest)) => format!(
            ", the oldest waiting {:.0} s at {}",
            oldest.seconds,
            oldest.measured_at.format("%H:%M:%S")
        ),
        Ok(None) => ", its oldest's age not in CloudWatch yet".to_owned(),
        Err(_) => ", its oldest's age unreadable".to_owned(),
    };
    Some(format!(
        "the SQS buffer holds {} deliveries not filed yet{since}: silence is judged once none \
         can be of the judged hour",
        depth.buffered()
    ))
}

fn not_judged(result: CheckResult, why: &str) -> CheckResult {
    CheckResult {
        breached: false,
        detail: if result.detail.is_empty() {
            why.to_owned()
        } else {
            format!("{}; {why}", result.detail)
        },
        ..result
    }
}

fn judge(check: &GlobalCheck, value: Option<f64>, settings: &AnomalySettings) -> CheckResult {
    let (low, high) = settings
        .ranges
        .get(check.name)
        .copied()
        .unwrap_or((check.low, check.high));
    let breached = value.is_some_and(|v| low.is_some_and(|l| v < l) || high.is_some_and(|h| v > h));
    CheckResult {
        check_name: check.name.to_owned(),
        family: check.family,
        subject: String::new(),
        value,
        expected_low: low,
        expected_high: high,
        breached,
        detail: if value.is_none() {
            "nothing to measure yet".into()
        } else {
            String::new()
        },
    }
}

/// Silence and spike of one source's last complete hour against its own hour-of-week history.
fn judge_flow(flow: &SourceFlow, settings: &AnomalySettings) -> [CheckResult; 2] {
    let result =
        |name: &str, low: Option<f64>, high: Option<f64>, breached: bool, detail: String| {
            CheckResult {
                check_name: name.to_owned(),
                family: "flow",
                subject: flow.source_id.clone(),
                value: Some(flow.last_hour),
                expected_low: low,
                expected_high: high,
                breached,
                detail,
            }
        };
    let (Some(mean), true) = (flow.mean, flow.weeks >= settings.min_weeks) else {
        let why = format!(
            "{} week(s) of history; judged from {}",
            flow.weeks, settings.min_weeks
        );
        return [
            result("source_silence", None, None, false, why.clone()),
            result("source_spike", None, None, false, why),
        ];
    };
    let sd = flow.stddev.unwrap_or(0.0);
    let detail = format!(
        "last hour {} vs {:.1} ± {:.1} over {} weeks",
        flow.last_hour, mean, sd, flow.weeks
    );
    let silence_low = (mean >= settings.silence_min_baseline).then(|| (mean - 3.0 * sd).max(1.0));
    let spike_high = mean + 4.0 * sd + 10.0;
    [
        result(
            "source_silence",
            silence_low,
            None,
            silence_low.is_some_and(|l| flow.last_hour < l),
            detail.clone(),
        ),
        result(
            "source_spike",
            None,
            Some(spike_high),
            flow.last_hour > spike_high,
            detail,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(last_hour: f64, mean: f64, sd: f64, weeks: i64) -> SourceFlow {
        SourceFlow {
            source_id: "s".into(),
            last_hour,
            mean: Some(mean),
            stddev: Some(sd),
            weeks,
        }
    }

    #[test]
    fn there_are_at_least_thirty_checks_in_every_family() {
        assert!(global_check_count() >= 30, "{}", global_check_count());
        for family in ["latency", "referential", "integrity", "flow", "machinery"] {
            assert!(
                anomaly::GLOBAL_CHECKS.iter().any(|c| c.family == family),
                "{family}"
            );
        }
        let mut names: Vec<_> = anomaly::GLOBAL_CHECKS.iter().map(|c| c.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(
            names.len(),
            anomaly::GLOBAL_CHECKS.len(),
            "check names are unique"
        );
    }

    #[test]
    fn silence_waits_only_while_the_buffer_may_hold_the_judged_hour() {
        use crate::buffer::{OldestAge, QueueError};
        let hour_end = chrono::DateTime::parse_from_rfc3339("2026-12-02T05:00:00Z")
            .unwrap()
            .to_utc();
        let at = |minutes: i64| hour_end + chrono::TimeDelta::minutes(minutes);
        let reading = BufferReading::waiting;
        let age = |seconds: f64, measured: i64| {
            Ok(Some(OldestAge {
                seconds,
                measured_at: at(measured),
            }))
        };
        // Empty: nothing held, whatever the metric says.
        assert!(buffer_holds(&reading(0, age(7200.0, 5)), hour_end).is_none());
        // Queue mode keeping up: deliveries wait, the oldest sent after the hour ended.
        assert!(buffer_holds(&reading(40, age(2.0, 5)), hour_end).is_none());
        // The oldest sent before the hour ended (measured 05:05 after 2 h: sent 03:05), or a
        // datapoint from before it ended: it may be the judged hour's.
        let held = buffer_holds(&reading(40, age(7200.0, 5)), hour_end).unwrap();
        assert!(held.contains("holds 40 deliveries"), "{held}");
        assert!(held.contains("oldest waiting 7200 s at 05:05:00"), "{held}");
        assert!(buffer_holds(&reading(40, age(2.0, -3)), hour_end).is_some());
        // No datapoint, or CloudWatch unreadable: held while anything waits.
        assert!(buffer_holds(&reading(1, Ok(None)), hour_end).is_some());
        let unreadable = Err(QueueError::CloudWatch {
            operation: "GetMetricData",
            reason: "timeout".into(),
        });
        assert!(buffer_holds(&reading(1, unreadable), hour_end).is_some());
        // Not countable: held.
        let blind = BufferReading {
            depth: Err(QueueError::NoDeadLetterQueue),
            oldest: Ok(None),
        };
        assert!(
            buffer_holds(&blind, hour_end)
                .unwrap()
                .contains("could not be counted")
        );
    }

    #[test]
    fn the_on_call_only_checks_are_checks() {
        for name in ON_CALL_ONLY {
            assert!(
                anomaly::GLOBAL_CHECKS.iter().any(|c| c.name == *name),
                "{name}"
            );
        }
    }

    #[test]
    fn flow_is_judged_against_the_source_own_history() {
        let s = AnomalySettings::default();
        let [silence, spike] = judge_flow(&flow(0.0, 20.0, 2.0, 4), &s);
        assert!(silence.breached && !spike.breached);
        let [silence, spike] = judge_flow(&flow(200.0, 20.0, 2.0, 4), &s);
        assert!(!silence.breached && spike.breached);
        let [silence, spike] = judge_flow(&flow(18.0, 20.0, 2.0, 4), &s);
        assert!(!silence.breached && !spike.breached);
        // A quiet source is never silent; a new one is not judged.
        assert!(!judge_flow(&flow(0.0, 2.0, 1.0, 4), &s)[0].breached);
        assert!(!judge_flow(&flow(0.0, 20.0, 2.0, 1), &s)[0].breached);
    }

    #[test]
    fn a_missing_measurement_never_breaches_and_overrides_apply() {
        let check = anomaly::GLOBAL_CHECKS[0];
        assert!(!judge(&check, None, &AnomalySettings::default()).breached);
        let mut s = AnomalySettings::default();
        s.ranges.insert(check.name, (Some(0.0), Some(1.0)));
        assert!(judge(&check, Some(2.0), &s).breached);
    }
}
