//! Tables for people. Every command also has `--json`, which prints the answer as the operator
//! function gave it; these renderings are for a terminal or a paste into an incident channel.

use std::fmt::Write as _;

use chrono::{DateTime, Utc};
use comfy_table::{Table, presets};
use shared::drain::ReplayOutcome;
use shared::status::{StatusReport, Verdict};
use shared::store::anomaly::StoredResult;
use shared::store::dead_letters::{DeadLetter, DeadLetterDetail};
use shared::store::gaps::{OpenGap, Tombstone};
use shared::store::maintenance_runs::RunRecord;
use shared::store::operator_actions::RecordedAction;
use shared::store::outbox::FailedMessage;

fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_style(presets::NOTHING);
    t.set_header(header.iter().map(|h| h.to_uppercase()));
    t
}

/// `3 s`, `12 min`, `5 h`, `2 d`.
pub fn age(seconds: f64) -> String {
    let s = seconds.max(0.0);
    if s < 120.0 {
        format!("{s:.0} s")
    } else if s < 7200.0 {
        format!("{:.0} min", s / 60.0)
    } else if s < 2.0 * 86400.0 {
        format!("{:.0} h", s / 3600.0)
    } else {
        format!("{:.0} d", s / 86400.0)
    }
}

fn time(at: Option<DateTime<Utc>>) -> String {
    at.map_or_else(
        || "never".to_owned(),
        |t| t.format("%Y-%m-%d %H:%M:%S").to_string(),
    )
}

fn number(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(v) if v.fract() == 0.0 && v.abs() < 1e15 => format!("{v:.0}"),
        Some(v) => format!("{v:.3}"),
    }
}

pub fn status(r: &StatusReport) -> String {
    let mut out = String::new();
    match r.verdict {
        Verdict::AccountedFor => {
            out.push_str("VERDICT: every event accounted for\n");
        }
        Verdict::NeedsAttention => {
            let _ = writeln!(
                out,
                "VERDICT: NOT accounted for: {} finding(s) need a human",
                r.findings.len()
            );
            for f in &r.findings {
                let _ = writeln!(out, "  - {}\n      next: {}", f.detail, f.next);
            }
        }
    }

    out.push_str("\nSOURCES\n");
    let mut t = table(&[
        "source",
        "tenant",
        "last delivery",
        "events 1h",
        "last full hour",
        "usual hour",
        "events 24h",
        "dupes 24h",
        "conflicts 24h",
        "held 24h",
        "refused 24h",
    ]);
    for s in &r.sources {
        let a = &s.activity;
        let (last_full, usual) = match &s.usual_hour {
            Some(f) => (
                format!("{:.0}", f.last_hour),
                match f.mean {
                    Some(mean) if f.weeks > 0 => {
                        format!("{mean:.1} ± {:.1} ({}w)", f.stddev.unwrap_or(0.0), f.weeks)
                    }
                    _ => "no history".into(),
                },
            ),
            None => ("-".into(), "no history".into()),
        };
        t.add_row(vec![
            if a.enabled {
                a.source_id.clone()
            } else {
                format!("{} (disabled)", a.source_id)
            },
            a.tenant_id.clone(),
            time(a.last_received_at),
            a.events_last_hour.to_string(),
            last_full,
            usual,
            a.events_last_day.to_string(),
            a.duplicates_last_day.to_string(),
            a.conflicts_last_day.to_string(),
            a.held_last_day.to_string(),
            s.refused_last_day.to_string(),
        ]);
    }
    let _ = writeln!(out, "{t}");

    let q = &r.queue;
    let _ = writeln!(
        out,
        "\nQUEUE         depth {}, oldest pending {}, past the {} SLA {}",
        q.depth,
        age(q.oldest_pending_age_seconds),
        age(q.pending_sla_seconds),
        q.pending_past_sla
    );
    let _ = writeln!(
        out,
        "OUTBOX        pending {}, overdue (> 1 h) {}, failed {}",
        r.outbox.pending, r.outbox.overdue, r.outbox.failed
    );
    for sub in &r.subscriptions {
        let _ = writeln!(
            out,
            "SUBSCRIPTION  {}/{}{}: undelivered {}, oldest {}, failed {}",
            sub.tenant_id,
            sub.name,
            if sub.paused { " (paused)" } else { "" },
            sub.undelivered,
            age(sub.oldest_age_seconds),
            sub.failed
        );
    }
    let _ = writeln!(out, "DEAD LETTERS  open {}", r.open_dead_letters);
    match &r.buffer {
        None => {}
        Some(b) if b.unknown.is_some() => {
            let _ = writeln!(
                out,
                "BUFFER        not counted: {}",
                b.unknown.as_deref().unwrap_or_default()
            );
        }
        Some(b) => {
            let oldest = match (&b.oldest_age_unknown, b.oldest_age_seconds) {
                (Some(why), _) => format!("oldest unknown ({why})"),
                (None, Some(seconds)) => format!(
                    "oldest {} (CloudWatch, {})",
                    age(seconds),
                    time(b.oldest_measured_at)
                ),
                (None, None) => "oldest: no CloudWatch datapoint in 15 min".into(),
            };
            let _ = writeln!(
                out,
                "BUFFER        waiting {}, in flight {}, delayed {}, {oldest}, dead letters {} (NOT accounted for)",
                b.waiting, b.in_flight, b.delayed, b.dead_letters
            );
        }
    }
    let _ = writeln!(
        out,
        "GAPS          open past grace {}, in grace (backfill pending) {}",
        r.open_gaps, r.gaps_in_grace
    );
    let _ = writeln!(
        out,
        "CHECKS        {} breaching in the run of {}",
        r.breaching_checks.len(),
        time(r.checks_measured_at)
    );

    out.push_str("\nMAINTENANCE\n");
    let mut t = table(&[
        "pass",
        "last run",
        "status",
        "trigger",
        "last completed",
        "ago",
        "limit",
        "state",
    ]);
    for p in &r.passes {
        let l = &p.latest;
        t.add_row(vec![
            l.job.clone(),
            l.run_id.map_or("-".into(), |id| format!("#{id}")),
            l.status.clone().unwrap_or_else(|| "-".into()),
            l.trigger.clone().unwrap_or_else(|| "-".into()),
            time(l.last_completed_at),
            l.completed_age_seconds.map_or("-".into(), age),
            age(p.max_age_seconds),
            if !p.expected {
                "not needed (no gap sources)".into()
            } else if p.stopped {
                "STOPPED".into()
            } else {
                "ok".into()
            },
        ]);
    }
    let _ = writeln!(out, "{t}");
    out
}

