//! Provider address ranges as a second check (issue 50, point 5).
//!
//! Several providers publish the addresses their webhooks come from. A catalogue entry says
//! where (`[address_ranges]`: a JSON document and the pointer of its array, or a fixed list);
//! the ranges pass ([`RangeRefresher`], run by the backfill function's schedule and by `hookctl
//! providers ranges refresh`) reads each published list a source uses into
//! `provider_address_ranges`, with when it was read; ingest keeps the table in a cache
//! ([`RangeCache`]: one read per TTL, never one per request) and, for a source whose
//! `address_check` is not `off`, checks a signed delivery's source address against its
//! provider's list:
//!
//! - inside: nothing more;
//! - outside, `observe` (the default of an entry that publishes ranges): stored as usual,
//!   counted (a metric, and `deliveries_outside_ranges`, which the
//!   `deliveries_outside_provider_ranges_last_day` check reads);
//! - outside, `enforce`: refused 403 before anything is stored, the refusal kept
//!   (`refused_deliveries`, check `outside_provider_ranges`) and counted the same way.
//!
//! A list older than [`STALE_AFTER`], or never read, judges nothing: every delivery is admitted,
//! and the `provider_ranges_stale` check reports it. A try that fails keeps the list there is.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

pub use crate::address_lists::{AddressCheck, AddressListError, MAX_ENTRIES, Ranges};
use crate::catalogue::AddressRangesSpec;
use crate::domain::Scheme;
use crate::maintenance::{self, Run, RunCounts};
use crate::store::{StoreError, provider_address_ranges};

/// How long a published list is trusted after it was read: an older one judges no delivery
/// (and never refuses one), and `provider_ranges_stale` counts it.
pub const STALE_AFTER: Duration = Duration::from_secs(
    match u64::from_str_radix(
        crate::store::provider_address_ranges::stale_after_seconds!(),
        10,
    ) {
        Ok(seconds) => seconds,
        Err(_) => panic!("stale_after_seconds! is a number of seconds"),
    },
);

/// Advisory lock key of the ranges pass ("addrrang" in ASCII).
pub const RANGES_LOCK: i64 = 0x6164_6472_7261_6e67;

/// The most bytes of a published document read (GitHub's meta document, with every service's
/// ranges, is a few hundred KiB).
pub const MAX_DOCUMENT_BYTES: usize = 8 * 1024 * 1024;

/// Why a list could not be read or used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangesError {
    #[error(transparent)]
    List(#[from] AddressListError),
    #[error("the document is not JSON: {0}")]
    NotJson(String),
    #[error("the document has no array of strings at {pointer:?}")]
    NoArray { pointer: String },
    #[error("the request failed: {0}")]
    Request(String),
    #[error("answered {status}")]
    Status { status: u16 },
    #[error("the document is larger than {MAX_DOCUMENT_BYTES} bytes")]
    TooLarge,
}

impl Ranges {
    /// The list at the JSON pointer `pointer` of a published document: an array of strings.
    pub fn from_document(document: &[u8], pointer: &str) -> Result<Self, RangesError> {
        let value: serde_json::Value =
            serde_json::from_slice(document).map_err(|e| RangesError::NotJson(e.to_string()))?;
        let entries: Vec<&str> = value
            .pointer(pointer)
            .and_then(serde_json::Value::as_array)
            .and_then(|items| items.iter().map(serde_json::Value::as_str).collect())
            .ok_or_else(|| RangesError::NoArray {
                pointer: pointer.to_owned(),
            })?;
        Ok(Ranges::parse(&entries)?)
    }
}

/// The fixed lists the catalogue carries (`cidrs`), parsed once. An entry whose list does not
/// parse fails to load (`catalogue::load`), so none is missing here.
static FIXED: LazyLock<HashMap<Scheme, Arc<Ranges>>> = LazyLock::new(|| {
    crate::catalogue::providers()
        .filter_map(|(scheme, p)| {
            let spec = p.address_ranges.as_ref()?;
            if spec.url.is_some() {
                return None;
            }
            Ranges::parse(&spec.cidrs)
                .ok()
                .map(|ranges| (scheme, Arc::new(ranges)))
        })
        .collect()
});

