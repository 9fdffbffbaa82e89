//! Metrics, as CloudWatch Embedded Metric Format documents on the function's log stream: no
//! network call on the request path; the alarms in `template.yaml` are defined on these names,
//! and a test checks every alarm's metric is one listed in [`EMITTED`].
//!
//! Without an installed exporter (tests, the local runner) the calls are no-ops.
//!
//! Counters are deltas: a flush sends what was counted since the last one. Measurements (the
//! queue's backlog and oldest age, the anomaly results) are recorded as one-value
//! distributions, not gauges, because the exporter re-sends a gauge's last value on every
//! flush: after a failed drain pass, the previous pass's healthy backlog would be reported
//! again and hide the failure. A measurement is sent only by the invocation that measured it,
//! so a pass that fails sends nothing, and the alarms that treat missing data as breaching
//! notice.

pub const NAMESPACE: &str = "Webhooks";

/// Deliveries stored, by `Outcome` (accepted, duplicate, conflict).
pub const DELIVERIES_STORED: &str = "DeliveriesStored";
/// Deliveries refused, by `Reason` (signature, unknown_source, too_large, unreadable,
/// unavailable, misconfigured, address).
pub const DELIVERIES_REFUSED: &str = "DeliveriesRefused";
/// Deliveries SQS took (the second buffer), by `Mode` (spillover: the database could not take
/// them in time; queue: every delivery goes there).
pub const DELIVERIES_BUFFERED: &str = "DeliveriesBuffered";
/// Sends to the buffer that failed, by `Mode`: in spillover the delivery was answered 503
/// (neither store took it); in queue mode it was stored directly instead.
pub const BUFFER_SEND_FAILURES: &str = "BufferSendFailures";
/// Deliveries the ingest function answered with a 5xx (the provider retries), once without a
/// dimension (every version) and once by [`FUNCTION_VERSION`], the Lambda version that answered.
/// The ingest canary's rollback alarm compares the two: unlike the API's 5xx metric it names no
/// API, so the alarm can guard the function's own deployment, and a handler's 5xx answer is not
/// a Lambda `Errors` datapoint.
pub const INGEST_5XX: &str = "Ingest5xx";
/// The dimension naming the Lambda version that emitted a metric (`AWS_LAMBDA_FUNCTION_VERSION`,
/// the number `!GetAtt IngestFunction.Version.Version` gives in template.yaml).
pub const FUNCTION_VERSION: &str = "FunctionVersion";
pub const EVENTS_PROCESSED: &str = "EventsProcessed";
pub const EVENTS_RETRIED: &str = "EventsRetried";
pub const EVENTS_DEAD_LETTERED: &str = "EventsDeadLettered";
/// Events waiting in the queue after a drain pass.
pub const BACKLOG: &str = "Backlog";
/// Age of the oldest waiting event after a drain pass, in seconds.
pub const OLDEST_PENDING_AGE: &str = "OldestPendingAgeSeconds";

/// Lookups a warm ingest answered from a cache entry past its TTL because the database or
/// Secrets Manager could not answer (stale-if-error), by `What` (source, secret).
pub const STALE_SERVED: &str = "StaleServed";

/// Anomaly checks that breached in the last run, but for those that page on-call only
/// (`anomaly::ON_CALL_ONLY`): the alarm on this count also invokes reconcile.
pub const ANOMALY_BREACHES: &str = "AnomalyBreaches";
/// Each global anomaly check's measurement, by `Check`.
pub const ANOMALY_VALUE: &str = "AnomalyValue";

/// Buffered deliveries the buffer's consumer took off the queue, by `Outcome`: `accepted`,
/// `duplicate`, `conflict` (stored, as a direct delivery would have been), `already_filed` (a
/// second copy of a delivery filed before: nothing counted), `unfilable` (recorded as an
/// anomaly and deleted from the queue), `retry` (left on the queue: it reaches the buffer's
/// dead-letter queue if it keeps failing).
pub const BUFFERED_DELIVERIES_FILED: &str = "BufferedDeliveriesFiled";

// Issue 23 (a repair is a signal too; delivery trouble seen before it is final).
/// Events reconcile re-queued because something they needed was lost, once without a dimension
/// (the `reconcile-repairs` alarm reads it) and once by `Kind` (`orphaned_pending`,
/// `missing_effect`, `missing_outbox`). Zero on a healthy stack: each one is the symptom of a
/// bug elsewhere.
pub const RECONCILE_REPAIRS: &str = "ReconcileRepairs";
/// Outbox messages whose try failed and that were scheduled again (a target answering 5xx,
/// 408, 429, or unreachable).
pub const OUTBOX_RETRIED: &str = "OutboxRetried";
/// Age of the oldest undelivered (pending) outbox message after an outbox pass, in seconds;
/// 0 when every message is delivered.
pub const OUTBOX_OLDEST_UNDELIVERED_AGE: &str = "OutboxOldestUndeliveredSeconds";

// Issue 24 (destinations beyond HTTP).
/// Outbox messages settled by a try, by `Destination` (http, eventbridge, sqs, sns; `none` for a
/// message no route covers) and `Outcome` (delivered, retried, failed, unrouted). The alarms
/// count failures per destination kind; the dashboard graphs deliveries per kind.
pub const OUTBOX_DELIVERIES: &str = "OutboxDeliveries";

// Issue 50 (provider address ranges as a second check).
/// Signed deliveries whose source address lay outside their provider's fresh published ranges,
/// by `Check`: `observe` (admitted and stored) or `enforce` (refused 403, also counted in
/// `DeliveriesRefused` with the reason `address`).
pub const DELIVERIES_OUTSIDE_PROVIDER_RANGES: &str = "DeliveriesOutsideProviderRanges";