pub fn dead_letters(list: &[DeadLetter]) -> String {
    if list.is_empty() {
        return "no open dead letters\n".into();
    }
    let mut t = table(&[
        "id", "tenant", "event", "type", "status", "attempts", "error",
    ]);
    for d in list {
        t.add_row(vec![
            d.dead_letter_id.to_string(),
            d.tenant_id.clone(),
            d.external_id.clone(),
            d.event_type.clone(),
            d.status.clone(),
            d.attempts.to_string(),
            d.error.clone(),
        ]);
    }
    format!("{t}\n")
}

pub fn buffer_dead_letters(list: &[shared::buffer::accounting::DeadLetter]) -> String {
    if list.is_empty() {
        return "no dead letters in the buffer\n".into();
    }
    let micros = |m: Option<i64>| time(m.and_then(chrono::DateTime::<Utc>::from_timestamp_micros));
    let mut t = table(&[
        "message", "source", "delivery", "received", "bytes", "receives", "why",
    ]);
    for d in list {
        t.add_row(vec![
            d.message_id.clone(),
            d.source_id.clone().unwrap_or_default(),
            d.delivery_id.clone().unwrap_or_default(),
            micros(d.received_at_micros),
            d.body_bytes.map(|b| b.to_string()).unwrap_or_default(),
            d.receive_count.to_string(),
            d.unreadable
                .clone()
                .unwrap_or_else(|| "the consumer failed on it".into()),
        ]);
    }
    format!("{t}\n")
}

pub fn failed_outbox(list: &[FailedMessage]) -> String {
    if list.is_empty() {
        return "no failed outbox messages\n".into();
    }
    let mut t = table(&[
        "id",
        "tenant",
        "event",
        "action",
        "created",
        "attempts",
        "resent",
        "destination",
        "last error",
    ]);
    for m in list {
        t.add_row(vec![
            m.outbox_id.to_string(),
            m.tenant_id.clone(),
            m.external_id.clone(),
            m.action.clone(),
            time(Some(m.created_at)),
            m.attempts.to_string(),
            m.resent_count.to_string(),
            m.destination
                .clone()
                .unwrap_or_else(|| "none (no route)".into()),
            m.last_error.clone().unwrap_or_default(),
        ]);
    }
    format!("{t}\n")
}