/// What ingest can judge an address against, for one provider.
#[derive(Debug, Clone)]
pub enum Lookup {
    /// A list read within [`STALE_AFTER`], or the catalogue's fixed one.
    Fresh(Arc<Ranges>),
    /// The list is older than [`STALE_AFTER`]: nothing is judged.
    Stale { fetched_at: DateTime<Utc> },
    /// No list was ever read: nothing is judged.
    NeverFetched,
    /// The table could not be read and no earlier reading is held: nothing is judged.
    Unavailable,
    /// The provider publishes no ranges.
    NotPublished,
}

impl Lookup {
    /// Why nothing is judged, for a log line; `None` for a fresh list.
    pub fn why_not_judged(&self) -> Option<&'static str> {
        Some(match self {
            Lookup::Fresh(_) => return None,
            Lookup::Stale { .. } => "the list is stale",
            Lookup::NeverFetched => "the list was never read",
            Lookup::Unavailable => "the list cannot be read",
            Lookup::NotPublished => "the provider publishes no ranges",
        })
    }
}

/// A published list as ingest holds it.
#[derive(Debug, Clone)]
struct Published {
    ranges: Arc<Ranges>,
    fetched_at: DateTime<Utc>,
}

/// Every provider's published list, cached in the warm process: the table is read once per TTL
/// (on the first lookup after it), whatever the traffic. When it cannot be read, the last
/// reading is served, and the table asked again at most once a second.
pub struct RangeCache {
    pool: PgPool,
    ttl: Duration,
    state: Mutex<Option<Loaded>>,
}

struct Loaded {
    /// When to read the table again.
    until: Instant,
    lists: Arc<HashMap<String, Published>>,
}

impl RangeCache {
    pub fn new(pool: PgPool, ttl: Duration) -> Self {
        Self {
            pool,
            ttl,
            state: Mutex::new(None),
        }
    }

