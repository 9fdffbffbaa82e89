//! The fault drill: the local pipeline, one fault of each class, and a matrix of which layers
//! noticed each fault and whether it was repaired with no human step.
//!
//! Each fault runs in a scratch schema of its own (`hookctl_drill_<fault>`, migrated fresh and
//! dropped afterwards), so no fault's traces are read as another's: the ingest function served
//! over HTTP as the local runner serves it, the provider simulator's API for backfill, and an
//! outbox target that can be taken down. A baseline of the provider's events lands first; then
//! the fault is injected and scheduled cycles run. A cycle runs each pass once, as its schedule
//! would (drain, outbox, backfill, reconcile, retention, anomaly), then ages every stored
//! timestamp by five minutes: time is compressed by rewriting the clock the data carries, never
//! by sleeping. Metrics go to an in-process recorder, and each cycle's are judged against the
//! thresholds of the stack's alarms.
//!
//! A control run with no fault comes first: whatever it notices would be noise in every row.
//! Exit 0 when every fault was noticed by as many layers as the drill asks of it (at least two,
//! or none when it is harmless by design, said so in the matrix) and every fault the design
//! repairs was repaired; 1 otherwise; 2 when the drill could not run.

use std::collections::BTreeMap;
use std::io::IsTerminal as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use clap::Args;
use comfy_table::{Table, presets};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use shared::anomaly::{self, AnomalySettings};
use shared::aws::AwsEndpoint;
use shared::backfill::{BackfillRun, BackfillSettings, Backfiller};
use shared::buffer::{BufferMode, BufferQueue};
use shared::domain::{FieldLocator, Scheme, SourceId, TenantId};
use shared::drain::{DrainSettings, Drainer};
use shared::effects::{EffectError, EffectFuture, EffectHandler, EffectRegistry};
use shared::extract::FieldMap;
use shared::ingest::{Buffer, IngestLimits, Ingestor, unix_now};
use shared::outbox::{OutboxSender, OutboxSettings};
use shared::reconcile::{self, ReconcileOutcome, ReconcileSettings};
use shared::retention::{self, RetentionSettings};
use shared::secrets::{SecretSet, SecretStore, SigningSecret};
use shared::sources::{self, GapConfig, GapStrategy, Source, SourceRegistry};
use shared::store::event_queue::ClaimedEvent;
use shared::store::{self, MIGRATOR, PgPool, StoreError, faults};
use simulator::{Provider, ProviderConfig};

use crate::db_proxy::DatabaseProxy;

#[derive(Args, Debug, Clone, Default)]
pub struct DrillArgs {
    /// The CI form: smaller batches and fewer observation cycles; every fault class still runs.
    #[arg(long)]
    pub short: bool,
    /// Only this fault (repeatable; see the matrix for names). The control always runs.
    #[arg(long = "fault")]
    pub faults: Vec<String>,
    /// Keep each fault's scratch schema for inspection instead of dropping it.
    #[arg(long)]
    pub keep: bool,
}

/// Simulated time per scheduled cycle: the anomaly and backfill schedule.
const CYCLE_SECONDS: f64 = 300.0;
const TENANT: &str = "drill";
const PROVIDER_SECRET: &str = "whsec_drill_provider";
const PROVIDER_API_KEY: &str = "sk_drill_provider";
const SHOP_SECRET: &str = "whsec_drill_shop";
/// The HubSpot source of [`Fault::BatchElementRetried`]: its client secret, and the URL its
/// v3 signature covers (the local runner sees only the path).
const CRM_SECRET: &str = "drill-crm-client-secret";
const CRM_URL: &str = "https://drill.example.com/webhooks/crm";
/// The layers that may notice a fault, in the matrix's order.
pub const LAYERS: [&str; 7] = [
    "ingest",
    "drain",
    "outbox",
    "reconcile",
    "backfill",
    "checks",
    "alarm",
];

#[derive(Debug, thiserror::Error)]
pub enum DrillError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("migrating the scratch schema: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("{0}")]
    Setup(String),
    #[error(transparent)]
    Sources(#[from] sources::ApplyError),
}

type Result<T, E = DrillError> = std::result::Result<T, E>;

/// One fault class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Control,
    LostDelivery,
    DuplicateStorm,
    BatchElementRetried,
    Reordering,
    DrainerKilled,
    LostQueueRow,
    DeletedEffect,
    DeletedOutboxRow,
    OutboxTargetDown,
    PoisonEvent,
    SignatureStorm,
    DigestConflict,
    SilentSource,
    VacuumStarvation,
    DatabaseDownNoRetry,
    PoisonBufferMessage,
}

const FAULTS: [Fault; 17] = [
    Fault::Control,
    Fault::LostDelivery,
    Fault::DuplicateStorm,
    Fault::BatchElementRetried,
    Fault::Reordering,
    Fault::DrainerKilled,
    Fault::LostQueueRow,
    Fault::DeletedEffect,
    Fault::DeletedOutboxRow,
    Fault::OutboxTargetDown,
    Fault::PoisonEvent,
    Fault::SignatureStorm,
    Fault::DigestConflict,
    Fault::SilentSource,
    Fault::VacuumStarvation,
    Fault::DatabaseDownNoRetry,
    Fault::PoisonBufferMessage,
];

/// What the design promises for a fault.
enum Promise {
    /// Repaired with no human step.
    Repaired,
    /// Nothing is lost or wrong afterwards, so no layer needs to notice (said why).
    Harmless(&'static str),
    /// Noticed, but only a human can resolve it (said why).
    Human(&'static str),
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Control => "none (control)",
            Fault::LostDelivery => "lost_delivery",
            Fault::DuplicateStorm => "duplicate_storm",
            Fault::BatchElementRetried => "batch_element_retried",
            Fault::Reordering => "reordering",
            Fault::DrainerKilled => "drainer_killed",
            Fault::LostQueueRow => "lost_queue_row",
            Fault::DeletedEffect => "deleted_effect",
            Fault::DeletedOutboxRow => "deleted_outbox_row",
            Fault::OutboxTargetDown => "outbox_target_down",
            Fault::PoisonEvent => "poison_event",
            Fault::SignatureStorm => "signature_storm",
            Fault::DigestConflict => "digest_conflict",
            Fault::SilentSource => "silent_source",
            Fault::VacuumStarvation => "vacuum_starvation",
            Fault::DatabaseDownNoRetry => "database_down_no_retry",
            Fault::PoisonBufferMessage => "poison_buffer_message",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Fault::Control => "no fault: the baseline's own noise",
            Fault::LostDelivery => "the provider never delivers one event of a batch",
            Fault::DuplicateStorm => "every event of a batch delivered five times",
            Fault::BatchElementRetried => {
                "a HubSpot event retried on its own inside another batch (a new attemptNumber)"
            }
            Fault::Reordering => "a batch delivered newest first (entity versions backwards)",
            Fault::DrainerKilled => {
                "a drainer's backend is terminated after it claimed a batch, before commit"
            }
            Fault::LostQueueRow => "three pending events lose their queue rows",
            Fault::DeletedEffect => "an entity's projection row is deleted",
            Fault::DeletedOutboxRow => "the announcement of an entity's latest change is deleted",
            Fault::OutboxTargetDown => "the outbox target answers 503 for four cycles (20 min)",
            Fault::PoisonEvent => "an event its handler rejects as malformed, every time",
            Fault::SignatureStorm => "30 deliveries signed with the wrong secret",
            Fault::DigestConflict => {
                "a processed event redelivered, validly signed, with a different payload"
            }
            Fault::SilentSource => "a source with two weeks of steady traffic goes silent",
            Fault::VacuumStarvation => {
                "a session opens a transaction and sits idle in it (holds back vacuum)"
            }
            Fault::DatabaseDownNoRetry => {
                "the database is unreachable for ingest during a batch from a sender that never retries"
            }
            Fault::PoisonBufferMessage => {
                "a buffer message no build can read, and a buffered delivery its source can no longer read"
            }
        }
    }

