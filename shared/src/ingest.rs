//! The ingest path: a delivery in, a durable receipt out.
//!
//! In order: the route's source id, the body size, the source (cached), its secrets (cached),
//! the signature over the raw bytes, then either a signed handshake answered (Slack's
//! `url_verification`, nothing stored) or the event's fields and one upsert statement. Nothing is
//! written for a delivery that fails before the fields (401/404/413); a signed delivery whose
//! fields cannot be read is recorded as an anomaly, never queued. A receipt is returned only
//! after the upsert committed.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::HeaderMap;
use sha2::{Digest, Sha256};
use sqlx::PgPool;

use crate::address_ranges::{AddressCheck, Lookup, RangeCache};
use crate::batches::ElementCounts;
use crate::buffer::{
    BufferMode, BufferQueue, BufferedDelivery, ENVELOPE_VERSION, Envelope, QueueError,
};
use crate::config::{ConfigError, IngestSettings, SecretsBackend};
use crate::database::Database;
use crate::domain::{ExternalId, SecretVersion, SourceId};
use crate::extract::ExtractError;
pub use crate::prepare::{Prepared, kept_headers, prepare};
use crate::protocol::{self, HandshakeReply};
use crate::secrets::{SecretError, SecretStore};
use crate::signature::{self, VerifyError};
use crate::sources::{Source, SourceRegistry};
use crate::store::StoreError;
use crate::store::batch_requests::{self, NewBatchRequest};
use crate::store::ingest_anomalies::{self, UnreadableDelivery};
use crate::store::provider_notices::{self, NewNotice};
use crate::store::webhook_events::{
    self, BatchedEvent, DeliveryOutcome, NewEvent, UpsertError, Upserted,
};

/// One HTTP delivery, as received.
#[derive(Debug, Clone, Copy)]
pub struct Delivery<'a> {
    /// The `{source_id}` route segment, unparsed.
    pub source_id: &'a str,
    pub headers: &'a HeaderMap,
    /// The raw body bytes, exactly as signed.
    pub body: &'a [u8],
    /// The HTTP method, upper case.
    pub method: &'a str,
    /// The URL the request arrived at (`https://host/path?query`), for the schemes that sign
    /// it; a source's configured `url` takes its place.
    pub url: Option<&'a str>,
    /// The address the request came from, as the network saw it (API Gateway's
    /// `requestContext.http.sourceIp`, the local runner's TCP peer), never a header the sender
    /// writes (`X-Forwarded-For`); `None` when not known.
    pub source_ip: Option<IpAddr>,
    /// The client certificate the request came with: API Gateway's mutual TLS on the partner
    /// domain, the local runner's partner listener; `None` elsewhere. What a partner source
    /// (`crate::partners`) pins.
    pub client_certificate: Option<&'a crate::partners::ClientCertificate>,
}

/// What a verified delivery turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Received {
    /// An event, stored.
    Stored(Receipt),
    /// The database could not take it (spillover) or the mode sends everything there (queue):
    /// SQS acknowledged it, and the buffer's consumer files it.
    Buffered {
        delivery_id: String,
        /// As [`Receipt::acknowledge`].
        acknowledge: Option<u16>,
    },
    /// A signed handshake the provider sends to check the endpoint (Slack's
    /// `url_verification`, Zoom's URL validation, ...): answered as the provider requires,
    /// nothing stored.
    Handshake(HandshakeReply),
    /// A signed message about the subscription, not an event of it (Twitch's `revocation`):
    /// kept in `provider_notices` (committed), answered 204, no event stored.
    Notice { kind: String },
}

/// A stored delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    pub outcome: DeliveryOutcome,
    pub external_id: ExternalId,
    pub delivery_count: i32,
    /// For a batch (`crate::batches`): what became of its elements, each stored as its own
    /// event; `outcome`, `external_id` and `delivery_count` are then its first element's.
    pub elements: Option<ElementCounts>,
    /// The status the provider requires, with an empty body, for an event it delivered
    /// (Discord's Webhook Events: 204); `None`: 200 with the JSON receipt.
    pub acknowledge: Option<u16>,
}