    /// The list to judge a delivery of `scheme` against.
    pub async fn lookup(&self, scheme: Scheme) -> Lookup {
        let Some(spec) = scheme.provider().address_ranges.as_ref() else {
            return Lookup::NotPublished;
        };
        if spec.url.is_none() {
            return FIXED
                .get(&scheme)
                .map_or(Lookup::NotPublished, |ranges| Lookup::Fresh(ranges.clone()));
        }
        let Some(lists) = self.lists().await else {
            return Lookup::Unavailable;
        };
        match lists.get(scheme.as_str()) {
            None => Lookup::NeverFetched,
            Some(published) => {
                let age = (Utc::now() - published.fetched_at)
                    .to_std()
                    .unwrap_or(Duration::ZERO);
                if age > STALE_AFTER {
                    Lookup::Stale {
                        fetched_at: published.fetched_at,
                    }
                } else {
                    Lookup::Fresh(published.ranges.clone())
                }
            }
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Option<Loaded>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn lists(&self) -> Option<Arc<HashMap<String, Published>>> {
        let now = Instant::now();
        if let Some(loaded) = self.state().as_ref()
            && now < loaded.until
        {
            return Some(loaded.lists.clone());
        }
        match provider_address_ranges::list(&self.pool).await {
            Ok(rows) => {
                let lists: HashMap<String, Published> = rows
                    .into_iter()
                    .filter_map(|row| {
                        let (cidrs, fetched_at) = (row.cidrs?, row.fetched_at?);
                        match Ranges::parse(&cidrs) {
                            Ok(ranges) => Some((
                                row.provider,
                                Published {
                                    ranges: Arc::new(ranges),
                                    fetched_at,
                                },
                            )),
                            Err(error) => {
                                tracing::warn!(provider = %row.provider, %error, "a stored address list does not parse: not used");
                                None
                            }
                        }
                    })
                    .collect();
                let lists = Arc::new(lists);
                *self.state() = Some(Loaded {
                    until: now + self.ttl,
                    lists: lists.clone(),
                });
                Some(lists)
            }
            Err(error) => {
                tracing::warn!(%error, "the provider address ranges cannot be read: the last reading is used, if any");
                let mut state = self.state();
                let loaded = state.as_mut()?;
                loaded.until = now + Duration::from_secs(1);
                Some(loaded.lists.clone())
            }
        }
    }
}

/// The ranges pass's settings.
#[derive(Debug, Clone)]
pub struct RangesSettings {
    /// A list read more recently than this is not read again (`ADDRESS_RANGES_REFRESH_SECONDS`,
    /// 6 hours); a list whose last try failed is tried again at every pass.
    pub refresh_after: Duration,
    /// Each request's bound (`ADDRESS_RANGES_TIMEOUT_MS`, 10 s).
    pub request_timeout: Duration,
    /// Where to read a provider's list instead of the catalogue's URL, by provider name
    /// (`ADDRESS_RANGES_URLS`, `github=https://...,stripe=...`): a mirror, or a local stand-in
    /// in tests.
    pub urls: BTreeMap<String, String>,
}

impl Default for RangesSettings {
    fn default() -> Self {
        Self {
            refresh_after: Duration::from_secs(6 * 3600),
            request_timeout: Duration::from_secs(10),
            urls: BTreeMap::new(),
        }
    }
}

impl RangesSettings {
    /// `name=url` pairs separated by commas, each name a catalogue entry that publishes its
    /// ranges at a URL, each URL http(s).
    pub fn parse_urls(raw: &str) -> Result<BTreeMap<String, String>, String> {
        let mut urls = BTreeMap::new();
        for pair in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, url) = pair
                .split_once('=')
                .ok_or_else(|| format!("{pair:?} is not name=url"))?;
            let scheme: Scheme = name.trim().parse().map_err(|e| format!("{name:?}: {e}"))?;
            if scheme
                .provider()
                .address_ranges
                .as_ref()
                .and_then(|r| r.url.as_ref())
                .is_none()
            {
                return Err(format!("{scheme} publishes no address ranges at a URL"));
            }
            let parsed = url::Url::parse(url.trim()).map_err(|e| format!("{url:?}: {e}"))?;
            if !matches!(parsed.scheme(), "http" | "https") {
                return Err(format!("{url:?} is not an http(s) URL"));
            }
            urls.insert(scheme.as_str().to_owned(), url.trim().to_owned());
        }
        Ok(urls)
    }
}

/// Counts of one pass.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangesOutcome {
    /// Providers with a published list that an enabled source checks addresses against.
    pub providers: u64,
    /// Lists read and kept.
    pub fetched: u64,
    /// Lists read recently enough to be left alone.
    pub not_due: u64,
    /// Providers whose list could not be read (the one kept stays), by name.
    pub failed: Vec<String>,
}