    fn promise(self) -> Promise {
        match self {
            Fault::Control => Promise::Harmless("no fault"),
            Fault::Reordering => Promise::Harmless(
                "processing order is not arrival order: the version guard keeps the newest",
            ),
            Fault::DrainerKilled => Promise::Harmless(
                "the killed batch commits nothing; its rows are claimed again by the next drain",
            ),
            Fault::PoisonEvent => Promise::Human(
                "fix the handler or the data, then `hookctl dead-letters replay --reason …`, or discard",
            ),
            Fault::DigestConflict => Promise::Human(
                "a signed payload changed under one id: a provider bug or a leaked secret",
            ),
            Fault::SilentSource => Promise::Human(
                "the provider stopped sending; only it can resume (no gap detection on this source)",
            ),
            Fault::VacuumStarvation => Promise::Human(
                "only the session's owner ends it (or idle_in_transaction_session_timeout)",
            ),
            Fault::PoisonBufferMessage => Promise::Human(
                "a message no build can read: `hookctl buffer list`, then fix and `hookctl buffer redrive`, or discard",
            ),
            _ => Promise::Repaired,
        }
    }

    /// Issue 23: how many layers must notice the fault. Two for every fault that is not harmless
    /// by design (the design's redundancy: one layer's bug must not hide a fault), pinned at the
    /// count each reaches today, so that the short form in CI fails when a layer goes deaf. A
    /// fault held to one says why ([`Fault::one_layer_why`]), in the matrix too.
    fn layers_required(self) -> usize {
        match self {
            Fault::Control | Fault::Reordering | Fault::DrainerKilled => 0,
            Fault::LostDelivery | Fault::BatchElementRetried => 1,
            // Ingest's 401s, and the alarm on them; nothing is stored, so no check can count.
            Fault::SignatureStorm => 2,
            // Ingest answers `buffered`, and the spill's alarm; the consumer files them.
            Fault::DatabaseDownNoRetry => 2,
            // The consumer keeps the poison message and records the unfilable one; the checks
            // count both (unfilable_buffered_deliveries_last_day, buffer_dead_letters); the
            // buffer's dead-letter alarm and the checks' own.
            Fault::PoisonBufferMessage => 3,
            // The per-source check, and the alarm on the checks.
            Fault::SilentSource | Fault::VacuumStarvation => 2,
            Fault::DuplicateStorm
            | Fault::LostQueueRow
            | Fault::DeletedEffect
            | Fault::DeletedOutboxRow
            | Fault::OutboxTargetDown
            | Fault::PoisonEvent
            | Fault::DigestConflict => 3,
        }
    }

    /// Why one layer is the most the fault can have on a healthy stack, for a fault held to one.
    fn one_layer_why(self) -> Option<&'static str> {
        match self {
            Fault::LostDelivery => Some(
                "one dropped delivery among many is a provider's ordinary behaviour: gap detection \
                 notices it and backfill repairs it; a second layer would page for every drop. The \
                 check backfill_rate_last_day speaks when drops pass 2% of a day's events (the short \
                 form: 1 of 40), last_backfill_age_seconds when backfill stops, stale_gap_candidates \
                 when a gap stays unfetched for a day",
            ),
            Fault::BatchElementRetried => Some(
                "a provider retrying one event inside another batch is its ordinary behaviour \
                 (HubSpot retries each event on its own): ingest's answer counts it a duplicate \
                 element, and it is stored and processed once; a second layer would page for \
                 every retry. duplicate_rate_last_day speaks when retries become a storm",
            ),
            _ => None,
        }
    }

    /// Whether the fault needs the buffer's SQS queues (and so an SQS endpoint).
    fn needs_buffer(self) -> bool {
        matches!(
            self,
            Fault::DatabaseDownNoRetry | Fault::PoisonBufferMessage
        )
    }

    fn schema(self) -> String {
        let name = match self {
            Fault::Control => "control",
            other => other.name(),
        };
        format!("hookctl_drill_{name}")
    }
}

/// How a fault ended.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Repair {
    /// Back to the state with no fault, after this many cycles, with no human step.
    Repaired { cycles: u32 },
    /// Nothing to repair: nothing was lost or stored wrong.
    NothingToRepair,
    /// Still wrong after the observation cycles; a human must act.
    NeedsHuman { why: String },
    /// Still wrong after the observation cycles, though the design promises a repair.
    NotRepaired { cycles: u32 },
    /// Not run: what it needs is not there (said why). Not a failure.
    Skipped { why: String },
}

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub fault: String,
    pub what: String,
    /// Per layer, the evidence it gave (empty: did not notice).
    pub noticed: BTreeMap<String, Vec<String>>,
    /// Per layer that noticed, the cycle in which it first did (0: as the fault was injected).
    pub first_noticed: BTreeMap<String, u32>,
    /// How many layers noticed, and how many the drill asks for (issue 23).
    pub layers: usize,
    pub layers_required: usize,
    /// Why the fault is held to one layer, when it is.
    pub one_layer_why: Option<String>,
    /// Why no layer is expected to notice, when none is.
    pub harmless_by_design: Option<String>,
    pub repair: Repair,
    /// `hookctl status` at the end: "accounted for" or its findings.
    pub status: Vec<String>,
    /// What the drill holds against this row (empty: as the design promises).
    pub problems: Vec<String>,
    pub seconds: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Matrix {
    pub short: bool,
    pub rows: Vec<Row>,
    pub ok: bool,
    pub notes: Vec<String>,
}

// ---- Metrics: an in-process recorder, judged as the alarms would ----------------------------

/// One recorded value: metric name, labels, value.
type Sample = (String, Vec<(String, String)>, f64);

#[derive(Default)]
struct Captured(Mutex<Vec<Sample>>);

struct Handle {
    sink: Arc<Captured>,
    name: String,
    labels: Vec<(String, String)>,
}

impl Handle {
    fn push(&self, value: f64) {
        if let Ok(mut samples) = self.sink.0.lock() {
            samples.push((self.name.clone(), self.labels.clone(), value));
        }
    }
}

impl metrics::CounterFn for Handle {
    fn increment(&self, value: u64) {
        self.push(value as f64);
    }
    fn absolute(&self, value: u64) {
        self.push(value as f64);
    }
}

impl metrics::HistogramFn for Handle {
    fn record(&self, value: f64) {
        self.push(value);
    }
}

impl metrics::GaugeFn for Handle {
    fn increment(&self, value: f64) {
        self.push(value);
    }
    fn decrement(&self, value: f64) {
        self.push(-value);
    }
    fn set(&self, value: f64) {
        self.push(value);
    }
}

struct Recorder(Arc<Captured>);

impl Recorder {
    fn handle(&self, key: &metrics::Key) -> Arc<Handle> {
        Arc::new(Handle {
            sink: self.0.clone(),
            name: key.name().to_owned(),
            labels: key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect(),
        })
    }
}

impl metrics::Recorder for Recorder {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::from_arc(self.handle(key))
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::from_arc(self.handle(key))
    }
    fn register_histogram(
        &self,
        key: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::from_arc(self.handle(key))
    }
}

/// The process's recorder, installed on first use.
fn captured() -> Arc<Captured> {
    static SINK: OnceLock<Arc<Captured>> = OnceLock::new();
    SINK.get_or_init(|| {
        let sink = Arc::new(Captured::default());
        // Fails only when another recorder is installed; the drill then sees no metrics, and
        // its alarm column says so by staying empty.
        let _ = metrics::set_global_recorder(Recorder(sink.clone()));
        sink
    })
    .clone()
}

