//! Metrics, as CloudWatch Embedded Metric Format documents on the function's log stream: no
//! network call on the request path; the alarms in `template.yaml` are defined on these names,
//! and a test checks every alarm's metric is one listed in [`EMITTED`].
//!
//! Without an installed exporter (tests, the local runner) the calls are no-ops.

use crate::drain::DrainOutcome;

pub const NAMESPACE: &str = "Webhooks";

/// Deliveries stored, by `Outcome` (accepted, duplicate, conflict).
pub const DELIVERIES_STORED: &str = "DeliveriesStored";
/// Deliveries refused, by `Reason` (signature, unknown_source, too_large, unreadable,
/// unavailable, misconfigured).
pub const DELIVERIES_REFUSED: &str = "DeliveriesRefused";
pub const EVENTS_PROCESSED: &str = "EventsProcessed";
pub const EVENTS_RETRIED: &str = "EventsRetried";
pub const EVENTS_DEAD_LETTERED: &str = "EventsDeadLettered";
/// Events waiting in the queue after a drain pass.
pub const BACKLOG: &str = "Backlog";
/// Age of the oldest waiting event after a drain pass, in seconds.
pub const OLDEST_PENDING_AGE: &str = "OldestPendingAgeSeconds";

/// Anomaly checks that breached in the last run.
pub const ANOMALY_BREACHES: &str = "AnomalyBreaches";
/// Each global anomaly check's measurement, by `Check`.
pub const ANOMALY_VALUE: &str = "AnomalyValue";

/// Every metric name the code emits.
pub const EMITTED: &[&str] = &[
    ANOMALY_BREACHES,
    ANOMALY_VALUE,
    DELIVERIES_STORED,
    DELIVERIES_REFUSED,
    EVENTS_PROCESSED,
    EVENTS_RETRIED,
    EVENTS_DEAD_LETTERED,
    BACKLOG,
    OLDEST_PENDING_AGE,
];

pub type Collector = metrics_cloudwatch_embedded::Collector;

/// Installs the EMF exporter for this process; call `flush(std::io::stdout())` on the result
/// after each invocation.
pub fn install_emf() -> Result<&'static Collector, String> {
    metrics_cloudwatch_embedded::Builder::new()
        .cloudwatch_namespace(NAMESPACE)
        .init()
        .map_err(|e| format!("installing the metrics exporter: {e}"))
}

pub fn delivery_stored(outcome: &'static str) {
    metrics::counter!(DELIVERIES_STORED, "Outcome" => outcome).increment(1);
}

pub fn delivery_refused(reason: &'static str) {
    metrics::counter!(DELIVERIES_REFUSED, "Reason" => reason).increment(1);
}

pub fn drained(outcome: &DrainOutcome) {
    metrics::counter!(EVENTS_PROCESSED).increment(outcome.processed);
    metrics::counter!(EVENTS_RETRIED).increment(outcome.retried);
    metrics::counter!(EVENTS_DEAD_LETTERED).increment(outcome.dead_lettered);
}

pub fn queue(backlog: i64, oldest_pending_age_seconds: f64) {
    metrics::gauge!(BACKLOG).set(backlog as f64);
    metrics::gauge!(OLDEST_PENDING_AGE).set(oldest_pending_age_seconds);
}

pub fn anomaly_value(check: &str, value: f64) {
    metrics::gauge!(ANOMALY_VALUE, "Check" => check.to_owned()).set(value);
}

pub fn anomaly_breaches(breaches: usize) {
    metrics::gauge!(ANOMALY_BREACHES).set(breaches as f64);
}