impl RunCounts for RangesOutcome {
    fn found(&self) -> serde_json::Value {
        maintenance::json(self)
    }
    fn repaired(&self) -> serde_json::Value {
        serde_json::json!({ "fetched": self.fetched })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum RangesRun {
    Skipped { run_id: i64 },
    Completed { run_id: i64, outcome: RangesOutcome },
}

/// The ranges pass: reads each published list a source uses, when it is due.
pub struct RangeRefresher {
    pool: PgPool,
    settings: RangesSettings,
    http: reqwest::Client,
}

impl RangeRefresher {
    pub fn new(pool: PgPool, settings: RangesSettings) -> Self {
        let http = reqwest::Client::builder()
            .timeout(settings.request_timeout)
            // GitHub's API refuses a request without one.
            .user_agent("webhook-receiver-address-ranges")
            .redirect(reqwest::redirect::Policy::limited(3))
            .build()
            .unwrap_or_default();
        Self {
            pool,
            settings,
            http,
        }
    }

    /// One recorded pass (job `address_ranges`); `skipped` when another holds the lock.
    #[tracing::instrument(skip(self), err)]
    pub async fn run_once(&self, trigger: &str) -> Result<RangesRun, StoreError> {
        let run = maintenance::locked(
            &self.pool,
            "address_ranges",
            trigger,
            RANGES_LOCK,
            |_| async {
                let mut outcome = RangesOutcome::default();
                let result = self.every_provider(&mut outcome).await;
                (outcome, result)
            },
        )
        .await?;
        Ok(match run {
            Run::Skipped { run_id } => RangesRun::Skipped { run_id },
            Run::Completed { run_id, counts } => RangesRun::Completed {
                run_id,
                outcome: counts,
            },
        })
    }

    /// The providers with a published list that an enabled source checks against.
    async fn in_use(&self) -> Result<Vec<(Scheme, &'static AddressRangesSpec)>, StoreError> {
        let mut schemes: Vec<Scheme> = crate::sources::list(&self.pool)
            .await?
            .into_iter()
            .filter(|s| s.enabled && s.address_check() != AddressCheck::Off)
            .map(|s| s.scheme)
            .collect();
        schemes.sort();
        schemes.dedup();
        Ok(schemes
            .into_iter()
            .filter_map(|scheme| {
                let spec = scheme.provider().address_ranges.as_ref()?;
                spec.url.is_some().then_some((scheme, spec))
            })
            .collect())
    }

    async fn every_provider(&self, outcome: &mut RangesOutcome) -> Result<(), StoreError> {
        let stored: HashMap<String, provider_address_ranges::StoredRanges> =
            provider_address_ranges::list(&self.pool)
                .await?
                .into_iter()
                .map(|row| (row.provider.clone(), row))
                .collect();
        for (scheme, spec) in self.in_use().await? {
            let (Some(catalogue_url), Some(pointer)) = (&spec.url, &spec.pointer) else {
                continue;
            };
            outcome.providers += 1;
            let provider = scheme.as_str();
            let due = stored.get(provider).is_none_or(|row| {
                row.failures > 0
                    || row.fetched_at.is_none_or(|at| {
                        (Utc::now() - at).to_std().unwrap_or(Duration::MAX)
                            >= self.settings.refresh_after
                    })
            });
            if !due {
                outcome.not_due += 1;
                continue;
            }
            let url = self
                .settings
                .urls
                .get(provider)
                .unwrap_or(catalogue_url)
                .as_str();
            match self.fetch(url, pointer).await {
                Ok(ranges) => {
                    provider_address_ranges::record_fetched(
                        &self.pool,
                        provider,
                        url,
                        &ranges.cidrs(),
                    )
                    .await?;
                    tracing::info!(provider, url, ranges = ranges.len(), "address ranges read");
                    outcome.fetched += 1;
                }
                Err(error) => {
                    let detail = error.to_string();
                    provider_address_ranges::record_failure(&self.pool, provider, url, &detail)
                        .await?;
                    tracing::warn!(provider, url, error = %detail, "address ranges not read: the list kept stays");
                    outcome.failed.push(provider.to_owned());
                }
            }
        }
        Ok(())
    }

    /// Reads the document at `url` (at most [`MAX_DOCUMENT_BYTES`]) and the list at `pointer`.
    async fn fetch(&self, url: &str, pointer: &str) -> Result<Ranges, RangesError> {
        let request = |e: reqwest::Error| RangesError::Request(e.without_url().to_string());
        let mut response = self
            .http
            .get(url)
            .header(http::header::ACCEPT, "application/json")
            .send()
            .await
            .map_err(request)?;
        if !response.status().is_success() {
            return Err(RangesError::Status {
                status: response.status().as_u16(),
            });
        }
        let mut document = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(request)? {
            if document.len() + chunk.len() > MAX_DOCUMENT_BYTES {
                return Err(RangesError::TooLarge);
            }
            document.extend_from_slice(&chunk);
        }
        Ranges::from_document(&document, pointer)
    }
}

/// One provider's list as the operator reads it (`hookctl providers ranges`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderRanges {
    pub provider: String,
    /// Where the list comes from: the URL it is read at, or `fixed list (the catalogue)`.
    pub published: String,
    /// `fresh`, `stale` (older than [`STALE_AFTER`]: nothing judged), `never read` (nothing
    /// judged) or `fixed`.
    pub state: String,
    pub ranges: usize,
    pub fetched_at: Option<DateTime<Utc>>,
    /// Tries that failed since the list was read, and why the last did.
    pub failures: i32,
    pub last_error: Option<String>,
    /// The enabled sources that check against it, each with its check (`github-acme
    /// (observe)`).
    pub sources: Vec<String>,
}

/// Every catalogue entry that publishes its ranges: what is kept of its list, and which
/// sources check against it.
pub async fn report(pool: &PgPool) -> Result<Vec<ProviderRanges>, StoreError> {
    let stored: HashMap<String, provider_address_ranges::StoredRanges> =
        provider_address_ranges::list(pool)
            .await?
            .into_iter()
            .map(|row| (row.provider.clone(), row))
            .collect();
    let sources = crate::sources::list(pool).await?;
    Ok(crate::catalogue::providers()
        .filter_map(|(scheme, p)| {
            let spec = p.address_ranges.as_ref()?;
            let checking: Vec<String> = sources
                .iter()
                .filter(|s| {
                    s.scheme == scheme && s.enabled && s.address_check() != AddressCheck::Off
                })
                .map(|s| format!("{} ({})", s.source_id, s.address_check().as_str()))
                .collect();
            let row = stored.get(scheme.as_str());
            let fetched_at = row.and_then(|r| r.fetched_at);
            let (published, state, ranges) = match &spec.url {
                None => (
                    "fixed list (the catalogue)".to_owned(),
                    "fixed",
                    spec.cidrs.len(),
                ),
                Some(url) => (
                    row.map_or_else(|| url.clone(), |r| r.source_url.clone()),
                    match fetched_at {
                        None => "never read",
                        Some(at)
                            if (Utc::now() - at).to_std().unwrap_or(Duration::ZERO)
                                > STALE_AFTER =>
                        {
                            "stale"
                        }
                        Some(_) => "fresh",
                    },
                    row.and_then(|r| r.cidrs.as_ref()).map_or(0, Vec::len),
                ),
            };
            Some(ProviderRanges {
                provider: scheme.as_str().to_owned(),
                published,
                state: state.to_owned(),
                ranges,
                fetched_at,
                failures: row.map_or(0, |r| r.failures),
                last_error: row.and_then(|r| r.last_error.clone()),
                sources: checking,
            })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_cidrs_or_bare_addresses_of_either_family() {
        let ranges = Ranges::parse(&[
            "192.30.252.0/22",
            "3.18.12.63",
            "2a0a:a440::/29",
            "2001:db8::1",
            // Host bits set: read as its network.
            "185.199.108.1/22",
        ])
        .unwrap();
        for inside in [
            "192.30.252.1",
            "192.30.255.254",
            "3.18.12.63",
            "2a0a:a447:ffff::1",
            "2001:db8::1",
            "185.199.111.9",
            // An IPv4 address written as IPv6.
            "::ffff:192.30.252.7",
        ] {
            assert!(ranges.contains(inside.parse().unwrap()), "{inside}");
        }
        for outside in [
            "192.30.251.255",
            "3.18.12.64",
            "2a0a:a448::1",
            "2001:db8::2",
            "127.0.0.1",
            "::1",
        ] {
            assert!(!ranges.contains(outside.parse().unwrap()), "{outside}");
        }
        assert!(ranges.cidrs().contains(&"185.199.108.0/22".to_owned()));
        assert!(ranges.cidrs().contains(&"3.18.12.63/32".to_owned()));
    }

    #[test]
    fn a_list_that_is_empty_too_long_or_holds_anything_else_is_refused() {
        assert_eq!(Ranges::parse::<&str>(&[]), Err(AddressListError::Empty));
        assert_eq!(
            Ranges::parse(&["192.0.2.0/24", "192.0.2.0/33"]),
            Err(AddressListError::Invalid {
                entry: "192.0.2.0/33".into()
            })
        );
        assert!(matches!(
            Ranges::parse(&["example.com"]),
            Err(AddressListError::Invalid { .. })
        ));
        let many = vec!["192.0.2.1"; MAX_ENTRIES + 1];
        assert!(matches!(
            Ranges::parse(&many),
            Err(AddressListError::TooMany { .. })
        ));
    }

    #[test]
    fn a_document_gives_the_array_at_its_pointer() {
        let github = br#"{"verifiable_password_authentication":false,"hooks":["192.30.252.0/22","2a0a:a440::/29"],"web":["140.82.112.0/20"]}"#;
        let ranges = Ranges::from_document(github, "/hooks").unwrap();
        assert_eq!(ranges.len(), 2);
        assert!(!ranges.contains("140.82.112.1".parse().unwrap()));
        let stripe = br#"{"WEBHOOKS":["3.18.12.63","3.130.192.231"]}"#;
        assert_eq!(Ranges::from_document(stripe, "/WEBHOOKS").unwrap().len(), 2);

        assert!(matches!(
            Ranges::from_document(b"<html>", "/hooks"),
            Err(RangesError::NotJson(_))
        ));
        for (doc, pointer) in [
            (&br#"{"hooks":"192.30.252.0/22"}"#[..], "/hooks"),
            (br#"{"hooks":[1,2]}"#, "/hooks"),
            (br#"{"web":[]}"#, "/hooks"),
        ] {
            assert_eq!(
                Ranges::from_document(doc, pointer),
                Err(RangesError::NoArray {
                    pointer: pointer.into()
                })
            );
        }
        assert_eq!(
            Ranges::from_document(br#"{"hooks":[]}"#, "/hooks"),
            Err(RangesError::List(AddressListError::Empty))
        );
    }

    #[test]
    fn the_check_defaults_to_observe_where_the_provider_publishes_ranges() {
        assert_eq!(
            AddressCheck::default_for(Scheme::Github),
            AddressCheck::Observe
        );
        assert_eq!(
            AddressCheck::default_for(Scheme::Stripe),
            AddressCheck::Observe
        );
        assert_eq!(AddressCheck::default_for(Scheme::Slack), AddressCheck::Off);
        for check in [
            AddressCheck::Observe,
            AddressCheck::Enforce,
            AddressCheck::Off,
        ] {
            assert_eq!(AddressCheck::parse(check.as_str()), Ok(check));
        }
        assert!(AddressCheck::parse("strict").is_err());
    }

    #[test]
    fn url_overrides_name_a_publishing_provider_and_an_http_url() {
        let urls = RangesSettings::parse_urls("github=http://127.0.0.1:9/meta, stripe=https://x/y")
            .unwrap();
        assert_eq!(urls["github"], "http://127.0.0.1:9/meta");
        assert_eq!(urls.len(), 2);
        assert!(RangesSettings::parse_urls("slack=https://x").is_err());
        assert!(RangesSettings::parse_urls("github").is_err());
        assert!(RangesSettings::parse_urls("github=ftp://x").is_err());
        assert!(RangesSettings::parse_urls("").unwrap().is_empty());
    }

    #[test]
    fn the_staleness_limit_is_a_day() {
        assert_eq!(STALE_AFTER, Duration::from_secs(86_400));
    }
}