/// Why a delivery was not stored. The ingest function maps each to one HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("no enabled source with this id")]
    UnknownSource,
    /// A verified request that is not a POST and not the provider's handshake (only Okta
    /// verifies an endpoint with a GET).
    #[error("only POST delivers an event")]
    MethodNotAllowed,
    #[error("body of {actual} bytes exceeds the limit of {limit}")]
    PayloadTooLarge { actual: usize, limit: usize },
    /// A batch of more events than one request may carry: nothing stored.
    #[error("a batch of {count} events exceeds the limit of {limit}")]
    TooManyEvents { count: usize, limit: usize },
    #[error("signature rejected: {0}")]
    Signature(#[source] VerifyError),
    #[error("signed delivery cannot be filed: {0}")]
    Unreadable(#[source] ExtractError),
    #[error("signing secret unavailable: {0}")]
    Secret(#[source] SecretError),
    /// A signed delivery from outside its provider's published address ranges, to a source
    /// that enforces them (`crate::address_ranges`); `address` is `None` when the request's
    /// address was not known.
    #[error("the source address {} is outside {provider}'s published webhook address ranges", .address.map_or_else(|| "(unknown)".to_owned(), |a| a.to_string()))]
    OutsideProviderRanges {
        provider: &'static str,
        address: Option<IpAddr>,
    },
    /// A partner source's request that its rules refuse: no or an unpinned client
    /// certificate, an address outside its CIDRs, no or a stale timestamp.
    #[error("partner refused: {0}")]
    Partner(#[source] crate::partners::PartnerRefusal),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Neither the database nor the buffer took the delivery.
    #[error("neither store took the delivery: {database}; the buffer: {buffer}")]
    Unavailable { database: String, buffer: String },
}

impl IngestError {
    /// A short stable label for logs and metrics.
    pub fn reason_code(&self) -> &'static str {
        match self {
            IngestError::UnknownSource => "unknown_source",
            IngestError::MethodNotAllowed => "method_not_allowed",
            IngestError::PayloadTooLarge { .. } => "payload_too_large",
            IngestError::TooManyEvents { .. } => "too_many_events",
            IngestError::Signature(e) => e.reason_code(),
            IngestError::Unreadable(e) => e.anomaly_kind(),
            IngestError::Secret(_) => "secret_unavailable",
            IngestError::OutsideProviderRanges { .. } => "outside_provider_ranges",
            IngestError::Partner(refusal) => refusal.reason_code(),
            IngestError::Store(e) if e.is_retryable() => "database_unavailable",
            IngestError::Store(_) => "database_error",
            IngestError::Unavailable { .. } => "database_and_buffer_unavailable",
        }
    }

    /// The answer's status when the refusal is kept for the operator
    /// (`store::refused_deliveries`): a delivery of a known source refused for what it is (its
    /// signature, method, size or fields). `None` for an unknown source (counted, not kept) and
    /// for this side's failures (a secret or the database unavailable), which are not the
    /// delivery's.
    pub fn kept_refusal_status(&self) -> Option<u16> {
        match self {
            IngestError::Signature(VerifyError::UnusableSecret { .. }) => Some(500),
            IngestError::Signature(_) => Some(401),
            IngestError::MethodNotAllowed => Some(405),
            IngestError::PayloadTooLarge { .. } | IngestError::TooManyEvents { .. } => Some(413),
            IngestError::Unreadable(_) => Some(400),
            IngestError::OutsideProviderRanges { .. } => Some(403),
            IngestError::Partner(refusal) => Some(refusal.status()),
            IngestError::UnknownSource
            | IngestError::Secret(_)
            | IngestError::Store(_)
            | IngestError::Unavailable { .. } => None,
        }
    }

    /// The `Reason` dimension of the refused-deliveries metric: few values, stable.
    pub fn metric_reason(&self) -> &'static str {
        match self {
            IngestError::UnknownSource => "unknown_source",
            IngestError::MethodNotAllowed => "method_not_allowed",
            IngestError::PayloadTooLarge { .. } | IngestError::TooManyEvents { .. } => "too_large",
            IngestError::Signature(VerifyError::UnusableSecret { .. }) => "misconfigured",
            IngestError::Signature(_) => "signature",
            IngestError::Unreadable(_) => "unreadable",
            IngestError::OutsideProviderRanges { .. } => "address",
            IngestError::Partner(refusal) => refusal.reason_code(),
            IngestError::Secret(e) if e.is_misconfiguration() => "misconfigured",
            IngestError::Secret(_) | IngestError::Store(_) | IngestError::Unavailable { .. } => {
                "unavailable"
            }
        }
    }
}

/// How long the address ranges are cached by an ingest built with [`Ingestor::new`]; from
/// settings, `SOURCE_CACHE_TTL_SECONDS`.
pub const DEFAULT_RANGES_TTL: Duration = Duration::from_secs(30);

/// Limits applied before any work is done on a delivery.
#[derive(Debug, Clone, Copy)]
pub struct IngestLimits {
    pub max_body_bytes: usize,
}

/// The ingest path and its dependencies, built once per process.
pub struct Ingestor {
    /// The pool, with what reads its credentials when they are refused or unread.
    database: Database,
    sources: Arc<SourceRegistry>,
    secrets: Arc<SecretStore>,
    limits: IngestLimits,
    /// The second buffer (`BUFFER_MODE` spillover or queue); `None` in database mode.
    buffer: Option<Buffer>,
    /// When a refusal of each source and check was last kept.
    refusals: Pace<(String, &'static str)>,
    /// The providers' published address ranges, cached.
    ranges: RangeCache,
    /// When each partner certificate was last recorded as seen.
    certificates_seen: Pace<(String, [u8; 32])>,
}

/// At most one write an interval for each key, the others counted into the next one written:
/// refusals (a source and the check its delivery failed, a second: a flood of forgeries costs
/// a write a second) and partners' certificates seen (a source and a certificate, a minute: its
/// expiry is what the record is for, not each request).
struct Pace<K> {
    every: Duration,
    /// When each key was last written, and how many were skipped since.
    last: std::sync::Mutex<std::collections::HashMap<K, (std::time::Instant, u32)>>,
}

impl<K: std::hash::Hash + Eq> Pace<K> {
    fn every(every: Duration) -> Self {
        Pace {
            every,
            last: Default::default(),
        }
    }

    /// `Some(skipped since the last written)` when this one is to be written.
    fn admit(&self, key: K) -> Option<u32> {
        let now = std::time::Instant::now();
        let mut last = self.last.lock().ok()?;
        match last.get_mut(&key) {
            Some((at, skipped)) if now.duration_since(*at) < self.every => {
                *skipped = skipped.saturating_add(1);
                None
            }
            Some((at, skipped)) => {
                *at = now;
                Some(std::mem::take(skipped))
            }
            None => {
                last.insert(key, (now, 0));
                Some(0)
            }
        }
    }
}

/// The second buffer as ingest uses it: its mode, its queue, how long the direct path may try
/// first (spillover), and how long after the database failed a delivery the next ones go
/// straight to the buffer.
pub struct Buffer {
    pub mode: BufferMode,
    pub queue: BufferQueue,
    pub spill_after: Duration,
    pub spill_hold: Duration,
    /// Until when deliveries go straight to the buffer (the database failed one just now).
    holding_until: std::sync::Mutex<Option<std::time::Instant>>,
}

impl Buffer {
    pub fn new(
        mode: BufferMode,
        queue: BufferQueue,
        spill_after: Duration,
        spill_hold: Duration,
    ) -> Self {
        Self {
            mode,
            queue,
            spill_after,
            spill_hold,
            holding_until: std::sync::Mutex::new(None),
        }
    }

    fn holding(&self) -> bool {
        let until = *self.holding_until.lock().unwrap_or_else(|p| p.into_inner());
        until.is_some_and(|until| std::time::Instant::now() < until)
    }

    fn hold(&self) {
        *self.holding_until.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(std::time::Instant::now() + self.spill_hold);
    }

    fn release(&self) {
        *self.holding_until.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// A delivery that passed every check before storage: its source, how it was verified, when it
/// was received, and its fields (or why they cannot be read).
struct Admitted<'d> {
    delivery: Delivery<'d>,
    /// The body as kept: the delivery's, or without the shared token it carried
    /// ([`crate::prepare::without_tokens`]).
    body: Cow<'d, [u8]>,
    source: Arc<Source>,
    verified: signature::Verified,
    received_at_micros: i64,
    prepared: Result<Prepared, ExtractError>,
    /// The source address, when it lay outside the provider's ranges and the source observes:
    /// counted once the delivery is stored.
    outside_ranges: Option<IpAddr>,
}

/// What a delivery turned out to be before storage.
enum Admission<'d> {
    Event(Box<Admitted<'d>>),
    Handshake(HandshakeReply),
    Notice {
        source: Arc<Source>,
        notice: protocol::Notice,
        body: Cow<'d, [u8]>,
    },
}

impl Ingestor {
    pub fn new(
        pool: PgPool,
        sources: Arc<SourceRegistry>,
        secrets: Arc<SecretStore>,
        limits: IngestLimits,
    ) -> Self {
        Self {
            ranges: RangeCache::new(pool.clone(), DEFAULT_RANGES_TTL),
            database: Database::from_pool(pool),
            sources,
            secrets,
            limits,
            buffer: None,
            refusals: Pace::every(Duration::from_secs(1)),
            certificates_seen: Pace::every(Duration::from_secs(60)),
        }
    }

    /// The same ingest path reading the providers' address ranges through `ranges` (a cache
    /// with another TTL: tests read a refresh at once).
    pub fn with_address_ranges(mut self, ranges: RangeCache) -> Self {
        self.ranges = ranges;
        self
    }

    /// The same ingest path with a second buffer (spillover or queue mode).
    pub fn with_buffer(mut self, buffer: Buffer) -> Self {
        self.buffer = (buffer.mode != BufferMode::Database).then_some(buffer);
        self
    }

    /// Builds the pool (lazily connected), the source cache, the secret store and the buffer's
    /// client from settings. A database secret Secrets Manager cannot serve now does not fail
    /// the start: deliveries are answered as the database being unavailable (503) until it can
    /// be read.
    pub async fn from_settings(settings: &IngestSettings) -> Result<Self, ConfigError> {
        let aws = match &settings.secrets {
            SecretsBackend::Aws(aws) => aws.clone(),
            SecretsBackend::File(_) => crate::config::Vars::process().aws_secrets()?,
        };
        let database = Database::open_or_read_later(settings.database.clone(), aws).await?;
        let secrets = settings
            .secrets
            .open_with_stale_if_error(settings.stale_if_error)
            .await;
        let sources = SourceRegistry::new(database.pool().clone(), settings.source_cache_ttl)
            .with_stale_if_error(settings.stale_if_error);
        let buffer = match &settings.buffer.queue {
            Some(queue) if settings.buffer.mode != BufferMode::Database => Some(Buffer::new(
                settings.buffer.mode,
                BufferQueue::connect(queue).await,
                settings.buffer.spill_after,
                settings.buffer.spill_hold,
            )),
            _ => None,
        };
        Ok(Self {
            ranges: RangeCache::new(database.pool().clone(), settings.source_cache_ttl),
            database,
            sources: Arc::new(sources),
            secrets: Arc::new(secrets),
            limits: IngestLimits {
                max_body_bytes: settings.max_body_bytes,
            },
            buffer,
            refusals: Pace::every(Duration::from_secs(1)),
            certificates_seen: Pace::every(Duration::from_secs(60)),
        })
    }

    pub fn pool(&self) -> &PgPool {
        self.database.pool()
    }

    /// Where the signing secrets are read.
    pub fn secrets(&self) -> &Arc<SecretStore> {
        &self.secrets
    }

    /// The buffer mode this ingest runs in.
    pub fn buffer_mode(&self) -> BufferMode {
        self.buffer
            .as_ref()
            .map_or(BufferMode::Database, |b| b.mode)
    }

    /// Verifies and stores one delivery. Logs one line either way, in a span naming the
    /// source, tenant and event (never the payload or a secret).
    #[tracing::instrument(
        skip_all,
        fields(source_id = delivery.source_id, tenant_id, external_id, outcome, verified_with, bytes = delivery.body.len())
    )]
    pub async fn receive(&self, delivery: Delivery<'_>) -> Result<Received, IngestError> {
        let mut outside_ranges = None;
        let result = self.admit_and_store(delivery, &mut outside_ranges).await;
        // Counted where the database took the delivery (stored, or kept as an anomaly); a
        // buffered one is counted in the metric only, with no write while the database fails.
        if let Some((source, address)) = outside_ranges
            && matches!(
                result,
                Ok(Received::Stored(_)) | Err(IngestError::Unreadable(_))
            )
        {
            self.count_outside_ranges(&source, address, false).await;
        }
        match &result {
            Ok(Received::Stored(receipt)) => {
                crate::metrics::delivery_stored(receipt.outcome.as_str());
                tracing::info!(delivery_count = receipt.delivery_count, "stored");
            }
            Ok(Received::Buffered { delivery_id, .. }) => {
                let mode = self.buffer_mode().as_str();
                crate::metrics::delivery_buffered(mode);
                tracing::info!(%delivery_id, mode, "buffered: SQS acknowledged the delivery");
            }
            Ok(Received::Handshake { .. }) => {
                tracing::info!("endpoint handshake answered; nothing stored");
            }
            Ok(Received::Notice { kind }) => {
                tracing::info!(%kind, "provider notice answered; no event stored");
            }
            Err(error) => {
                crate::metrics::delivery_refused(error.metric_reason());
                tracing::warn!(reason = error.reason_code(), %error, "delivery refused");
                self.keep_refusal(&delivery, error).await;
            }
        }
        result
    }

    /// Records that a partner's admitted request came with `certificate` (at most once a
    /// minute each): the `partner_certificates_expiring` check reads its expiry. Never fails
    /// the answer: a record that cannot be written is logged.
    async fn partner_certificate_seen(
        &self,
        source: &crate::sources::Source,
        certificate: &crate::partners::ClientCertificate,
    ) {
        let key = (source.source_id.as_str().to_owned(), certificate.sha256);
        if self.certificates_seen.admit(key).is_none() {
            return;
        }
        let seen = crate::store::partner_certificates::Seen {
            source_id: source.source_id.as_str(),
            sha256: &certificate.sha256,
            subject: certificate.subject.as_deref(),
            not_after: certificate.not_after,
        };
        if let Err(error) =
            crate::store::partner_certificates::record(self.database.pool(), &seen).await
        {
            tracing::warn!(%error, "a partner's certificate could not be recorded as seen");
        }
    }

    /// Keeps a refused delivery of a known source for the operator (`refused_deliveries`): at
    /// most one a second for each source and check, the others counted into the next one kept.
    /// Never fails the answer: a refusal that cannot be kept is logged.
    async fn keep_refusal(&self, delivery: &Delivery<'_>, error: &IngestError) {
        let Some(status) = error.kept_refusal_status() else {
            return;
        };
        let Ok(source_id) = SourceId::parse(delivery.source_id) else {
            return;
        };
        let Ok(Some(source)) = self.sources.get(&source_id).await else {
            return;
        };
        let check = error.reason_code();
        let Some(also_refused) = self
            .refusals
            .admit((source.source_id.as_str().to_owned(), check))
        else {
            return;
        };
        let header = |name: http::HeaderName| {
            delivery
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(|v| v.chars().take(200).collect::<String>())
        };
        let (user_agent, content_type) = (
            header(http::header::USER_AGENT),
            header(http::header::CONTENT_TYPE),
        );
        let detail = error.to_string();
        let refusal = crate::store::refused_deliveries::NewRefusal {
            tenant_id: source.tenant_id.as_str(),
            source_id: source.source_id.as_str(),
            status,
            reason: error.metric_reason(),
            check_failed: check,
            detail: &detail,
            method: delivery.method,
            body_bytes: delivery.body.len(),
            body_sha256: Sha256::digest(delivery.body).into(),
            header_names: delivery
                .headers
                .keys()
                .take(64)
                .map(|name| name.as_str().to_owned())
                .collect(),
            user_agent: user_agent.as_deref(),
            content_type: content_type.as_deref(),
            also_refused,
        };
        if let Err(error) =
            crate::store::refused_deliveries::record(self.database.pool(), &refusal).await
        {
            tracing::warn!(%error, "the refusal could not be kept; it is counted in the metric");
        }
    }

    /// Admits the delivery (source, signature, fields), then stores it where the buffer mode
    /// says: directly, directly and else in SQS (spillover), or in SQS and else directly
    /// (queue). A delivery whose fields cannot be read is recorded directly as an anomaly first
    /// in every mode (it is answered 400); only when the database cannot take it is it buffered,
    /// for the consumer to record.
    /// `outside_ranges` is set to the source and address of an admitted delivery from outside
    /// its provider's ranges (the source observes), for `receive` to count once it is stored.
    async fn admit_and_store(
        &self,
        delivery: Delivery<'_>,
        outside_ranges: &mut Option<(Arc<Source>, IpAddr)>,
    ) -> Result<Received, IngestError> {
        let seen = self.database.credentials_seen();
        let admission = match self.admit(delivery).await {
            Err(IngestError::Store(error)) if self.database.recover(&error, seen).await => {
                tracing::info!(%error, "credentials read again: admitting once more");
                self.admit(delivery).await?
            }
            result => result?,
        };
        let admitted = match admission {
            Admission::Handshake(reply) => return Ok(Received::Handshake(reply)),
            Admission::Notice {
                source,
                notice,
                body,
            } => {
                // Kept before the answer, whatever the buffer's mode: a 2xx follows a commit.
                provider_notices::record(
                    self.database.pool(),
                    &NewNotice {
                        tenant_id: source.tenant_id.as_str(),
                        source_id: source.source_id.as_str(),
                        kind: &notice.kind,
                        subject: notice.subject.as_deref(),
                        detail: notice.detail.as_deref(),
                        payload: &body,
                    },
                )
                .await?;
                tracing::warn!(kind = %notice.kind, subject = ?notice.subject, detail = ?notice.detail, "provider notice kept");
                return Ok(Received::Notice { kind: notice.kind });
            }
            Admission::Event(admitted) => admitted,
        };
        if let Some(address) = admitted.outside_ranges {
            *outside_ranges = Some((admitted.source.clone(), address));
        }
        let Some(buffer) = &self.buffer else {
            return self.store_with_current_credentials(&admitted).await;
        };
        if buffer.mode == BufferMode::Queue && admitted.prepared.is_ok() {
            match self.send_to_buffer(buffer, &admitted).await {
                Ok(received) => return Ok(received),
                Err(error) => {
                    tracing::warn!(%error, "the buffer did not take the delivery: storing it directly");
                    return self.store_with_current_credentials(&admitted).await;
                }
            }
        }
        // The database just failed a delivery: spill at once for `spill_hold` rather than make
        // every delivery of an outage wait `spill_after` first. Should SQS refuse, the direct
        // path is tried after all.
        if buffer.holding() {
            match self.send_to_buffer(buffer, &admitted).await {
                Ok(received) => return Ok(received),
                Err(error) => {
                    tracing::warn!(%error, "the buffer did not take the delivery: trying the database")
                }
            }
        }
        let direct = tokio::time::timeout(
            buffer.spill_after,
            self.store_with_current_credentials(&admitted),
        )
        .await;
        // Whatever the database answered, short of a receipt: an outage, and also a refusal of
        // another class (a read-only database during a failover, 25006; an I/O fault, 58030).
        // The delivery was admitted; the buffer keeps it and the consumer files it later.
        let database = match direct {
            Ok(Err(IngestError::Store(error))) => error.to_string(),
            Err(_) => format!(
                "the direct path did not commit within {} ms",
                buffer.spill_after.as_millis()
            ),
            Ok(result) => {
                buffer.release();
                return result;
            }
        };
        buffer.hold();
        tracing::warn!(%database, "spilling to the buffer: the database cannot take the delivery");
        self.send_to_buffer(buffer, &admitted)
            .await
            .map_err(|buffer| IngestError::Unavailable {
                database,
                buffer: buffer.to_string(),
            })
    }

    /// The second check (`crate::address_ranges`): a signed delivery's source address against
    /// its provider's published ranges, for a source whose `address_check` is not `off`.
    /// `Ok(None)`: inside, or nothing to judge against (a stale or never read list: admitted,
    /// and `provider_ranges_stale` reports it). `Ok(Some(address))`: outside, and the source
    /// observes: admitted, counted once stored. `Err`: outside (or an unknown address) and the
    /// source enforces: refused 403, counted here.
    async fn check_address(
        &self,
        source: &Source,
        address: Option<IpAddr>,
    ) -> Result<Option<IpAddr>, IngestError> {
        let check = source.address_check();
        if check == AddressCheck::Off {
            return Ok(None);
        }
        let provider = source.scheme.as_str();
        let ranges = match self.ranges.lookup(source.scheme).await {
            Lookup::Fresh(ranges) => ranges,
            not_judged => {
                tracing::debug!(
                    provider,
                    why = not_judged.why_not_judged().unwrap_or_default(),
                    "source address not checked: admitted"
                );
                return Ok(None);
            }
        };
        if address.is_some_and(|a| ranges.contains(a)) {
            return Ok(None);
        }
        crate::metrics::outside_provider_ranges(check.as_str());
        match (check, address) {
            (AddressCheck::Enforce, _) => {
                if let Some(address) = address {
                    self.count_outside_ranges(source, address, true).await;
                }
                Err(IngestError::OutsideProviderRanges { provider, address })
            }
            (_, Some(address)) => {
                tracing::warn!(
                    %address,
                    provider,
                    "a signed delivery from outside the provider's published address ranges: \
                     admitted (the source observes), counted"
                );
                Ok(Some(address))
            }
            (_, None) => {
                tracing::debug!(
                    provider,
                    "no source address to check: admitted (the source observes)"
                );
                Ok(None)
            }
        }
    }

    /// Counts a signed delivery from outside its provider's ranges in
    /// `deliveries_outside_ranges`. Never fails the answer: a count that cannot be written is
    /// logged (the metric has it).
    async fn count_outside_ranges(&self, source: &Source, address: IpAddr, refused: bool) {
        let outside = crate::store::deliveries_outside_ranges::OutsideDelivery {
            source_id: source.source_id.as_str(),
            tenant_id: source.tenant_id.as_str(),
            provider: source.scheme.as_str(),
            address,
            refused,
        };
        if let Err(error) =
            crate::store::deliveries_outside_ranges::record(self.database.pool(), &outside).await
        {
            tracing::warn!(%error, "a delivery from outside the provider's ranges could not be counted; the metric has it");
        }
    }

    /// Sends the admitted delivery to SQS; `Buffered` once SQS acknowledged it.
    async fn send_to_buffer(
        &self,
        buffer: &Buffer,
        admitted: &Admitted<'_>,
    ) -> Result<Received, QueueError> {
        let buffered = admitted.buffered();
        let delivery_id = buffered.envelope.delivery_id.clone();
        match buffer.queue.send(buffered).await {
            Ok(_) => Ok(Received::Buffered {
                delivery_id,
                acknowledge: admitted.source.scheme.provider().retries.acknowledge,
            }),
            Err(error) => {
                crate::metrics::buffer_send_failed(buffer.mode.as_str());
                Err(error)
            }
        }
    }

    /// Stores the delivery; when the database refused the credentials (rotated under this warm
    /// process), reads them again and tries once more. Nothing was written by the refused
    /// attempt: a refusal comes before a connection's first statement.
    async fn store_with_current_credentials(
        &self,
        admitted: &Admitted<'_>,
    ) -> Result<Received, IngestError> {
        let seen = self.database.credentials_seen();
        match self.store_admitted(admitted).await {
            Err(IngestError::Store(error)) if self.database.recover(&error, seen).await => {
                tracing::info!(%error, "credentials read again: storing once more");
                self.store_admitted(admitted).await
            }
            result => result,
        }
    }

    /// The source, the secrets, the signature, the handshake, the fields: everything before a
    /// write.
    async fn admit<'d>(&self, delivery: Delivery<'d>) -> Result<Admission<'d>, IngestError> {
        self.database.ready().await?;
        let source_id =
            SourceId::parse(delivery.source_id).map_err(|_| IngestError::UnknownSource)?;
        if delivery.body.len() > self.limits.max_body_bytes {
            return Err(IngestError::PayloadTooLarge {
                actual: delivery.body.len(),
                limit: self.limits.max_body_bytes,
            });
        }
        let source = self
            .sources
            .get(&source_id)
            .await?
            .ok_or(IngestError::UnknownSource)?;
        let span = tracing::Span::current();
        span.record("tenant_id", source.tenant_id.as_str());
        if let Some(reply) = protocol::unsigned_handshake(
            source.scheme,
            delivery.method,
            delivery.headers,
            delivery.body,
            delivery.url,
        ) {
            tracing::info!("unsigned endpoint ping answered; nothing stored");
            return Ok(Admission::Handshake(reply));
        }

        if let Some(rules) = &source.partner {
            rules
                .admit(
                    delivery.client_certificate,
                    delivery.source_ip,
                    delivery.headers,
                    source.tolerance,
                    unix_now(),
                )
                .map_err(IngestError::Partner)?;
        }
        let request = signature::Request {
            headers: delivery.headers,
            body: delivery.body,
            method: delivery.method,
            url: source.signed_url.as_deref().or(delivery.url),
        };
        // A partner without a token signs nothing: no secret is read, none verifies, and it
        // has no handshake.
        let (verified, secrets) = match (source.signature, &source.partner) {
            (None, Some(_)) => (crate::partners::admitted_without_signature(), None),
            (layout, _) => {
                let secrets = self
                    .secrets
                    .secrets(&source.secret_ref)
                    .await
                    .map_err(IngestError::Secret)?;
                let verified = match layout {
                    Some(declared) => signature::verify_with(
                        declared,
                        &request,
                        &secrets,
                        source.tolerance,
                        unix_now(),
                    ),
                    None => signature::verify_accepting(
                        source.scheme,
                        source.layouts.as_deref(),
                        &request,
                        &secrets,
                        source.tolerance,
                        unix_now(),
                    ),
                }
                .map_err(IngestError::Signature)?;
                (verified, Some(secrets))
            }
        };
        span.record("verified_with", verified.secret.as_str());
        if let (Some(_), Some(certificate)) = (&source.partner, delivery.client_certificate) {
            self.partner_certificate_seen(&source, certificate).await;
        }
        let outside_ranges = self.check_address(&source, delivery.source_ip).await?;

        if let Some(secrets) = &secrets {
            let secret = match verified.secret {
                SecretVersion::Previous => secrets.previous.as_ref().unwrap_or(&secrets.current),
                SecretVersion::Current => &secrets.current,
            };
            if let Some(reply) = protocol::handshake(
                source.scheme,
                delivery.method,
                delivery.headers,
                delivery.body,
                secret,
            ) {
                return Ok(Admission::Handshake(reply));
            }
        }
        if delivery.method != "POST" {
            return Err(IngestError::MethodNotAllowed);
        }
        // What is kept of the body from here on: without a shared token it carries (Microsoft
        // Graph's clientState in each notification), which is the secret itself.
        let body = match crate::prepare::without_tokens(&source, delivery.body) {
            Some(redacted) => Cow::Owned(redacted),
            None => Cow::Borrowed(delivery.body),
        };
        if let Some(notice) = protocol::notice(source.scheme, delivery.headers, &body) {
            return Ok(Admission::Notice {
                source,
                notice,
                body,
            });
        }

        let received_at_micros = unix_now_micros();
        let signed = |name: &str| verified.signs_header(name);
        let mut prepared = prepare(
            &source,
            delivery.headers,
            &body,
            &signed,
            received_at_micros,
        );
        // A batch whose elements each carry their own signature (Adyen's items): every one is
        // checked with the layout that verified the request, not only the first it reads.
        if let (Ok(p), Some(at), Some(secrets)) = (&mut prepared, &source.fields.elements, &secrets)
            && p.batch
            && let Some(digests) = crate::batches::verify_each_element(
                verified.layout,
                &request,
                at,
                secrets,
                source.tolerance,
                unix_now(),
            )
            .map_err(IngestError::Signature)?
        {
            p.sign_each(&digests);
        }
        match &prepared {
            Ok(prepared) => {
                if let Some(first) = prepared.first() {
                    span.record("external_id", first.external_id.as_str());
                }
            }
            // Refused before anything is stored, as a body over the size limit is.
            Err(ExtractError::TooManyElements { count, limit, .. }) => {
                return Err(IngestError::TooManyEvents {
                    count: *count,
                    limit: *limit,
                });
            }
            Err(_) => {}
        }
        Ok(Admission::Event(Box::new(Admitted {
            delivery,
            body,
            source,
            verified,
            received_at_micros,
            prepared,
            outside_ranges,
        })))
    }

    /// The direct path: one upsert (or, for fields that cannot be read, the anomaly).
    async fn store_admitted(&self, admitted: &Admitted<'_>) -> Result<Received, IngestError> {
        let Admitted {
            delivery, source, ..
        } = admitted;
        let prepared = match &admitted.prepared {
            Ok(prepared) => prepared,
            Err(error) => {
                let detail = error.to_string();
                let digest: [u8; 32] = Sha256::digest(&admitted.body).into();
                ingest_anomalies::record_unreadable(
                    self.database.pool(),
                    &UnreadableDelivery {
                        tenant_id: source.tenant_id.as_str(),
                        source_id: source.source_id.as_str(),
                        kind: error.anomaly_kind(),
                        payload: &admitted.body,
                        payload_sha256: digest,
                        detail: &detail,
                        headers: &kept_headers(source, delivery.headers),
                    },
                )
                .await?;
                return Err(IngestError::Unreadable(error.clone()));
            }
        };
        if prepared.batch {
            return self.store_batch(admitted, prepared).await;
        }
        let events = prepared.events(
            source,
            &admitted.body,
            admitted.verified.secret.as_str(),
            admitted.verified.signed_digest,
            recorded_layout(source, admitted.verified.layout),
        );
        let (Some(event), Some(fields)) = (events.first(), prepared.first()) else {
            return Err(IngestError::Store(StoreError::Corrupt {
                what: "prepared delivery",
                reason: "no event read".into(),
            }));
        };
        let stored = self.upsert(event).await?;
        let span = tracing::Span::current();
        span.record("outcome", stored.outcome.as_str());
        if let Some(original) = &stored.replay_of {
            tracing::warn!(
                original = %original,
                status = %stored.status,
                "replayed body: the signed body of another stored event under this unsigned id; \
                 recorded, no effect"
            );
        } else if let Some(other) = &stored.collided_with {
            tracing::warn!(
                stored_under = %other,
                "source collision: the event id is stored under another source of the tenant; recorded, not stored"
            );
        } else if stored.outcome == DeliveryOutcome::Conflict {
            tracing::warn!(
                payload_replaced = stored.holds_delivery,
                status = %stored.status,
                "digest conflict: same event id delivered with a different payload"
            );
        }
        Ok(Received::Stored(Receipt {
            outcome: stored.outcome,
            external_id: fields.external_id.clone(),
            delivery_count: stored.delivery_count,
            elements: None,
            acknowledge: source.scheme.provider().retries.acknowledge,
        }))
    }

    /// A batch: the request kept once and every element upserted as its own event, in one
    /// transaction (all of them or none), committed before the answer.
    async fn store_batch(
        &self,
        admitted: &Admitted<'_>,
        prepared: &Prepared,
    ) -> Result<Received, IngestError> {
        let Admitted { source, .. } = admitted;
        let events = prepared.events(
            source,
            &admitted.body,
            admitted.verified.secret.as_str(),
            admitted.verified.signed_digest,
            recorded_layout(source, admitted.verified.layout),
        );
        let received_at = chrono::DateTime::from_timestamp_micros(admitted.received_at_micros)
            .unwrap_or_else(chrono::Utc::now);
        let request = NewBatchRequest {
            tenant_id: source.tenant_id.as_str(),
            source_id: source.source_id.as_str(),
            received_at,
            external_ids: events.iter().map(|e| e.external_id).collect(),
            body: &admitted.body,
            body_sha256: Sha256::digest(&admitted.body).into(),
            headers: &prepared.headers,
            verified_with: admitted.verified.secret.as_str(),
        };
        let stored = file_elements(self.database.pool(), &request, &events, received_at).await?;
        let mut counts = ElementCounts::default();
        for upserted in &stored {
            counts.count(upserted.outcome);
            if let Some(original) = &upserted.replay_of {
                tracing::warn!(original = %original, "replayed element: recorded, no effect");
            } else if let Some(other) = &upserted.collided_with {
                tracing::warn!(stored_under = %other, "element stored under another source of the tenant: recorded, not stored");
            }
        }
        let span = tracing::Span::current();
        span.record("outcome", counts.outcome().as_str());
        tracing::info!(
            accepted = counts.accepted,
            duplicate = counts.duplicate,
            conflict = counts.conflict,
            "batch stored: each element as its own event"
        );
        let (Some(first), Some(fields)) = (stored.first(), prepared.first()) else {
            return Err(IngestError::Store(StoreError::Corrupt {
                what: "batch upsert",
                reason: "no element stored".into(),
            }));
        };
        Ok(Received::Stored(Receipt {
            outcome: counts.outcome(),
            external_id: fields.external_id.clone(),
            delivery_count: first.delivery_count,
            elements: Some(counts),
            acknowledge: source.scheme.provider().retries.acknowledge,
        }))
    }
}