/// The stack's alarms on the pipeline's own metrics (template.yaml), judged over one cycle's
/// samples (a cycle stands for their 5-minute period).
fn alarms(samples: &[Sample]) -> Vec<String> {
    let sum = |name: &str, label: Option<(&str, &str)>| -> f64 {
        samples
            .iter()
            .filter(|(n, labels, _)| {
                n == name
                    && label.is_none_or(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(_, _, v)| v)
            .sum()
    };
    let max = |name: &str| -> f64 {
        samples
            .iter()
            .filter(|(n, _, _)| n == name)
            .map(|(_, _, v)| *v)
            .fold(0.0, f64::max)
    };
    let mut fired = Vec::new();
    let mut check = |alarm: &str, breached: bool| {
        if breached {
            fired.push(alarm.to_owned());
        }
    };
    check(
        "anomaly-breaches",
        max(shared::metrics::ANOMALY_BREACHES) > 0.0,
    );
    check(
        "dead-letters",
        sum(shared::metrics::EVENTS_DEAD_LETTERED, None) > 0.0,
    );
    check(
        "signature-failures",
        sum(
            shared::metrics::DELIVERIES_REFUSED,
            Some(("Reason", "signature")),
        ) > 20.0,
    );
    check(
        "oldest-pending",
        max(shared::metrics::OLDEST_PENDING_AGE) > 900.0,
    );
    check("backlog", max(shared::metrics::BACKLOG) > 50_000.0);
    check("ingest-5xx", sum(shared::metrics::INGEST_5XX, None) > 5.0);
    // Issue 23's alarms, each notifying on-call only.
    check(
        "reconcile-repairs",
        sum(shared::metrics::RECONCILE_REPAIRS, None) > 0.0,
    );
    check(
        "outbox-delivery-delayed",
        max(shared::metrics::OUTBOX_OLDEST_UNDELIVERED_AGE)
            > shared::store::anomaly::OUTBOX_OLDEST_UNDELIVERED_LIMIT_SECONDS,
    );
    check(
        "buffer-spillover",
        sum(
            shared::metrics::DELIVERIES_BUFFERED,
            Some(("Mode", "spillover")),
        ) > 0.0,
    );
    fired
}

// ---- The pipeline under test ----------------------------------------------------------------

/// A handler that rejects one event type as malformed: the poison event.
struct Poison;

impl EffectHandler for Poison {
    fn name(&self) -> &'static str {
        "drill_poison"
    }

    fn apply<'a>(
        &'a self,
        _conn: &'a mut sqlx::PgConnection,
        _event: &'a ClaimedEvent,
    ) -> EffectFuture<'a> {
        Box::pin(async {
            Err(EffectError::Fatal(
                "drill.poison: the payload does not match the schema this handler accepts".into(),
            ))
        })
    }
}

/// The outbox target: 204 while up, 503 while down.
#[derive(Default)]
struct Target {
    down: AtomicBool,
}

async fn target(axum::extract::State(t): axum::extract::State<Arc<Target>>) -> StatusCode {
    if t.down.load(Ordering::SeqCst) {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::NO_CONTENT
    }
}

async fn listen() -> Result<(tokio::net::TcpListener, String)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| DrillError::Setup(format!("cannot listen on 127.0.0.1: {e}")))?;
    let address = listener
        .local_addr()
        .map_err(|e| DrillError::Setup(e.to_string()))?;
    Ok((listener, format!("http://{address}")))
}

/// The second buffer, for the buffer's faults: a buffer queue and its dead-letter queue on the
/// SQS at `SQS_ENDPOINT` (or moto's `MOTO_ENDPOINT`), and the proxy through which ingest alone
/// reaches PostgreSQL, so the database can be cut for ingest while every pass (and the
/// consumer) keeps reaching it directly.
struct BufferLab {
    queue: BufferQueue,
    proxy: DatabaseProxy,
}

/// The drill's buffer queues: a message is handed out at most this many times before SQS moves
/// it to the dead-letter queue (the stack: 5)...
const BUFFER_MAX_RECEIVES: u32 = 2;
/// ... and is hidden this long after each receive (the stack: 480 s): the real seconds a poison
/// message costs the drill.
const BUFFER_VISIBILITY_SECONDS: i32 = 1;
/// How long ingest's direct attempt may take before it spills to SQS (the stack: 2000 ms).
const DRILL_SPILL_AFTER: Duration = Duration::from_millis(1000);
/// Receive rounds the consumer makes per cycle at most: it runs until the buffer holds nothing
/// visible or in flight, as the event source mapping polls for the cycle's five minutes.
const CONSUMER_ROUNDS: usize = 20;
/// What the poison message says: JSON, but no buffered delivery.
const POISON_MESSAGE: &str = r#"{"drill": "not a buffered delivery"}"#;

impl BufferLab {
    async fn open(endpoint: &str, pool: &PgPool, fault: Fault) -> Result<Self> {
        let endpoint = AwsEndpoint {
            endpoint_url: Some(endpoint.to_owned()),
            region: Some(std::env::var("AWS_REGION").unwrap_or_else(|_| "us-east-1".into())),
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        // SQS keeps queues across runs: a name of this run's own.
        let name = format!(
            "hookctl-drill-{}-{}-{nanos}",
            fault.name().replace('_', "-"),
            std::process::id()
        );
        let queue = crate::serve::create_buffer_queue(
            &endpoint,
            &name,
            BUFFER_MAX_RECEIVES,
            BUFFER_VISIBILITY_SECONDS as u32,
        )
        .await
        .map_err(DrillError::Setup)?;
        let proxy = DatabaseProxy::to(pool)
            .await
            .map_err(|e| DrillError::Setup(format!("the database proxy: {e}")))?;
        Ok(Self { queue, proxy })
    }

    /// The buffer's counts, as `hookctl status` reads them.
    async fn depth(&self) -> Result<shared::buffer::BufferDepth> {
        self.queue
            .depth()
            .await
            .map_err(|e| DrillError::Setup(format!("reading the buffer's depth: {e}")))
    }

    /// The consumer, as its event source mapping runs it through a cycle: receive a batch, file
    /// it, delete all but the messages to keep; until a round receives nothing. A database
    /// failure keeps the whole batch (it is handed out again).
    async fn consume(&self, pool: &PgPool, signals: &mut Signals) -> Result<()> {
        for _ in 0..CONSUMER_ROUNDS {
            let consumed = crate::serve::consume_once(pool, &self.queue, BUFFER_VISIBILITY_SECONDS)
                .await
                .map_err(DrillError::Setup)?;
            if consumed.received() == 0 {
                break;
            }
            signals.count("ingest", "buffer_filed", consumed.stored);
            signals.count("ingest", "buffer_already_filed", consumed.already_filed);
            signals.count("ingest", "buffer_unfilable", consumed.unfilable);
            signals.count("ingest", "buffer_kept", consumed.retry.len() as u64);
        }
        Ok(())
    }

    /// Deletes the drill's two queues.
    async fn delete_queues(&self) {
        let urls = [
            Some(self.queue.queue_url().to_owned()),
            self.queue.dead_letter_queue_url().ok().map(str::to_owned),
        ];
        for url in urls.into_iter().flatten() {
            let _ = self
                .queue
                .client()
                .delete_queue()
                .queue_url(url)
                .send()
                .await;
        }
    }
}

struct Lab {
    pool: PgPool,
    /// The provider simulator's API, as the sources name it.
    api_url: String,
    /// The buffer, for the buffer's faults.
    buffer: Option<BufferLab>,
    ingest_url: String,
    http: reqwest::Client,
    drainer: Drainer,
    sender: OutboxSender,
    backfiller: Backfiller,
    reconcile: ReconcileSettings,
    retention: RetentionSettings,
    anomaly: AnomalySettings,
    target: Arc<Target>,
    provider: Arc<Provider>,
    clock: Vec<String>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// The provider's events delivered so far (by sequence), for the expected projection.
    delivered: Vec<u64>,
}

impl Drop for Lab {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn source_id(id: &str) -> Result<SourceId> {
    SourceId::parse(id).map_err(|e| DrillError::Setup(e.to_string()))
}

fn drill_sources(api_base_url: &str) -> Result<Vec<Source>> {
    let tenant = TenantId::parse(TENANT).map_err(|e| DrillError::Setup(e.to_string()))?;
    let mut provider_fields = FieldMap::defaults_for(Scheme::Stripe);
    provider_fields.entity_version = Some(FieldLocator::json("/data/object/version"));
    provider_fields.sequence = Some(FieldLocator::json("/sequence"));
    let mut shop_fields = FieldMap::defaults_for(Scheme::Stripe);
    shop_fields.entity_version = Some(FieldLocator::json("/data/object/version"));
    Ok(vec![
        Source {
            source_id: source_id("provider")?,
            tenant_id: tenant.clone(),
            scheme: Scheme::Stripe,
            secret_ref: "drill/provider".into(),
            tolerance: sources::DEFAULT_TOLERANCE,
            fields: provider_fields,
            enabled: true,
            signed_url: None,
            signature: None,
            layouts: None,
            json_form_field: None,
            address_check: None,
            partner: None,
            gaps: Some(GapConfig {
                strategy: GapStrategy::Sequence {
                    id_template: "evt_{seq}".into(),
                },
                api_base_url: Some(api_base_url.to_owned()),
                api_secret_ref: Some("drill/provider-api".into()),
                grace: Duration::from_secs(60),
                window: 1000,
                event_types: None,
            }),
        },
        Source {
            source_id: source_id("shop")?,
            tenant_id: tenant,
            scheme: Scheme::Stripe,
            secret_ref: "drill/shop".into(),
            tolerance: sources::DEFAULT_TOLERANCE,
            fields: shop_fields,
            enabled: true,
            signed_url: None,
            signature: None,
            layouts: None,
            json_form_field: None,
            address_check: None,
            partner: None,
            gaps: None,
        },
    ])
}

/// Sizes of the long and the short form.
#[derive(Clone, Copy)]
struct Scale {
    batch: u64,
    /// Cycles a fault the design repairs may take.
    max_cycles: u32,
    /// Cycles a fault that needs a human is watched for.
    watch_cycles: u32,
}

impl Scale {
    fn of(short: bool) -> Self {
        if short {
            Scale {
                batch: 20,
                max_cycles: 8,
                watch_cycles: 3,
            }
        } else {
            Scale {
                batch: 100,
                max_cycles: 16,
                watch_cycles: 6,
            }
        }
    }
}

fn evt(n: u64) -> String {
    simulator::event_id(n)
}

impl Lab {
    async fn open(
        base: &PgPool,
        schema: &str,
        scale: Scale,
        buffer: Option<(&str, Fault)>,
    ) -> Result<Self> {
        faults::create_schema(base, schema).await?;
        let options = (*base.connect_options())
            .clone()
            .options([("search_path", schema)]);
        let pool = store::lazy_pool(
            options,
            &store::PoolSettings {
                max_connections: 6,
                acquire_timeout: Duration::from_secs(10),
            },
        );
        MIGRATOR.run(&pool).await?;

        let mut tasks = Vec::new();
        let provider = Provider::new(ProviderConfig {
            events: scale.batch * 4,
            never_existed: Vec::new(),
            entities: 5,
            first_created: unix_now() - 100_000,
            signing_secret: PROVIDER_SECRET.into(),
            api_key: PROVIDER_API_KEY.into(),
            event_types: Vec::new(),
        });
        let (listener, api_url) = listen().await?;
        let router = provider.clone().router();
        tasks.push(tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        }));

