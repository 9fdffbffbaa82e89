//! Gap detection and backfill: events the provider sent (or lists) that never arrived.
//!
//! Per source with gap settings, a pass (1) finds candidates: for a sequence, the numbers
//! missing in new ground above what was examined before, a bounded window at a time
//! (gaps-and-islands over the sequence index, cost in proportion to the window), whatever the
//! contiguous watermark waits for; the watermark then stands just below the lowest candidate
//! still open, so it moves as soon as its gaps are filled; for a list API, the listed IDs
//! of a time window that are neither stored nor tombstoned (primary-key probes); then (2)
//! fetches candidates older than the grace period by ID: found → stored through the same
//! upsert as a delivery (`verified_with = provider_api`) and drained like any event; not found
//! → tombstoned with the reason, never flagged again; other errors → retried next pass.
//!
//! GitHub keeps no event API and never retries: a GitHub source lists its hook's deliveries and
//! asks GitHub to redeliver the events it never stored (see [`crate::github_api`]).

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use sqlx::PgPool;

use crate::buffer::BufferQueue;
use crate::extract;
use crate::github_api::{self, GithubApi, Redelivery};
use crate::maintenance::{self, Run, RunCounts};
use crate::provider_api::{Fetched, ProviderApi};
use crate::secrets::SecretStore;
use crate::sources::{GapConfig, GapStrategy, Source};
use crate::store::{StoreError, gaps, webhook_events};

/// Advisory lock key of the backfill pass ("backfill" in ASCII).
pub const BACKFILL_LOCK: i64 = 0x6261_636b_6669_6c6c;

#[derive(Debug, Clone)]
pub struct BackfillSettings {
    /// Candidates fetched per source per pass.
    pub fetch_limit: i64,
    pub max_list_pages: usize,
    pub request_timeout: Duration,
    /// Sequence windows examined per source per pass: a pass catches up this many windows of
    /// new numbers.
    pub max_windows: usize,
    /// While the SQS buffer holds deliveries, no gap younger than this is judged
    /// (`BUFFER_GAP_HOLD_SECONDS`): a buffered event is not missing. A delivery waits that long
    /// in the buffer only while the oldest-message alarm pages.
    pub buffer_hold: Duration,
}

impl Default for BackfillSettings {
    fn default() -> Self {
        Self {
            fetch_limit: 500,
            max_list_pages: 200,
            request_timeout: Duration::from_secs(10),
            max_windows: 10,
            buffer_hold: Duration::from_secs(3600),
        }
    }
}

/// Counts of one pass, over all sources.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct BackfillOutcome {
    pub sources: u64,
    pub new_candidates: u64,
    pub arrived_late: u64,
    pub waiting_grace: i64,
    pub fetched: u64,
    pub backfilled: u64,
    /// Events the provider was asked to deliver again (GitHub): they arrive through ingest.
    pub redeliveries_requested: u64,
    pub tombstoned: u64,
    pub errors: u64,
    /// Source-level failures (API down, bad credentials), by source id.
    pub failed_sources: Vec<String>,
    /// Sources whose listing went past `max_list_pages`: the oldest part of their window was not
    /// examined (the `truncated_gap_listings` check breaches).
    pub truncated_listings: Vec<String>,
    /// Deliveries the SQS buffer held when the pass began (waiting, in flight, delayed): while
    /// there are any, gaps wait at least `buffer_hold` before they are judged.
    pub buffered_deliveries: u64,
}