/// Every metric name the code emits.
pub const EMITTED: &[&str] = &[
    ANOMALY_BREACHES,
    ANOMALY_VALUE,
    DELIVERIES_STORED,
    DELIVERIES_REFUSED,
    DELIVERIES_BUFFERED,
    BUFFER_SEND_FAILURES,
    INGEST_5XX,
    EVENTS_PROCESSED,
    EVENTS_RETRIED,
    EVENTS_DEAD_LETTERED,
    BACKLOG,
    OLDEST_PENDING_AGE,
    STALE_SERVED,
    BUFFERED_DELIVERIES_FILED,
    // Issue 23.
    RECONCILE_REPAIRS,
    OUTBOX_RETRIED,
    OUTBOX_OLDEST_UNDELIVERED_AGE,
    // Issue 24.
    OUTBOX_DELIVERIES,
    // Issue 50.
    DELIVERIES_OUTSIDE_PROVIDER_RANGES,
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

/// One buffered delivery taken off the queue, by outcome (see [`BUFFERED_DELIVERIES_FILED`]).
pub fn buffered_filed(outcome: &'static str) {
    metrics::counter!(BUFFERED_DELIVERIES_FILED, "Outcome" => outcome).increment(1);
}

pub fn delivery_refused(reason: &'static str) {
    metrics::counter!(DELIVERIES_REFUSED, "Reason" => reason).increment(1);
}

pub fn delivery_buffered(mode: &'static str) {
    metrics::counter!(DELIVERIES_BUFFERED, "Mode" => mode).increment(1);
}

pub fn buffer_send_failed(mode: &'static str) {
    metrics::counter!(BUFFER_SEND_FAILURES, "Mode" => mode).increment(1);
}

/// A 5xx answer of the ingest function, counted for every version and for the version running
/// (Lambda sets `AWS_LAMBDA_FUNCTION_VERSION`; outside Lambda only the first is counted).
pub fn ingest_5xx() {
    static VERSION: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let version = VERSION.get_or_init(|| std::env::var("AWS_LAMBDA_FUNCTION_VERSION").ok());
    ingest_5xx_of(version.as_deref());
}

/// [`ingest_5xx`] for a given version.
pub fn ingest_5xx_of(version: Option<&str>) {
    metrics::counter!(INGEST_5XX).increment(1);
    if let Some(version) = version {
        metrics::counter!(INGEST_5XX, FUNCTION_VERSION => version.to_owned()).increment(1);
    }
}

/// A source (`what` = "source") or secret ("secret") served past its TTL because its store
/// could not answer.
pub fn stale_served(what: &'static str) {
    metrics::counter!(STALE_SERVED, "What" => what).increment(1);
}

/// What drain batches committed: events processed, rescheduled, dead-lettered.
pub fn drained(processed: u64, retried: u64, dead_lettered: u64) {
    metrics::counter!(EVENTS_PROCESSED).increment(processed);
    metrics::counter!(EVENTS_RETRIED).increment(retried);
    metrics::counter!(EVENTS_DEAD_LETTERED).increment(dead_lettered);
}

/// The queue as a drain pass that completed measured it.
pub fn queue(backlog: i64, oldest_pending_age_seconds: f64) {
    metrics::histogram!(BACKLOG).record(backlog as f64);
    metrics::histogram!(OLDEST_PENDING_AGE).record(oldest_pending_age_seconds);
}

pub fn anomaly_value(check: &str, value: f64) {
    metrics::histogram!(ANOMALY_VALUE, "Check" => check.to_owned()).record(value);
}

pub fn anomaly_breaches(breaches: usize) {
    metrics::histogram!(ANOMALY_BREACHES).record(breaches as f64);
}

// Issue 23.
/// What a reconcile pass re-queued, by kind (nothing is sent for a pass that repaired nothing).
pub fn reconcile_repairs(by_kind: &[(&'static str, u64)]) {
    let total: u64 = by_kind.iter().map(|(_, n)| n).sum();
    if total == 0 {
        return;
    }
    metrics::counter!(RECONCILE_REPAIRS).increment(total);
    for &(kind, n) in by_kind {
        if n > 0 {
            metrics::counter!(RECONCILE_REPAIRS, "Kind" => kind).increment(n);
        }
    }
}

/// An outbox pass: the messages it scheduled again, and the oldest undelivered one it left.
pub fn outbox(retried: u64, oldest_undelivered_seconds: f64) {
    metrics::counter!(OUTBOX_RETRIED).increment(retried);
    metrics::histogram!(OUTBOX_OLDEST_UNDELIVERED_AGE).record(oldest_undelivered_seconds);
}

// Issue 24.
/// `n` outbox messages of one destination kind settled with `outcome` (see [`OUTBOX_DELIVERIES`]).
pub fn outbox_delivery(destination: &'static str, outcome: &'static str, n: u64) {
    metrics::counter!(OUTBOX_DELIVERIES, "Destination" => destination, "Outcome" => outcome)
        .increment(n);
}

// Issue 50.
/// A signed delivery from outside its provider's ranges, by the source's check (see
/// [`DELIVERIES_OUTSIDE_PROVIDER_RANGES`]).
pub fn outside_provider_ranges(check: &'static str) {
    metrics::counter!(DELIVERIES_OUTSIDE_PROVIDER_RANGES, "Check" => check).increment(1);
}