        let target_state = Arc::new(Target::default());
        let (listener, target_url) = listen().await?;
        let router = axum::Router::new()
            .route("/hook", axum::routing::post(target))
            .with_state(target_state.clone());
        tasks.push(tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        }));

        sources::apply(&pool, &drill_sources(&api_url)?).await?;
        let secrets = Arc::new(SecretStore::memory([
            (
                "drill/provider".to_owned(),
                SecretSet::new(PROVIDER_SECRET, None),
            ),
            (
                "drill/provider-api".to_owned(),
                SecretSet::new(PROVIDER_API_KEY, None),
            ),
            ("drill/shop".to_owned(), SecretSet::new(SHOP_SECRET, None)),
            ("drill/crm".to_owned(), SecretSet::new(CRM_SECRET, None)),
        ]));
        let buffer = match buffer {
            Some((endpoint, fault)) => Some(BufferLab::open(endpoint, &pool, fault).await?),
            None => None,
        };
        // With the buffer, ingest (its sources too) reaches the database through the proxy and
        // spills to the buffer; every pass reaches it directly.
        let ingest_pool = match &buffer {
            Some(b) => b.proxy.pool(&pool),
            None => pool.clone(),
        };
        let ingestor = Ingestor::new(
            ingest_pool.clone(),
            Arc::new(SourceRegistry::new(ingest_pool, Duration::from_secs(30))),
            secrets.clone(),
            IngestLimits {
                max_body_bytes: 256 * 1024,
            },
        );
        let ingestor = Arc::new(match &buffer {
            // No hold: every delivery of the drill's batch tries the database first.
            Some(b) => ingestor.with_buffer(Buffer::new(
                BufferMode::Spillover,
                b.queue.clone(),
                DRILL_SPILL_AFTER,
                Duration::ZERO,
            )),
            None => ingestor,
        });
        let mut registry = EffectRegistry::standard();
        registry.register(Scheme::Stripe, "drill.poison", Arc::new(Poison));
        let registry = Arc::new(registry);
        let (listener, ingest_url) = listen().await?;
        let router = crate::serve::router(
            crate::serve::Runner {
                ingestor,
                registry: registry.clone(),
                buffer: None,
            },
            256 * 1024,
        );
        tasks.push(tokio::spawn(async move {
            let _ = crate::serve::serve(listener, router).await;
        }));

        let mut anomaly = AnomalySettings::default();
        // The drill's clock rewrites every row each cycle, which no vacuum keeps up with.
        anomaly
            .ranges
            .insert("events_dead_tuple_ratio", (Some(0.0), None));
        // pg_stat_activity's clock cannot be aged: the open-transaction check is scaled from
        // 300 s to the drill's one second.
        anomaly
            .ranges
            .insert("longest_open_transaction_seconds", (Some(0.0), Some(1.0)));
        let clock = faults::time_machine(&pool).await?;
        Ok(Lab {
            drainer: Drainer::new(pool.clone(), registry, DrainSettings::default()),
            sender: OutboxSender::new(
                pool.clone(),
                OutboxSettings::new(format!("{target_url}/hook")),
            )
            .map_err(|e| DrillError::Setup(e.to_string()))?,
            backfiller: Backfiller::new(pool.clone(), secrets, BackfillSettings::default()),
            reconcile: ReconcileSettings::default(),
            retention: RetentionSettings::default(),
            anomaly,
            target: target_state,
            provider,
            clock,
            tasks,
            http: reqwest::Client::new(),
            ingest_url,
            pool,
            api_url,
            buffer,
            delivered: Vec::new(),
        })
    }

    async fn post(&self, source: &str, headers: http::HeaderMap, body: Vec<u8>) -> String {
        let reply = self
            .http
            .post(format!("{}/webhooks/{source}", self.ingest_url))
            .headers(headers)
            .body(body)
            .send()
            .await;
        match reply {
            Ok(r) if r.status() == StatusCode::OK || r.status() == StatusCode::ACCEPTED => r
                .json::<serde_json::Value>()
                .await
                .ok()
                .and_then(|v| v["status"].as_str().map(str::to_owned))
                .unwrap_or_else(|| "200".into()),
            Ok(r) => r.status().as_u16().to_string(),
            Err(_) => "unreachable".into(),
        }
    }

    fn signed(secret: &str, id: &str, body: &[u8]) -> Result<http::HeaderMap> {
        shared::signature::sign(
            Scheme::Stripe,
            &SigningSecret::new(secret),
            id,
            unix_now(),
            body,
        )
        .map(Self::json_headers)
        .map_err(|e| DrillError::Setup(e.to_string()))
    }

    /// A signature's headers and a JSON content type: a delivery's headers.
    fn json_headers(signature: Vec<(http::HeaderName, http::HeaderValue)>) -> http::HeaderMap {
        let mut headers: http::HeaderMap = signature.into_iter().collect();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        headers
    }

    fn provider_body(&self, n: u64) -> Result<serde_json::Value> {
        self.provider
            .events()
            .iter()
            .find(|e| e.sequence == n)
            .map(|e| e.body.clone())
            .ok_or_else(|| DrillError::Setup(format!("the provider has no event {n}")))
    }

    /// Delivers the provider's events `ns` in that order, each `copies` times; the answers.
    async fn deliver(&mut self, ns: &[u64], copies: usize) -> Result<Answers> {
        let mut answers = Answers::default();
        for &n in ns {
            let body = serde_json::to_vec(&self.provider_body(n)?).unwrap_or_default();
            let headers = Self::signed(PROVIDER_SECRET, &evt(n), &body)?;
            for _ in 0..copies {
                answers.add(self.post("provider", headers.clone(), body.clone()).await);
            }
            self.delivered.push(n);
        }
        Ok(answers)
    }

    async fn deliver_shop(&self, id: &str, event_type: &str, version: i64) -> Result<String> {
        let body = serde_json::to_vec(&serde_json::json!({
            "id": id, "object": "event", "type": event_type,
            "data": {"object": {"id": format!("order-{}", version % 3), "version": version}}
        }))
        .unwrap_or_default();
        let headers = Self::signed(SHOP_SECRET, id, &body)?;
        Ok(self.post("shop", headers, body).await)
    }

    /// Delivers one HubSpot batch to the `crm` source, its elements `(eventId, attemptNumber)`
    /// of portal 62515, subscription 100, v3-signed as HubSpot signs: the answer's JSON.
    async fn deliver_crm(&self, elements: &[(u64, u32)]) -> Result<serde_json::Value> {
        let body: Vec<serde_json::Value> = elements
            .iter()
            .map(|&(event_id, attempt)| {
                serde_json::json!({"eventId": event_id, "subscriptionId": 100, "portalId": 62515,
                    "subscriptionType": "contact.creation", "objectId": 7000 + event_id,
                    "attemptNumber": attempt, "occurredAt": 1_764_000_000_000_u64})
            })
            .collect();
        let body = serde_json::to_vec(&body).unwrap_or_default();
        let v3 = Scheme::Hubspot
            .provider()
            .signatures
            .iter()
            .find(|l| l.name.as_deref() == Some("v3"))
            .ok_or_else(|| DrillError::Setup("the HubSpot entry has no v3 layout".into()))?;
        let headers = shared::signature::sign_with(
            v3,
            &SigningSecret::new(CRM_SECRET),
            &shared::signature::Signing {
                message_id: "",
                timestamp: unix_now(),
                body: &body,
                method: "POST",
                url: Some(CRM_URL),
            },
        )
        .map(Self::json_headers)
        .map_err(|e| DrillError::Setup(e.to_string()))?;
        let reply = self
            .http
            .post(format!("{}/webhooks/crm", self.ingest_url))
            .headers(headers)
            .body(body)
            .send()
            .await
            .map_err(|e| DrillError::Setup(format!("the crm batch: {e}")))?;
        reply
            .json()
            .await
            .map_err(|e| DrillError::Setup(format!("the crm batch's answer: {e}")))
    }

    /// What the projection must hold: per entity, the newest version delivered.
    fn expected_projection(&self) -> Vec<(String, i64)> {
        let mut newest: BTreeMap<String, i64> = BTreeMap::new();
        for &n in &self.delivered {
            let entity = format!("item-{}", n % 5);
            let v = newest.entry(entity).or_insert(0);
            *v = (*v).max(n as i64);
        }
        newest.into_iter().collect()
    }

    async fn projection_ok(&self) -> Result<bool> {
        let held: Vec<(String, i64)> = faults::entity_versions(&self.pool)
            .await?
            .into_iter()
            .filter(|(id, _)| id.starts_with("item-"))
            .collect();
        Ok(held == self.expected_projection())
    }

    /// Ages the database by `seconds`, then runs the scheduled passes once unobserved: the runs
    /// that would have happened in that time.
    async fn jump(&self, seconds: f64) -> Result<()> {
        faults::age(&self.pool, &self.clock, seconds).await?;
        let mut ignored = Signals::default();
        self.cycle(&mut ignored).await?;
        captured().0.lock().map(|mut s| s.clear()).ok();
        Ok(())
    }

    fn buffer(&self) -> Result<&BufferLab> {
        self.buffer
            .as_ref()
            .ok_or_else(|| DrillError::Setup("this fault needs the buffer's queues".into()))
    }

    /// One scheduled cycle: every pass once (the buffer's consumer first, when there is a
    /// buffer), then five minutes pass.
    async fn cycle(&self, signals: &mut Signals) -> Result<()> {
        let deadline = || Instant::now() + Duration::from_secs(30);
        if let Some(b) = &self.buffer {
            b.consume(&self.pool, signals).await?;
        }
        let drained = self.drainer.drain_until(deadline()).await?;
        signals.count("drain", "retried", drained.retried);
        signals.count("drain", "dead_lettered", drained.dead_lettered);
        signals.count("drain", "repairs_failed", drained.repairs_failed);

        let sent = self.sender.send_until(deadline()).await?;
        signals.count("outbox", "retried", sent.retried);
        signals.count("outbox", "failed", sent.failed);

        if let BackfillRun::Completed { outcome, .. } = self.backfiller.run_once("drill").await? {
            signals.count("backfill", "gaps_found", outcome.new_candidates);
            signals.count("backfill", "backfilled", outcome.backfilled);
            signals.count("backfill", "tombstoned", outcome.tombstoned);
            signals.count("backfill", "fetch_errors", outcome.errors);
        }

        if let ReconcileOutcome::Completed { found, .. } =
            reconcile::run_once(&self.pool, &self.drainer, &self.reconcile, "drill").await?
        {
            let f = found;
            signals.count("reconcile", "pending_past_sla", f.pending_past_sla as u64);
            signals.count("reconcile", "orphaned_pending", f.orphaned_pending);
            signals.count("reconcile", "missing_effects", f.missing_effects);
            signals.count("reconcile", "missing_outbox", f.missing_outbox);
            signals.count("reconcile", "unrepairable", f.unrepairable);
            signals.count(
                "reconcile",
                "outbox_undelivered",
                f.outbox_undelivered_past_window as u64,
            );
            signals.count("reconcile", "outbox_failed", f.outbox_failed as u64);
            signals.count(
                "reconcile",
                "dead_letters_untriaged",
                f.dead_letters_untriaged as u64,
            );
        }
        retention::run_once(&self.pool, &self.retention, "drill").await?;
        let report = anomaly::run_once_with_buffer(
            &self.pool,
            &self.anomaly,
            "drill",
            self.buffer.as_ref().map(|b| &b.queue),
        )
        .await?;
        for breach in report.breaches {
            signals.note("checks", breach);
        }
        let samples = captured()
            .0
            .lock()
            .map(|mut s| std::mem::take(&mut *s))
            .unwrap_or_default();
        for alarm in alarms(&samples) {
            signals.note("alarm", alarm);
        }
        // The buffer-dead-letters alarm: SQS's own metric, any message visible in the buffer's
        // dead-letter queue.
        if let Some(b) = &self.buffer
            && b.depth().await?.dead_letters > 0
        {
            signals.note("alarm", "buffer-dead-letters".into());
        }
        faults::age(&self.pool, &self.clock, CYCLE_SECONDS).await?;
        Ok(())
    }
}