/// Delivered outbox messages and where each went.
pub fn sent_outbox(list: &[shared::store::outbox::SentMessage]) -> String {
    if list.is_empty() {
        return "no delivered outbox messages\n".into();
    }
    let mut t = table(&[
        "id",
        "tenant",
        "event",
        "action",
        "delivered",
        "attempts",
        "destination",
    ]);
    for m in list {
        t.add_row(vec![
            m.outbox_id.to_string(),
            m.tenant_id.clone(),
            m.external_id.clone(),
            m.action.clone(),
            time(m.delivered_at),
            m.attempts.to_string(),
            m.destination.clone().unwrap_or_default(),
        ]);
    }
    format!("{t}\n")
}

pub fn dead_letter(d: &DeadLetterDetail) -> String {
    let mut out = String::new();
    let rows = [
        ("dead letter", d.dead_letter_id.to_string()),
        ("status", d.status.clone()),
        ("tenant", d.tenant_id.clone()),
        ("source", d.source_id.clone()),
        ("event", d.external_id.clone()),
        ("type", d.event_type.clone()),
        ("reason", d.reason.clone()),
        ("error", d.error.clone()),
        ("attempts", d.attempts.to_string()),
        ("replays", d.replay_count.to_string()),
        ("created", time(Some(d.created_at))),
        ("updated", time(Some(d.updated_at))),
        ("replayed", time(d.replayed_at)),
        (
            "payload",
            d.payload_bytes
                .map_or("purged".into(), |n| format!("{n} bytes")),
        ),
    ];
    for (k, v) in rows {
        let _ = writeln!(out, "{k:<12} {v}");
    }
    let _ = writeln!(out, "headers      {}", d.headers);
    if !d.withheld_headers.is_empty() {
        let _ = writeln!(out, "withheld     {}", d.withheld_headers.join(", "));
    }
    if let Some(p) = &d.payload {
        let _ = writeln!(out, "\n{p}");
    }
    out
}

pub fn actions(list: &[RecordedAction]) -> String {
    if list.is_empty() {
        return "no operator actions recorded\n".into();
    }
    let mut t = table(&["#", "at", "action", "actor", "via", "affected", "reason"]);
    for a in list {
        let affected = a.affected.as_array().map_or(0, Vec::len);
        t.add_row(vec![
            a.action_id.to_string(),
            time(Some(a.requested_at)),
            if a.finished_at.is_some() {
                a.action.clone()
            } else {
                format!("{} (unfinished)", a.action)
            },
            a.actor.clone(),
            a.via.clone(),
            affected.to_string(),
            a.reason.clone(),
        ]);
    }
    format!("{t}\n")
}

pub fn refused(
    last_day: &[shared::store::refused_deliveries::SourceRefusals],
    list: &[shared::store::refused_deliveries::Refusal],
) -> String {
    if last_day.is_empty() && list.is_empty() {
        return "no refused delivery kept\n".into();
    }
    let mut out = String::new();
    if !last_day.is_empty() {
        let mut t = table(&["source", "check", "last day", "first", "last", "reading"]);
        for s in last_day {
            t.add_row(vec![
                s.source_id.clone(),
                s.check_failed.clone(),
                s.refused_last_day.to_string(),
                time(Some(s.first_refused_at)),
                time(Some(s.last_refused_at)),
                s.reading().to_owned(),
            ]);
        }
        out.push_str(&format!("LAST DAY\n{t}\n\n"));
    }
    let mut t = table(&[
        "#",
        "at",
        "source",
        "status",
        "check",
        "method",
        "bytes",
        "user agent",
        "+",
        "detail",
    ]);
    for r in list {
        t.add_row(vec![
            r.refusal_id.to_string(),
            time(Some(r.refused_at)),
            r.source_id.clone(),
            r.status.to_string(),
            r.check_failed.clone(),
            r.method.clone(),
            r.body_bytes.to_string(),
            r.user_agent.clone().unwrap_or_default(),
            r.also_refused.to_string(),
            r.detail.clone(),
        ]);
    }
    out.push_str(&format!(
        "LATEST (+: refused in the second after, not kept one by one)\n{t}\n"
    ));
    out
}

pub fn replay(r: &ReplayOutcome) -> String {
    format!(
        "selected {}, replayed {}, failed again {}, skipped {}\n",
        r.selected, r.replayed, r.failed, r.skipped
    )
}

pub fn runs(list: &[RunRecord]) -> String {
    if list.is_empty() {
        return "no runs recorded\n".into();
    }
    let mut t = table(&[
        "run", "job", "trigger", "status", "started", "took", "found", "repaired", "error",
    ]);
    for r in list {
        t.add_row(vec![
            format!("#{}", r.run_id),
            r.job.clone(),
            r.trigger.clone(),
            r.status.clone(),
            time(Some(r.started_at)),
            r.finished_at.map_or("-".into(), |f| {
                format!(
                    "{:.1} s",
                    (f - r.started_at).num_milliseconds().max(0) as f64 / 1000.0
                )
            }),
            counts(&r.found),
            counts(&r.repaired),
            r.error.clone().unwrap_or_default(),
        ]);
    }
    format!("{t}\n")
}