/// How often a batch is filed again when its transaction lost a race with another (a deadlock
/// or a serialization failure), or a body stored by the previous release under another unsigned
/// id appeared under it.
const BATCH_ATTEMPTS: usize = 5;

/// Keeps a batched request and upserts its elements, in one transaction; returns what became of
/// each element, in order. Filed again, whole, when the transaction lost a race.
async fn file_elements(
    pool: &PgPool,
    request: &NewBatchRequest<'_>,
    events: &[NewEvent<'_>],
    received_at: chrono::DateTime<chrono::Utc>,
) -> Result<Vec<Upserted>, StoreError> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let result = async {
            let mut tx = pool.begin().await.map_err(StoreError::from)?;
            batch_requests::record(&mut *tx, request).await?;
            let batched: Vec<BatchedEvent<'_>> = events
                .iter()
                .map(|event| BatchedEvent {
                    event: event.clone(),
                    received_at,
                    buffered: false,
                })
                .collect();
            let stored = webhook_events::upsert_batch(&mut tx, &batched).await?;
            tx.commit().await.map_err(StoreError::from)?;
            Ok::<_, UpsertError>(stored)
        }
        .await;
        match result {
            Ok(stored) => return Ok(stored),
            Err(UpsertError::Store(e)) if e.is_lost_race() && attempt < BATCH_ATTEMPTS => {
                tracing::info!(error = %e, attempt, "the batch lost a race with another transaction: filing again");
                tokio::time::sleep(Duration::from_millis(rand::random_range(1..=50))).await;
            }
            Err(UpsertError::BodyNotClaimed) if attempt < BATCH_ATTEMPTS => {
                tracing::info!(
                    "a body stored by the previous release appeared under the batch: filing again"
                );
            }
            Err(UpsertError::Store(e)) => return Err(e),
            Err(UpsertError::BodyNotClaimed) => {
                return Err(StoreError::Corrupt {
                    what: "replayed body",
                    reason: "the stored body it replays keeps changing under it".into(),
                });
            }
        }
    }
}