/// Ingest's answers, counted.
#[derive(Default)]
struct Answers(BTreeMap<String, usize>);

impl Answers {
    fn add(&mut self, answer: String) {
        *self.0.entry(answer).or_insert(0) += 1;
    }

    /// Every answer that is not a plain `accepted`, into the ingest column.
    fn into_signals(self, signals: &mut Signals) {
        for (answer, n) in self.0 {
            if answer != "accepted" {
                signals.note("ingest", format!("{answer}×{n}"));
            }
        }
    }
}

/// What each layer said, deduplicated in order.
#[derive(Default)]
struct Signals(BTreeMap<String, Vec<String>>);

impl Signals {
    fn note(&mut self, layer: &str, evidence: String) {
        let list = self.0.entry(layer.to_owned()).or_default();
        if !list.contains(&evidence) {
            list.push(evidence);
        }
    }

    /// Records `cycle` as the first of every layer that has noticed and had no first yet.
    fn mark_first(&self, cycle: u32, first: &mut BTreeMap<String, u32>) {
        for (layer, evidence) in &self.0 {
            if !evidence.is_empty() {
                first.entry(layer.clone()).or_insert(cycle);
            }
        }
    }

    /// Sums a count per layer and name across cycles.
    fn count(&mut self, layer: &str, name: &str, n: u64) {
        if n == 0 {
            return;
        }
        let list = self.0.entry(layer.to_owned()).or_default();
        let prefix = format!("{name}=");
        if let Some(entry) = list.iter_mut().find(|e| e.starts_with(&prefix)) {
            let before: u64 = entry[prefix.len()..].parse().unwrap_or(0);
            *entry = format!("{prefix}{}", before + n);
        } else {
            list.push(format!("{prefix}{n}"));
        }
    }
}

/// What a fault leaves for the repair check to look at.
#[derive(Default)]
struct Injected {
    ids: Vec<String>,
    entity: Option<String>,
    outbox_event: Option<String>,
    /// Held open for the fault's duration (vacuum starvation).
    session: Option<sqlx::PgConnection>,
}