/// A run's counts as `key=value` pairs, the non-zero ones only.
fn counts(v: &serde_json::Value) -> String {
    fn walk(prefix: &str, v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&key, v, out);
                }
            }
            serde_json::Value::Number(n) if n.as_f64() != Some(0.0) => {
                out.push(format!("{prefix}={n}"));
            }
            serde_json::Value::Array(a) if !a.is_empty() => {
                out.push(format!("{prefix}={}", a.len()));
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk("", v, &mut out);
    if out.is_empty() {
        "-".into()
    } else {
        out.join(" ")
    }
}

pub fn checks(list: &[StoredResult]) -> String {
    let Some(first) = list.first() else {
        return "no anomaly run has stored results yet\n".into();
    };
    let breached = list.iter().filter(|c| c.breached).count();
    let mut t = table(&[
        "check", "subject", "family", "value", "expected", "state", "detail",
    ]);
    for c in list {
        t.add_row(vec![
            c.check_name.clone(),
            c.subject.clone(),
            c.family.clone(),
            number(c.value),
            format!("{}..{}", number(c.expected_low), number(c.expected_high)),
            if c.breached { "BREACH" } else { "ok" }.into(),
            c.detail.clone(),
        ]);
    }
    format!(
        "anomaly run #{} at {}: {} check(s), {} breaching\n{t}\n",
        first.run_id,
        time(Some(first.measured_at)),
        list.len(),
        breached
    )
}

pub fn gaps(list: &[OpenGap]) -> String {
    if list.is_empty() {
        return "no open gaps\n".into();
    }
    let mut t = table(&[
        "source",
        "tenant",
        "event",
        "sequence",
        "first seen",
        "state",
        "attempts",
        "last error",
    ]);
    for g in list {
        t.add_row(vec![
            g.source_id.clone(),
            g.tenant_id.clone(),
            g.external_id.clone(),
            g.sequence.map_or("-".into(), |s| s.to_string()),
            time(Some(g.first_seen_at)),
            if g.in_grace {
                "in grace"
            } else {
                "backfill due"
            }
            .into(),
            g.attempts.to_string(),
            g.last_error.clone().unwrap_or_default(),
        ]);
    }
    format!("{t}\n")
}

pub fn tombstones(list: &[Tombstone]) -> String {
    if list.is_empty() {
        return "no tombstones\n".into();
    }
    let mut t = table(&[
        "source", "tenant", "event", "sequence", "created", "by", "reason",
    ]);
    for x in list {
        t.add_row(vec![
            x.source_id.clone(),
            x.tenant_id.clone(),
            x.external_id.clone(),
            x.sequence.map_or("-".into(), |s| s.to_string()),
            time(Some(x.created_at)),
            x.created_by.clone(),
            x.reason.clone(),
        ]);
    }
    format!("{t}\n")
}

/// Subscriptions and what each has not delivered.
pub fn subscriptions(list: &[shared::store::subscriptions::Undelivered]) -> String {
    if list.is_empty() {
        return "no subscriptions\n".into();
    }
    let mut t = table(&[
        "tenant",
        "subscription",
        "state",
        "undelivered",
        "oldest undelivered",
        "failed",
    ]);
    for s in list {
        t.add_row(vec![
            s.tenant_id.clone(),
            s.name.clone(),
            if s.paused { "paused" } else { "running" }.to_owned(),
            s.undelivered.to_string(),
            format!("{:.0} s", s.oldest_age_seconds),
            s.failed.to_string(),
        ]);
    }
    format!("{t}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_in_the_unit_an_operator_expects() {
        assert_eq!(age(3.2), "3 s");
        assert_eq!(age(900.0), "15 min");
        assert_eq!(age(3.0 * 3600.0), "3 h");
        assert_eq!(age(5.0 * 86400.0), "5 d");
        assert_eq!(age(-1.0), "0 s");
    }

    #[test]
    fn run_counts_show_only_what_happened() {
        let v = serde_json::json!({"requeued": 2, "drained": {"processed": 2, "retried": 0}, "failed_sources": []});
        assert_eq!(counts(&v), "drained.processed=2 requeued=2");
        assert_eq!(counts(&serde_json::json!({"a": 0})), "-");
    }
}