impl Admitted<'_> {
    /// The delivery as the buffer keeps it: everything the consumer needs to file it as this
    /// path would have.
    fn buffered(&self) -> BufferedDelivery {
        // The kept headers `prepare` already read; read again only for a body it could not.
        let read_again;
        let headers = match &self.prepared {
            Ok(prepared) => &prepared.headers,
            Err(_) => {
                read_again = kept_headers(&self.source, self.delivery.headers);
                &read_again
            }
        };
        let headers: BTreeMap<String, String> = headers
            .as_object()
            .map(|kept| {
                kept.iter()
                    .filter_map(|(name, value)| Some((name.clone(), value.as_str()?.to_owned())))
                    .collect()
            })
            .unwrap_or_default();
        let signed_headers = headers
            .keys()
            .filter(|name| self.verified.signs_header(name))
            .cloned()
            .collect();
        BufferedDelivery {
            envelope: Envelope {
                v: ENVELOPE_VERSION,
                delivery_id: format!("{:032x}", rand::random::<u128>()),
                verified_layout: recorded_layout(&self.source, self.verified.layout)
                    .map(str::to_owned),
                source_id: self.source.source_id.as_str().to_owned(),
                received_at_micros: self.received_at_micros,
                verified_with: self.verified.secret.as_str().to_owned(),
                headers,
                signed_headers,
                signed_digest: self.verified.signed_digest.map(hex::encode),
                element_digests: self
                    .prepared
                    .as_ref()
                    .map(Prepared::element_digests)
                    .unwrap_or_default(),
            },
            body: self.body.to_vec(),
        }
    }
}