async fn inject(
    fault: Fault,
    lab: &mut Lab,
    scale: Scale,
    signals: &mut Signals,
) -> Result<Injected> {
    let batch: Vec<u64> = (scale.batch + 1..=2 * scale.batch).collect();
    let ids = |ns: &[u64]| ns.iter().map(|&n| evt(n)).collect::<Vec<_>>();
    let mut injected = Injected::default();
    match fault {
        Fault::Control => {}
        Fault::LostDelivery => {
            let lost = batch[batch.len() / 2];
            let sent: Vec<u64> = batch.iter().copied().filter(|&n| n != lost).collect();
            lab.deliver(&sent, 1).await?.into_signals(signals);
            injected.ids = vec![evt(lost)];
            lab.delivered.push(lost);
        }
        Fault::DuplicateStorm => {
            lab.deliver(&batch, 5).await?.into_signals(signals);
            injected.ids = ids(&batch);
        }
        Fault::BatchElementRetried => {
            // A batch of three; then the second comes back, attempt 1, beside a new event.
            let mut duplicates = 0;
            for elements in [&[(1, 0), (2, 0), (3, 0)][..], &[(4, 0), (2, 1)][..]] {
                let reply = lab.deliver_crm(elements).await?;
                duplicates += reply["elements"]["duplicate"].as_u64().unwrap_or(0);
            }
            if duplicates > 0 {
                signals.note("ingest", format!("duplicate element×{duplicates}"));
            }
            injected.ids = (1..=4).map(|n| format!("62515:100:{n}")).collect();
        }
        Fault::Reordering => {
            let backwards: Vec<u64> = batch.iter().rev().copied().collect();
            lab.deliver(&backwards, 1).await?.into_signals(signals);
            injected.ids = ids(&batch);
        }
        Fault::DrainerKilled => {
            lab.deliver(&batch, 1).await?.into_signals(signals);
            faults::kill_drainer_mid_batch(&lab.pool, 50).await?;
            injected.ids = ids(&batch);
        }
        Fault::LostQueueRow => {
            lab.deliver(&batch, 1).await?.into_signals(signals);
            injected.ids = ids(&batch[3..6]);
            faults::delete_queue_rows(&lab.pool, &injected.ids).await?;
        }
        Fault::DeletedEffect => {
            faults::delete_entity(&lab.pool, "item-1").await?;
            injected.entity = Some("item-1".into());
        }
        Fault::DeletedOutboxRow => {
            injected.outbox_event = faults::delete_latest_outbox_row(&lab.pool, "item-2").await?;
            if injected.outbox_event.is_none() {
                return Err(DrillError::Setup(
                    "no outbox row to delete for item-2".into(),
                ));
            }
        }
        Fault::OutboxTargetDown => {
            lab.target.down.store(true, Ordering::SeqCst);
            lab.deliver(&batch, 1).await?.into_signals(signals);
        }
        Fault::PoisonEvent => {
            let answer = lab.deliver_shop("shop_poison_1", "drill.poison", 1).await?;
            let mut a = Answers::default();
            a.add(answer);
            a.into_signals(signals);
        }
        Fault::SignatureStorm => {
            let mut answers = Answers::default();
            for &n in batch.iter().cycle().take(30) {
                let body = serde_json::to_vec(&lab.provider_body(n)?).unwrap_or_default();
                let headers = Lab::signed("whsec_not_the_providers", &evt(n), &body)?;
                answers.add(lab.post("provider", headers, body).await);
            }
            answers.into_signals(signals);
            injected.ids = ids(&batch);
        }
        Fault::DigestConflict => {
            let n = 5;
            let mut body = lab.provider_body(n)?;
            body["data"]["object"]["label"] = serde_json::json!("rewritten after processing");
            let body = serde_json::to_vec(&body).unwrap_or_default();
            let headers = Lab::signed(PROVIDER_SECRET, &evt(n), &body)?;
            let mut a = Answers::default();
            a.add(lab.post("provider", headers, body).await);
            a.into_signals(signals);
        }
        Fault::SilentSource => {
            // The shop's steady hours, two weeks running, then nothing: the stored clock moves
            // so that the first of those hours sits in the middle of the last complete hour.
            let into_hour = faults::seconds_into_hour(&lab.pool).await?;
            lab.jump(into_hour + 1800.0).await?;
        }
        Fault::DatabaseDownNoRetry => {
            // Cut for ingest only; each delivery of the batch is made once and never again.
            lab.buffer()?.proxy.cut();
            let answers = lab.deliver(&batch, 1).await;
            lab.buffer()?.proxy.restore();
            answers?.into_signals(signals);
            injected.ids = ids(&batch);
        }
        Fault::PoisonBufferMessage => {
            let b = lab.buffer()?;
            b.queue
                .client()
                .send_message()
                .queue_url(b.queue.queue_url())
                .message_body(POISON_MESSAGE)
                .send()
                .await
                .map_err(|e| {
                    DrillError::Setup(format!(
                        "sending the poison message: {}",
                        aws_sdk_sqs::error::DisplayErrorContext(e)
                    ))
                })?;
            // A shop delivery buffered while the database is cut for ingest (its source known
            // to ingest from an earlier delivery: a warm cache)...
            lab.deliver_shop("shop_before_the_cut", "order.updated", 1)
                .await?;
            b.proxy.cut();
            let answer = lab
                .deliver_shop("shop_unreadable_meanwhile", "order.updated", 2)
                .await;
            lab.buffer()?.proxy.restore();
            let answer = answer?;
            if answer != "buffered" {
                return Err(DrillError::Setup(format!(
                    "the shop delivery was answered {answer}, not buffered"
                )));
            }
            // ... whose source reads its event type elsewhere by the time the consumer files it
            // (a field map changed meanwhile): the consumer cannot file it.
            let mut sources = drill_sources(&lab.api_url)?;
            for source in &mut sources {
                if source.source_id.as_str() == "shop" {
                    source.fields.event_type = FieldLocator::json("/no_such_field");
                }
            }
            sources::apply(&lab.pool, &sources).await?;
            injected.ids = vec!["shop_unreadable_meanwhile".into()];
        }
        Fault::VacuumStarvation => {
            injected.session = Some(faults::open_idle_transaction(&lab.pool).await?);
            // The one real wait: the open-transaction check reads pg_stat_activity, whose clock
            // the drill cannot age (threshold scaled to 1 s).
            tokio::time::sleep(Duration::from_millis(1100)).await;
        }
    }
    Ok(injected)
}

/// Work done before the fault: the baseline batch, and for the silent source its history.
async fn setup(fault: Fault, lab: &mut Lab, scale: Scale) -> Result<()> {
    let baseline: Vec<u64> = (1..=scale.batch).collect();
    lab.deliver(&baseline, 1).await?;
    if fault == Fault::BatchElementRetried {
        let crm = shared::sources::Source {
            source_id: source_id("crm")?,
            tenant_id: TenantId::parse(TENANT).map_err(|e| DrillError::Setup(e.to_string()))?,
            scheme: Scheme::Hubspot,
            secret_ref: "drill/crm".into(),
            tolerance: sources::DEFAULT_TOLERANCE,
            fields: FieldMap::defaults_for(Scheme::Hubspot),
            enabled: true,
            signed_url: Some(CRM_URL.into()),
            signature: None,
            layouts: None,
            json_form_field: None,
            address_check: None,
            partner: None,
            gaps: None,
        };
        sources::apply(&lab.pool, &[crm]).await?;
    }
    if fault == Fault::SilentSource {
        // The source has existed for a while; then two weeks of the same steady three hours,
        // so that whichever of them is the last complete hour while the drill watches, its
        // history says traffic.
        lab.jump(86_400.0).await?;
        for week in 0..2 {
            for hour in 0..3 {
                for i in 0..10 {
                    let id = format!("shop_w{week}_h{hour}_{i}");
                    // Every delivery a newer version: two changes under one version would be
                    // an ambiguous_version anomaly, which is not this fault.
                    let version = (week * 3 + hour) * 10 + i + 1;
                    lab.deliver_shop(&id, "order.updated", version).await?;
                }
                let next = if hour < 2 {
                    3600.0
                } else {
                    7.0 * 86_400.0 - 2.0 * 3600.0
                };
                lab.jump(next).await?;
            }
        }
    }
    let mut ignored = Signals::default();
    lab.cycle(&mut ignored).await?;
    captured().0.lock().map(|mut s| s.clear()).ok();
    Ok(())
}