impl RunCounts for BackfillOutcome {
    fn found(&self) -> serde_json::Value {
        maintenance::json(self)
    }
    fn repaired(&self) -> serde_json::Value {
        serde_json::json!({
            "backfilled": self.backfilled,
            "redeliveries_requested": self.redeliveries_requested,
            "tombstoned": self.tombstoned,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum BackfillRun {
    Skipped {
        run_id: i64,
    },
    Completed {
        run_id: i64,
        outcome: BackfillOutcome,
    },
}

pub struct Backfiller {
    pool: PgPool,
    secrets: Arc<SecretStore>,
    settings: BackfillSettings,
    /// The SQS buffer, whose deliveries are not missing: read for its depth only.
    buffer: Option<BufferQueue>,
}

impl Backfiller {
    pub fn new(pool: PgPool, secrets: Arc<SecretStore>, settings: BackfillSettings) -> Self {
        Self {
            pool,
            secrets,
            settings,
            buffer: None,
        }
    }

    /// Backfill beside a buffer: while it holds deliveries, gaps wait `buffer_hold`.
    pub fn with_buffer(mut self, buffer: BufferQueue) -> Self {
        self.buffer = Some(buffer);
        self
    }

    /// How long gaps wait at least in this pass: `buffer_hold` while the buffer may hold late
    /// deliveries (see [`crate::buffer::BufferReading::holds_late_deliveries`]: in `queue` mode behind a
    /// consumer that keeps up, gaps keep their own grace), or while it cannot be counted.
    async fn buffer_hold(&self, outcome: &mut BackfillOutcome) -> Option<Duration> {
        let buffer = self.buffer.as_ref()?;
        let reading = buffer.read().await;
        match &reading.depth {
            Ok(depth) => outcome.buffered_deliveries = depth.buffered(),
            Err(error) => {
                tracing::warn!(%error, "the buffer cannot be counted: gaps wait as if it held deliveries");
            }
        }
        reading
            .holds_late_deliveries(chrono::Utc::now())
            .then_some(self.settings.buffer_hold)
    }

    /// One pass over every enabled source with gap settings; `skipped` if a pass is running.
    #[tracing::instrument(skip(self), err)]
    pub async fn run_once(&self, trigger: &str) -> Result<BackfillRun, StoreError> {
        let run = maintenance::locked(&self.pool, "backfill", trigger, BACKFILL_LOCK, |_| async {
            let mut outcome = BackfillOutcome::default();
            let result = self.all_sources(&mut outcome).await;
            (outcome, result)
        })
        .await?;
        Ok(match run {
            Run::Skipped { run_id } => BackfillRun::Skipped { run_id },
            Run::Completed { run_id, counts } => BackfillRun::Completed {
                run_id,
                outcome: counts,
            },
        })
    }

    async fn all_sources(&self, outcome: &mut BackfillOutcome) -> Result<(), StoreError> {
        let hold = self.buffer_hold(outcome).await;
        for source in crate::sources::list(&self.pool).await? {
            let Some(mut gaps) = source.gaps.clone().filter(|_| source.enabled) else {
                continue;
            };
            if let Some(hold) = hold {
                gaps.grace = gaps.grace.max(hold);
            }
            outcome.sources += 1;
            if let Err(why) = self.one_source(&source, &gaps, outcome).await {
                match why {
                    SourceFailure::Store(e) => return Err(e),
                    SourceFailure::Provider(why) => {
                        tracing::warn!(source_id = %source.source_id, %why, "backfill of source failed");
                        outcome.failed_sources.push(source.source_id.to_string());
                    }
                }
            }
        }
        let o = &*outcome;
        let idle = o.new_candidates == 0
            && o.arrived_late == 0
            && o.fetched == 0
            && o.backfilled == 0
            && o.tombstoned == 0
            && o.errors == 0
            && o.failed_sources.is_empty();
        if idle {
            tracing::debug!(
                sources = o.sources,
                waiting_grace = o.waiting_grace,
                "backfill pass: no gaps"
            );
        } else {
            tracing::info!(
                sources = o.sources,
                new_candidates = o.new_candidates,
                arrived_late = o.arrived_late,
                waiting_grace = o.waiting_grace,
                fetched = o.fetched,
                backfilled = o.backfilled,
                tombstoned = o.tombstoned,
                errors = o.errors,
                failed_sources = %o.failed_sources.join(","),
                "backfill pass finished"
            );
        }
        Ok(())
    }

    async fn one_source(
        &self,
        source: &Source,
        config: &GapConfig,
        outcome: &mut BackfillOutcome,
    ) -> Result<(), SourceFailure> {
        let (tenant, source_id) = (source.tenant_id.as_str(), source.source_id.as_str());
        let (Some(api_base_url), Some(api_secret_ref)) =
            (&config.api_base_url, &config.api_secret_ref)
        else {
            return self.unfetchable_source(source, config, outcome).await;
        };
        let key = self
            .secrets
            .secrets(api_secret_ref)
            .await
            .map_err(|e| SourceFailure::Provider(e.to_string()))?;
        if let GapStrategy::GithubDeliveries { hook, app_id } = &config.strategy {
            let credential = match app_id {
                Some(app_id) => github_api::Credential::app(app_id, key.current.expose())
                    .map_err(SourceFailure::Provider)?,
                None => github_api::Credential::Token(key.current.expose().to_owned().into()),
            };
            let api = GithubApi::new(
                api_base_url,
                hook,
                credential,
                self.settings.request_timeout,
            )
            .map_err(SourceFailure::Provider)?;
            return self.github_source(source, config, &api, outcome).await;
        }
        let api = ProviderApi::new(
            api_base_url,
            key.current.expose(),
            self.settings.request_timeout,
        )
        .map_err(SourceFailure::Provider)?;

        // 1. Find what is missing (what arrived by itself meanwhile no longer is).
        outcome.arrived_late += gaps::close_arrived(&self.pool, source_id).await?;
        let windows = self.settings.max_windows;
        match &config.strategy {
            GapStrategy::Sequence { id_template } => {
                outcome.new_candidates +=
                    detect_sequence_gaps(&self.pool, source, id_template, config.window, windows)
                        .await?;
            }
            // Answered above: GitHub's deliveries have a pass of their own.
            GapStrategy::GithubDeliveries { .. } => {}
            GapStrategy::ListApi => {
                let now = chrono::Utc::now().timestamp();
                let listing = api
                    .list_ids(
                        now - config.window,
                        now + 1,
                        self.settings.max_list_pages,
                        config.event_types.as_deref(),
                    )
                    .await
                    .map_err(SourceFailure::Provider)?;
                if listing.truncated {
                    tracing::warn!(
                        source_id,
                        max_pages = self.settings.max_list_pages,
                        listed = listing.ids.len(),
                        "listing cut at the page limit: the oldest part of the window was not examined; narrow gaps.window or raise BACKFILL_MAX_LIST_PAGES"
                    );
                    outcome.truncated_listings.push(source_id.to_owned());
                }
                outcome.new_candidates +=
                    gaps::add_listed_candidates(&self.pool, tenant, source_id, &listing.ids)
                        .await?;
            }
        }
        if matches!(config.strategy, GapStrategy::ListApi) {
            outcome.arrived_late += gaps::close_arrived(&self.pool, source_id).await?;
        }
        let grace = config.grace.as_secs_f64();
        outcome.waiting_grace += gaps::waiting_candidates(&self.pool, source_id, grace).await?;

        // 2. Fetch what is missing and old enough.
        let mut filled = 0;
        for candidate in
            gaps::due_candidates(&self.pool, source_id, grace, self.settings.fetch_limit).await?
        {
            outcome.fetched += 1;
            let failure = match api.fetch(&candidate.external_id).await {
                Fetched::Found(body) => {
                    match store_fetched(&self.pool, source, &candidate.external_id, &body).await {
                        Ok(()) => {
                            gaps::mark_backfilled(&self.pool, tenant, &candidate.external_id)
                                .await?;
                            outcome.backfilled += 1;
                            filled += 1;
                            continue;
                        }
                        Err(SourceFailure::Provider(why)) => why,
                        Err(e) => return Err(e),
                    }
                }
                Fetched::NotFound => {
                    let reason = "the provider's API answers 404 for this ID: it never existed or was deleted";
                    gaps::tombstone(
                        &self.pool,
                        tenant,
                        source_id,
                        &candidate.external_id,
                        candidate.sequence,
                        reason,
                        "backfill",
                    )
                    .await?;
                    outcome.tombstoned += 1;
                    filled += 1;
                    continue;
                }
                Fetched::Failed(why) => why,
            };
            gaps::record_fetch_error(&self.pool, tenant, &candidate.external_id, &failure).await?;
            outcome.errors += 1;
        }
        // Backfilled and tombstoned numbers now fill their gaps: let the watermark rise.
        if let (GapStrategy::Sequence { id_template }, 1..) = (&config.strategy, filled) {
            outcome.new_candidates +=
                detect_sequence_gaps(&self.pool, source, id_template, config.window, windows)
                    .await?;
        }
        Ok(())
    }
}

impl Backfiller {
    /// A sequence the provider offers no way to fetch from (Xero numbers its deliveries'
    /// events, and has no API that serves an event by its number): its pass finds the missing
    /// numbers and closes those that arrived by themselves; what stays open is shown by
    /// `hookctl status` and alarmed (`stale_gap_candidates`, `stalled_gap_watermarks`), for an
    /// operator to settle: the resources re-read from the provider, then the number tombstoned.
    async fn unfetchable_source(
        &self,
        source: &Source,
        config: &GapConfig,
        outcome: &mut BackfillOutcome,
    ) -> Result<(), SourceFailure> {
        let source_id = source.source_id.as_str();
        let GapStrategy::Sequence { id_template } = &config.strategy else {
            return Err(SourceFailure::Provider(format!(
                "gap strategy {} needs the provider's API (api_base_url, api_secret_ref)",
                config.strategy.as_str()
            )));
        };
        outcome.arrived_late += gaps::close_arrived(&self.pool, source_id).await?;
        outcome.new_candidates += detect_sequence_gaps(
            &self.pool,
            source,
            id_template,
            config.window,
            self.settings.max_windows,
        )
        .await?;
        let grace = config.grace.as_secs_f64();
        outcome.waiting_grace += gaps::waiting_candidates(&self.pool, source_id, grace).await?;
        Ok(())
    }

    /// A GitHub hook's pass: list the deliveries of the window; an event (GUID) neither stored
    /// nor tombstoned becomes a candidate with its newest delivery; past the grace period GitHub
    /// is asked to redeliver it (at most once per grace period), and it arrives through ingest,
    /// signed, like any delivery, which closes the candidate as `redelivered`. A delivery GitHub
    /// no longer keeps (404) is tombstoned with the reason.
    async fn github_source(
        &self,
        source: &Source,
        config: &GapConfig,
        api: &GithubApi,
        outcome: &mut BackfillOutcome,
    ) -> Result<(), SourceFailure> {
        let (tenant, source_id) = (source.tenant_id.as_str(), source.source_id.as_str());
        outcome.arrived_late += gaps::close_arrived(&self.pool, source_id).await?;
        let since = chrono::Utc::now() - chrono::TimeDelta::seconds(config.window);
        let listing = api
            .list_deliveries(
                since,
                self.settings.max_list_pages,
                config.event_types.as_deref(),
            )
            .await
            .map_err(SourceFailure::Provider)?;
        if listing.truncated {
            tracing::warn!(
                source_id,
                max_pages = self.settings.max_list_pages,
                listed = listing.events.len(),
                "deliveries listing cut at the page limit: the oldest part of the window was not examined; narrow gaps.window or raise BACKFILL_MAX_LIST_PAGES"
            );
            outcome.truncated_listings.push(source_id.to_owned());
        }
        let events: Vec<(String, i64)> = listing
            .events
            .into_iter()
            .filter(|(guid, _)| crate::domain::ExternalId::parse(guid).is_ok())
            .collect();
        outcome.new_candidates +=
            gaps::add_redeliverable_candidates(&self.pool, tenant, source_id, &events).await?;
        let grace = config.grace.as_secs_f64();
        outcome.waiting_grace += gaps::waiting_candidates(&self.pool, source_id, grace).await?;

        for candidate in
            gaps::due_redeliveries(&self.pool, source_id, grace, self.settings.fetch_limit).await?
        {
            let Some(delivery_id) = candidate
                .provider_ref
                .as_deref()
                .and_then(|r| r.parse::<i64>().ok())
            else {
                continue;
            };
            match api.redeliver(delivery_id).await {
                Redelivery::Requested => {
                    gaps::mark_redelivery_requested(&self.pool, tenant, &candidate.external_id)
                        .await?;
                    outcome.redeliveries_requested += 1;
                }
                Redelivery::Gone => {
                    let reason = "GitHub no longer has this delivery (it keeps a hook's deliveries \
                                  for a few days): it can never be redelivered";
                    gaps::tombstone(
                        &self.pool,
                        tenant,
                        source_id,
                        &candidate.external_id,
                        None,
                        reason,
                        "backfill",
                    )
                    .await?;
                    outcome.tombstoned += 1;
                }
                Redelivery::Failed(why) => {
                    gaps::record_fetch_error(&self.pool, tenant, &candidate.external_id, &why)
                        .await?;
                    outcome.errors += 1;
                }
            }
        }
        // A redelivery answered while the pass ran has landed already.
        outcome.arrived_late += gaps::close_arrived(&self.pool, source_id).await?;
        Ok(())
    }
}

enum SourceFailure {
    Store(StoreError),
    Provider(String),
}

impl From<StoreError> for SourceFailure {
    fn from(e: StoreError) -> Self {
        SourceFailure::Store(e)
    }
}

/// Examines new ground of a sequence source, up to `max_windows` windows of `window` numbers
/// above what was examined before: the missing numbers of each window become candidates (a
/// window with nothing present but something above it is missing whole), and the examined
/// mark moves to the highest number present. Then the contiguous watermark is raised to just
/// below the lowest candidate still open (or to the examined mark when none is). Returns how
/// many candidates are new.
pub async fn detect_sequence_gaps(
    pool: &PgPool,
    source: &Source,
    id_template: &str,
    window: i64,
    max_windows: usize,
) -> Result<u64, StoreError> {
    let source_id = source.source_id.as_str();
    let mut mark = match gaps::watermark(pool, source_id).await? {
        Some(w) => w,
        // Start just below the first number ever stored.
        None => match gaps::first_sequence(pool, source_id).await? {
            Some(first) => gaps::Watermark {
                contiguous_through: first - 1,
                examined_through: first - 1,
            },
            None => return Ok(0),
        },
    };
    let mut new = 0;
    for _ in 0..max_windows.max(1) {
        let after = mark.examined_through;
        let up_to = after.saturating_add(window.max(1));
        let found = gaps::sequence_gaps(pool, source_id, after, up_to).await?;
        let (missing, examined) = match found.highest {
            Some(highest) => (found.gaps, highest),
            None if found.present_above => (
                vec![gaps::SequenceGap {
                    gap_from: after + 1,
                    gap_to: up_to,
                }],
                up_to,
            ),
            // Nothing present above what was examined: caught up.
            None => break,
        };
        new += gaps::add_sequence_candidates(
            pool,
            source.tenant_id.as_str(),
            source_id,
            id_template,
            &missing,
        )
        .await?;
        mark.examined_through = examined;
    }
    mark.contiguous_through = match gaps::lowest_open_candidate(pool, source_id).await? {
        Some(lowest) => (lowest - 1).min(mark.examined_through),
        None => mark.examined_through,
    };
    gaps::raise_watermark(pool, source_id, mark).await?;
    Ok(new)
}

/// Stores a fetched event through the ingest upsert, its fields read with the source's map.
async fn store_fetched(
    pool: &PgPool,
    source: &Source,
    expected_id: &str,
    body: &[u8],
) -> Result<(), SourceFailure> {
    let fields = extract::extract(&source.fields, &http::HeaderMap::new(), body)
        .map_err(|e| SourceFailure::Provider(format!("fetched event cannot be filed: {e}")))?;
    if fields.external_id.as_str() != expected_id {
        return Err(SourceFailure::Provider(format!(
            "asked for {expected_id}, the provider returned {}",
            fields.external_id
        )));
    }
    let event = source.event(
        &fields,
        body,
        serde_json::json!({}),
        webhook_events::PROVIDER_API,
    );
    // The API's copy carries its id in the body it was fetched by: never a replayed body.
    webhook_events::upsert(pool, &event)
        .await
        .map_err(|e| match e {
            webhook_events::UpsertError::Store(e) => SourceFailure::Store(e),
            other => SourceFailure::Store(StoreError::Corrupt {
                what: "backfilled event",
                reason: other.to_string(),
            }),
        })?;
    Ok(())
}