impl Ingestor {
    /// The upsert. Should the body be stored under another unsigned id that `signed_bodies`
    /// does not hold (written by the previous release during a deploy), that event's claim is
    /// copied in and the upsert runs again: it then sees the replay.
    async fn upsert(&self, event: &NewEvent<'_>) -> Result<Upserted, StoreError> {
        for _ in 0..3 {
            match webhook_events::upsert(self.database.pool(), event).await {
                Ok(stored) => return Ok(stored),
                Err(UpsertError::Store(e)) => return Err(e),
                Err(UpsertError::BodyNotClaimed) => {
                    webhook_events::adopt_stored_body(
                        self.database.pool(),
                        event.source_id,
                        &event.payload_sha256,
                        event.body_claim(),
                    )
                    .await?;
                }
            }
        }
        Err(StoreError::Corrupt {
            what: "replayed body",
            reason: "the stored body it replays keeps changing under it".into(),
        })
    }
}

/// Microseconds since the Unix epoch, as versions read from timestamps count time.
/// The name of the layout that verified a delivery, when its source accepts several: which one
/// did is then worth recording (`event_filings`, shown on the event's page). `None` when the
/// source accepts one layout (HubSpot's v3 by default, every declared source): nothing to tell
/// apart, and no row written per event.
fn recorded_layout(
    source: &crate::sources::Source,
    layout: &'static crate::catalogue::SignatureSpec,
) -> Option<&'static str> {
    let accepted = match (&source.signature, &source.layouts) {
        (Some(_), _) => 1,
        (None, Some(names)) => names.len(),
        (None, None) => source
            .scheme
            .provider()
            .signatures
            .iter()
            .filter(|l| !l.legacy)
            .count(),
    };
    (accepted > 1).then_some(layout.name.as_deref()).flatten()
}

pub fn unix_now_micros() -> i64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    i64::try_from(since.as_micros()).unwrap_or(i64::MAX)
}

/// Seconds since the Unix epoch, as signature schemes count time.
pub fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs() as i64
}