/// Whether the fault's damage is gone.
async fn repaired(fault: Fault, lab: &Lab, injected: &Injected) -> Result<bool> {
    let all_processed = |ids: &[String]| {
        let ids = ids.to_vec();
        let pool = lab.pool.clone();
        async move { Ok::<_, DrillError>(faults::processed(&pool, &ids).await? == ids.len() as i64) }
    };
    Ok(match fault {
        Fault::Control => lab.projection_ok().await?,
        Fault::LostDelivery | Fault::LostQueueRow | Fault::DrainerKilled | Fault::Reordering => {
            all_processed(&injected.ids).await? && lab.projection_ok().await?
        }
        Fault::BatchElementRetried => {
            // Four events, five deliveries, each processed once.
            let (rows, deliveries) = faults::stored(&lab.pool, &injected.ids).await?;
            rows == 4 && deliveries == 5 && all_processed(&injected.ids).await?
        }
        Fault::DuplicateStorm => {
            let (rows, deliveries) = faults::stored(&lab.pool, &injected.ids).await?;
            rows == injected.ids.len() as i64
                && deliveries == 5 * rows
                && all_processed(&injected.ids).await?
                && lab.projection_ok().await?
        }
        Fault::DeletedEffect => lab.projection_ok().await?,
        Fault::DeletedOutboxRow => match &injected.outbox_event {
            Some(id) => faults::has_outbox_row(&lab.pool, id, "entity.changed").await?,
            None => false,
        },
        Fault::OutboxTargetDown => {
            !lab.target.down.load(Ordering::SeqCst) && faults::undelivered(&lab.pool).await? == 0
        }
        Fault::SignatureStorm => faults::stored(&lab.pool, &injected.ids).await?.0 == 0,
        // Resolved only by a human: the evidence stays.
        Fault::PoisonEvent => store::dead_letters::count_open(&lab.pool).await? == 0,
        Fault::DatabaseDownNoRetry => {
            // Every delivery of the cut stored exactly once, processed, and the buffer empty.
            let (rows, deliveries) = faults::stored(&lab.pool, &injected.ids).await?;
            let b = lab.buffer()?;
            rows == injected.ids.len() as i64
                && deliveries == rows
                && all_processed(&injected.ids).await?
                && lab.projection_ok().await?
                && b.depth().await?.is_empty()
        }
        // Resolved only by a human: the dead letter stays until redriven or discarded.
        Fault::PoisonBufferMessage => {
            let b = lab.buffer()?;
            b.depth().await?.is_empty()
        }
        Fault::DigestConflict | Fault::SilentSource | Fault::VacuumStarvation => false,
    })
}

async fn run_fault(
    base: &PgPool,
    fault: Fault,
    scale: Scale,
    keep: bool,
    sqs_endpoint: Option<&str>,
) -> Result<Row> {
    let started = Instant::now();
    let schema = fault.schema();
    let buffer = match sqs_endpoint {
        Some(endpoint) if fault.needs_buffer() => Some((endpoint, fault)),
        _ => None,
    };
    let mut lab = Lab::open(base, &schema, scale, buffer).await?;
    setup(fault, &mut lab, scale).await?;
    let mut signals = Signals::default();
    let mut injected = inject(fault, &mut lab, scale, &mut signals).await?;
    let mut first_noticed = BTreeMap::new();
    signals.mark_first(0, &mut first_noticed);

    let (limit, promise) = match fault.promise() {
        Promise::Human(_) => (scale.watch_cycles, fault.promise()),
        other => (scale.max_cycles, other),
    };
    let mut repair_cycle = None;
    if matches!(promise, Promise::Repaired | Promise::Harmless(_))
        && fault != Fault::OutboxTargetDown
        && fault != Fault::Control
        && repaired(fault, &lab, &injected).await?
    {
        repair_cycle = Some(0);
    }
    // The schedule runs at least once after every fault: some layers only speak then.
    let mut cycles = 0;
    while cycles == 0 || (repair_cycle.is_none() && cycles < limit) {
        cycles += 1;
        lab.cycle(&mut signals).await?;
        signals.mark_first(cycles, &mut first_noticed);
        if fault == Fault::OutboxTargetDown && cycles == 4 {
            lab.target.down.store(false, Ordering::SeqCst);
        }
        if fault == Fault::Control && cycles < 2 {
            continue;
        }
        if repair_cycle.is_none() && repaired(fault, &lab, &injected).await? {
            repair_cycle = Some(cycles);
        }
    }
    // What `hookctl status` says, with the buffer's queues when the fault has them (a dead
    // letter in the buffer is a delivery not accounted for).
    let settings = shared::status::StatusSettings::default();
    let report = shared::status::report(&lab.pool, &settings).await?;
    let report = match &lab.buffer {
        Some(b) => report.with_buffer(b.queue.read().await, &settings),
        None => report,
    };
    let status = report
        .findings
        .into_iter()
        .map(|f| {
            serde_json::to_value(f.kind)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default()
        })
        .collect::<Vec<_>>();
    if let Some(b) = &lab.buffer
        && !keep
    {
        b.delete_queues().await;
    }
    drop(injected.session.take());

    let noticed: BTreeMap<String, Vec<String>> = signals.0;
    let anyone = noticed.values().any(|v| !v.is_empty());
    let layers = noticed.values().filter(|v| !v.is_empty()).count();
    let layers_required = fault.layers_required();
    let mut problems = Vec::new();
    if layers < layers_required {
        problems.push(format!(
            "noticed by {layers} layer(s); the drill asks for {layers_required}"
        ));
    }
    if fault == Fault::OutboxTargetDown {
        // Seen before it is final: the checks and an alarm within two cycles of the target
        // going down, while its messages have most of their tries left.
        for layer in ["checks", "alarm"] {
            match first_noticed.get(layer) {
                Some(&cycle) if cycle <= 2 => {}
                Some(cycle) => problems.push(format!("{layer} noticed only in cycle {cycle}")),
                None => problems.push(format!("{layer} never noticed")),
            }
        }
    }
    let (repair, harmless) = match promise {
        Promise::Repaired => match repair_cycle {
            Some(0) => (Repair::NothingToRepair, None),
            Some(c) => (Repair::Repaired { cycles: c }, None),
            None => {
                problems.push(format!("not repaired within {limit} cycles"));
                (Repair::NotRepaired { cycles: limit }, None)
            }
        },
        Promise::Harmless(why) => {
            let repair = match repair_cycle {
                _ if fault == Fault::Control && repair_cycle.is_some() => Repair::NothingToRepair,
                Some(0) => Repair::NothingToRepair,
                Some(c) => Repair::Repaired { cycles: c },
                None => {
                    problems.push(format!("damage left after {limit} cycles"));
                    Repair::NotRepaired { cycles: limit }
                }
            };
            (repair, Some(why.to_owned()))
        }
        Promise::Human(why) => (
            Repair::NeedsHuman {
                why: why.to_owned(),
            },
            None,
        ),
    };
    if fault == Fault::Control {
        if anyone {
            problems.push("the control noticed something: noise in every row".into());
        }
    } else if !anyone && harmless.is_none() {
        problems.push("no layer noticed it".into());
    }
    if matches!(fault.promise(), Promise::Human(_)) && status.is_empty() {
        problems.push("`hookctl status` says accounted for while a human is needed".into());
    }
    drop(lab);
    if !keep {
        faults::drop_schema(base, &schema).await?;
    }
    Ok(Row {
        fault: fault.name().into(),
        what: fault.what().into(),
        noticed,
        first_noticed,
        layers,
        layers_required,
        one_layer_why: fault.one_layer_why().map(str::to_owned),
        harmless_by_design: harmless,
        repair,
        status,
        problems,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Runs the drill against the database `base` (in scratch schemas) and prints the matrix.
pub async fn run(base: PgPool, args: DrillArgs, json: bool) -> u8 {
    let scale = Scale::of(args.short);
    let selected: Vec<Fault> = FAULTS
        .iter()
        .copied()
        .filter(|f| {
            *f == Fault::Control
                || args.faults.is_empty()
                || args.faults.iter().any(|n| n == f.name())
        })
        .collect();
    if let Some(unknown) = args
        .faults
        .iter()
        .find(|n| !FAULTS.iter().any(|f| f.name() == n.as_str()))
    {
        eprintln!("hookctl drill: no fault {unknown:?}");
        return 2;
    }
    // The buffer's faults need an SQS: the endpoint the local runner uses, else moto's.
    let sqs_endpoint = ["SQS_ENDPOINT", "MOTO_ENDPOINT"]
        .iter()
        .find_map(|name| std::env::var(name).ok().filter(|v| !v.is_empty()));
    let _ = captured();
    let terminal = std::io::stderr().is_terminal();
    let bar = ProgressBar::new(selected.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("drill {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut rows = Vec::new();
    for (i, fault) in selected.iter().enumerate() {
        bar.set_message(fault.name());
        if !terminal {
            eprintln!("drill [{}/{}] {} ...", i + 1, selected.len(), fault.name());
        }
        if fault.needs_buffer() && sqs_endpoint.is_none() {
            let row = skipped(
                *fault,
                "no SQS to buffer to: set SQS_ENDPOINT (or MOTO_ENDPOINT)",
            );
            if !terminal {
                eprintln!(
                    "drill [{}/{}] {}: {}",
                    i + 1,
                    selected.len(),
                    row.fault,
                    repair_cell(&row.repair)
                );
            }
            rows.push(row);
            bar.inc(1);
            continue;
        }
        match run_fault(&base, *fault, scale, args.keep, sqs_endpoint.as_deref()).await {
            Ok(row) => {
                if !terminal {
                    eprintln!(
                        "drill [{}/{}] {}: {} ({:.1} s)",
                        i + 1,
                        selected.len(),
                        row.fault,
                        repair_cell(&row.repair),
                        row.seconds
                    );
                }
                rows.push(row);
            }
            Err(e) => {
                bar.finish_and_clear();
                let _ = faults::drop_schema(&base, &fault.schema()).await;
                eprintln!("hookctl drill: {}: {e}", fault.name());
                return 2;
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let ok = rows.iter().all(|r| r.problems.is_empty());
    let buffered = selected.iter().any(|f| f.needs_buffer()) && sqs_endpoint.is_some();
    let mut notes = vec![
            format!("a cycle runs drain, outbox, backfill, reconcile, retention and the anomaly checks once, then ages the stored clock {} min", CYCLE_SECONDS / 60.0),
            "longest_open_transaction_seconds is judged at 1 s instead of 300 s: pg_stat_activity's clock cannot be aged".into(),
            "events_dead_tuple_ratio is not judged: aging rewrites every row each cycle".into(),
        ];
    if buffered {
        notes.extend([
            format!("the buffer's faults: ingest in spillover (direct attempt bounded at {} ms) on its own queues at the SQS endpoint, reaching PostgreSQL through a proxy the drill cuts; the consumer runs first in each cycle until the buffer is empty; its counts are in the ingest column (buffer_*)", DRILL_SPILL_AFTER.as_millis()),
            format!("the drill's buffer hands a message out {BUFFER_MAX_RECEIVES} times, {BUFFER_VISIBILITY_SECONDS} s apart, before the dead-letter queue (the stack: 5 times, 480 s)"),
            "buffer-oldest-message-age is not judged: SQS's clock cannot be aged".into(),
        ]);
    }
    let matrix = Matrix {
        short: args.short,
        ok,
        rows,
        notes,
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&matrix).unwrap_or_default()
        );
    } else {
        print!("{}", render(&matrix));
    }
    if ok { 0 } else { 1 }
}

/// The row of a fault that could not run here.
fn skipped(fault: Fault, why: &str) -> Row {
    Row {
        fault: fault.name().into(),
        what: fault.what().into(),
        noticed: BTreeMap::new(),
        first_noticed: BTreeMap::new(),
        layers: 0,
        layers_required: fault.layers_required(),
        one_layer_why: fault.one_layer_why().map(str::to_owned),
        harmless_by_design: None,
        repair: Repair::Skipped { why: why.into() },
        status: Vec::new(),
        problems: Vec::new(),
        seconds: 0.0,
    }
}

fn repair_cell(r: &Repair) -> String {
    match r {
        Repair::Repaired { cycles } => format!("yes, {cycles} cycle(s)"),
        Repair::NothingToRepair => "nothing to repair".into(),
        Repair::NeedsHuman { .. } => "no: needs a human".into(),
        Repair::NotRepaired { cycles } => format!("NOT REPAIRED in {cycles} cycles"),
        Repair::Skipped { .. } => "SKIPPED (not run)".into(),
    }
}

/// How many layers noticed, of how many the drill asks for.
fn layers_cell(r: &Row) -> String {
    if matches!(r.repair, Repair::Skipped { .. }) {
        "-".into()
    } else if r.layers_required == 0 {
        format!("{} of 0", r.layers)
    } else {
        format!("{} of ≥{}", r.layers, r.layers_required)
    }
}

/// The first piece of evidence of a layer, and how many more.
fn cell(evidence: Option<&Vec<String>>) -> String {
    match evidence.map(Vec::as_slice) {
        None | Some([]) => "-".into(),
        Some([one]) => one.clone(),
        Some([first, rest @ ..]) => format!("{first} +{}", rest.len()),
    }
}

pub fn render(m: &Matrix) -> String {
    use std::fmt::Write as _;
    let mut t = Table::new();
    t.load_style(presets::ASCII_MARKDOWN);
    let mut header = vec!["fault".to_owned()];
    header.extend(LAYERS.iter().map(|l| (*l).to_owned()));
    header.extend([
        "layers".into(),
        "repaired, no human".into(),
        "status after".into(),
    ]);
    t.set_header(header);
    for r in &m.rows {
        let mut row = vec![r.fault.clone()];
        for layer in LAYERS {
            row.push(cell(r.noticed.get(layer)));
        }
        row.push(layers_cell(r));
        row.push(repair_cell(&r.repair));
        row.push(if matches!(r.repair, Repair::Skipped { .. }) {
            "-".into()
        } else if r.status.is_empty() {
            "accounted for".into()
        } else {
            r.status.join(", ")
        });
        t.add_row(row);
    }
    let mut out = format!(
        "FAULT DRILL ({} form)\n\n{t}\n\nWHAT EACH FAULT WAS AND WHAT EACH LAYER SAID\n",
        if m.short { "short" } else { "full" }
    );
    for r in &m.rows {
        let _ = writeln!(out, "{}: {} ({:.1} s)", r.fault, r.what, r.seconds);
        for layer in LAYERS {
            if let Some(e) = r.noticed.get(layer).filter(|e| !e.is_empty()) {
                let _ = writeln!(out, "    {layer:<10} {}", e.join(", "));
            }
        }
        if let Some(why) = &r.harmless_by_design {
            let _ = writeln!(out, "    by design  {why}");
        }
        if let Some(why) = &r.one_layer_why {
            let _ = writeln!(out, "    one layer  {why}");
        }
        if let Repair::NeedsHuman { why } = &r.repair {
            let _ = writeln!(out, "    human      {why}");
        }
        if let Repair::Skipped { why } = &r.repair {
            let _ = writeln!(out, "    SKIPPED    {why}");
        }
        for p in &r.problems {
            let _ = writeln!(out, "    PROBLEM    {p}");
        }
    }
    for n in &m.notes {
        let _ = writeln!(out, "note: {n}");
    }
    let human = m
        .rows
        .iter()
        .filter(|r| matches!(r.repair, Repair::NeedsHuman { .. }))
        .count();
    let harmless = m
        .rows
        .iter()
        .filter(|r| r.harmless_by_design.is_some() && r.fault != Fault::Control.name())
        .count();
    let skipped: Vec<&str> = m
        .rows
        .iter()
        .filter(|r| matches!(r.repair, Repair::Skipped { .. }))
        .map(|r| r.fault.as_str())
        .collect();
    let skipped = if skipped.is_empty() {
        String::new()
    } else {
        format!(" ({} not run: {})", skipped.len(), skipped.join(", "))
    };
    if m.ok {
        let _ = writeln!(
            out,
            "\nVERDICT: every fault noticed by as many layers as the drill asks for (two or more, or one where the row says why; {harmless} harmless by design, noticed by none), every repairable fault repaired with no human step; {human} need a human, and `hookctl status` says so{skipped}"
        );
    } else {
        let failed: Vec<&str> = m
            .rows
            .iter()
            .filter(|r| !r.problems.is_empty())
            .map(|r| r.fault.as_str())
            .collect();
        let _ = writeln!(out, "\nVERDICT: FAILED: {}", failed.join(", "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 23: two layers for every fault that is not harmless by design, unless it says why
    /// one is the most it can have.
    #[test]
    fn every_fault_not_harmless_by_design_asks_for_two_layers() {
        for fault in FAULTS {
            match fault.promise() {
                Promise::Harmless(_) => assert_eq!(fault.layers_required(), 0, "{fault:?}"),
                _ if fault.layers_required() == 1 => {
                    assert!(fault.one_layer_why().is_some(), "{fault:?}: say why")
                }
                _ => assert!(fault.layers_required() >= 2, "{fault:?}"),
            }
            if fault.one_layer_why().is_some() {
                assert_eq!(fault.layers_required(), 1, "{fault:?}");
            }
            assert!(fault.layers_required() <= LAYERS.len(), "{fault:?}");
        }
    }
}
