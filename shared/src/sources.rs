//! Sources: the trusted configuration of each webhook endpoint, and the warm-process cache the
//! ingest path reads it through.
//!
//! A source says which tenant its events belong to, how the provider signs, which secret to
//! verify with and where each event field is read. Sources live in the `sources` table, so
//! operators add or change one with `hookctl sources apply` and no redeploy; ingest functions
//! see the change within the cache TTL.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Deserialize;
use sqlx::{PgExecutor, PgPool};

use crate::address_lists::AddressCheck;
use crate::catalogue::{self, SignatureSpec};
use crate::domain::{FieldLocator, Scheme, SourceId, TenantId};
use crate::extract::{EventFields, FieldMap};
use crate::github_api::HookPath;
use crate::secrets::{Clock, system_clock};
use crate::stale::{Freshness, Policy, REFRESH_TIMEOUT, Use};
use crate::store::sources::SourceRow;
use crate::store::webhook_events::NewEvent;
use crate::store::{self, StoreError};

/// The default timestamp tolerance, both directions, for a provider whose catalogue entry
/// names none.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(300);

/// The tolerance a source of `scheme` gets when it sets none: the provider's documented one
/// (Paddle's 5 s, Linear's 60 s), else [`DEFAULT_TOLERANCE`].
pub fn default_tolerance(scheme: Scheme) -> Duration {
    scheme
        .provider()
        .signatures
        .iter()
        .find_map(|s| s.timestamp.as_ref())
        .map_or(DEFAULT_TOLERANCE, |t| {
            Duration::from_secs(t.tolerance_seconds.into())
        })
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub source_id: SourceId,
    pub tenant_id: TenantId,
    pub scheme: Scheme,
    /// Secrets Manager secret name or ARN (or a key of the local secrets file).
    pub secret_ref: String,
    pub tolerance: Duration,
    pub fields: FieldMap,
    pub enabled: bool,
    /// How to find and backfill events that never arrived; `None`: this source has no gap
    /// detection.
    pub gaps: Option<GapConfig>,
    /// The URL the provider is configured to call, for the schemes that sign it (Twilio,
    /// Square, HubSpot v2/v3), when it differs from the one the request arrived at (a proxy
    /// in front, a rewritten path). `None`: the request's own URL.
    pub signed_url: Option<String>,
    /// The signature a source of a provider not in the catalogue declares (`scheme =
    /// "declared"`), validated; `None`: the scheme's own layouts.
    pub signature: Option<&'static SignatureSpec>,
    /// The names of its provider's layouts the source accepts (`layouts = ["v3"]`); `None`:
    /// every layout but the legacy ones.
    pub layouts: Option<Vec<String>>,
    /// The form field the provider's JSON arrives in when it posts a form (GitHub's `payload`):
    /// the event is read from that JSON and stored as it. `None`: a form is read as a form.
    pub json_form_field: Option<String>,
    /// What a signed delivery from outside its provider's published address ranges gets
    /// (`crate::address_ranges`), as the source sets it; `None`: its provider's default
    /// ([`Source::address_check`]).
    pub address_check: Option<AddressCheck>,
    /// A partner that does not sign (`auth = "partner"`): admitted by a pinned client
    /// certificate, its addresses and optionally a bearer token (see [`crate::partners`]).
    pub partner: Option<crate::partners::PartnerRules>,
}

/// How a source's expected event IDs are known, and where missing ones are fetched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GapConfig {
    pub strategy: GapStrategy,
    /// Provider API base (`https://api.stripe.com`); events are fetched at `/v1/events/{id}`.
    /// `None`: the provider numbers its events but offers no way to fetch one (Xero): a gap is
    /// found, counted and alarmed, and closed when its number arrives or an operator
    /// tombstones it (sequence only).
    pub api_base_url: Option<String>,
    /// Secret holding the API key, sent as a bearer token; `None` with `api_base_url`.
    pub api_secret_ref: Option<String>,
    /// A gap younger than this is left alone.
    pub grace: Duration,
    /// Sequence: numbers examined per window (a pass examines up to `BACKFILL_MAX_WINDOWS` of
    /// them above what it examined before). List: seconds listed back.
    pub window: i64,
    /// The event types the endpoint subscribes to: a listing asks only for those (Stripe's
    /// `types[]`), so events of other types (another endpoint's on the same account) are never
    /// taken for gaps. `None`: every type (an endpoint enabled for all events).
    pub event_types: Option<Vec<String>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GapStrategy {
    /// The provider numbers its events (read with the source's `sequence` field); the ID of
    /// number n is `id_template` with `{seq}` replaced by n.
    Sequence { id_template: String },
    /// The provider lists its events over a time window (`GET /v1/events`, cursor-paged).
    ListApi,
    /// GitHub: the hook's deliveries are listed (`{hook}/deliveries`), and an event whose GUID
    /// was never stored is redelivered by GitHub on request (`.../deliveries/{id}/attempts`); it
    /// then arrives through ingest like any delivery. GitHub never retries on its own.
    GithubDeliveries {
        hook: HookPath,
        /// A GitHub App's id (or client id), for an App's hook (`/app/hook`): the issuer of the
        /// JSON Web Token signed with the App's private key (the API secret).
        app_id: Option<String>,
    },
}

impl GapStrategy {
    pub fn as_str(&self) -> &'static str {
        match self {
            GapStrategy::Sequence { .. } => "sequence",
            GapStrategy::ListApi => "list_api",
            GapStrategy::GithubDeliveries { .. } => "github_deliveries",
        }
    }

    /// GitHub's deliveries from a hook path and an App id, as a sources file or the `sources`
    /// table gives them.
    pub fn github_deliveries(hook: &str, app_id: Option<String>) -> Result<Self, String> {
        let hook = HookPath::parse(hook)?;
        match (hook.is_app(), app_id) {
            (true, Some(id))
                if !id.is_empty() && id.len() <= 64 && id.chars().all(|c| c.is_ascii_graphic()) =>
            {
                Ok(GapStrategy::GithubDeliveries {
                    hook,
                    app_id: Some(id),
                })
            }
            (true, _) => Err(
                "gaps.hook = \"/app/hook\" needs app_id: the GitHub App's id, the issuer of its \
                 token (api_secret_ref then holds the App's private key)"
                    .into(),
            ),
            (false, Some(_)) => Err(
                "gaps.app_id is for a GitHub App's hook (/app/hook) only; a repository or \
                 organisation hook's api_secret_ref holds a token"
                    .into(),
            ),
            (false, None) => Ok(GapStrategy::GithubDeliveries { hook, app_id: None }),
        }
    }
}

/// The external ID of sequence number `n` under `id_template` (`evt_{seq}` → `evt_42`).
pub fn id_of_sequence(id_template: &str, n: i64) -> String {
    id_template.replace("{seq}", &n.to_string())
}

/// The sequence number `external_id` stands for under `id_template`, when it is exactly the ID
/// the template gives that number (`evt_42` → 42; `evt_042`, `evt_x` → none).
pub fn sequence_of_id(id_template: &str, external_id: &str) -> Option<i64> {
    let (prefix, suffix) = id_template.split_once("{seq}")?;
    let digits = external_id.strip_prefix(prefix)?.strip_suffix(suffix)?;
    let n: i64 = digits.parse().ok()?;
    (id_of_sequence(id_template, n) == external_id).then_some(n)
}

/// The source with this id, enabled or not.
pub async fn find(
    executor: impl PgExecutor<'_>,
    id: &SourceId,
) -> Result<Option<Source>, StoreError> {
    store::sources::find(executor, id.as_str())
        .await?
        .map(Source::try_from)
        .transpose()
}

/// Every source, by id.
pub async fn list(executor: impl PgExecutor<'_>) -> Result<Vec<Source>, StoreError> {
    store::sources::list(executor)
        .await?
        .into_iter()
        .map(Source::try_from)
        .collect()
}

/// A stored row that does not make a source (edited by hand, say) is a typed error naming it.
impl TryFrom<SourceRow> for Source {
    type Error = StoreError;

    fn try_from(row: SourceRow) -> Result<Self, Self::Error> {
        let corrupt = |e: crate::domain::ParseError| StoreError::Corrupt {
            what: "source",
            reason: format!("{}: {e}", row.source_id),
        };
        let locator = |raw: &str| FieldLocator::parse(raw).map_err(corrupt);
        let optional = |raw: &Option<String>| raw.as_deref().map(locator).transpose();
        Ok(Source {
            source_id: SourceId::parse(&row.source_id).map_err(corrupt)?,
            tenant_id: TenantId::parse(&row.tenant_id).map_err(corrupt)?,
            scheme: row.scheme.parse().map_err(corrupt)?,
            secret_ref: row.secret_ref.clone(),
            tolerance: Duration::from_secs(u64::try_from(row.tolerance_seconds).unwrap_or(0)),
            fields: FieldMap {
                external_id: locator(&row.external_id_from)?,
                event_type: locator(&row.event_type_from)?,
                entity_id: optional(&row.entity_id_from)?,
                entity_version: optional(&row.entity_version_from)?,
                entity_version_fallback: optional(&row.entity_version_fallback_from)?,
                version_tiebreak: optional(&row.version_tiebreak_from)?,
                sequence: optional(&row.sequence_from)?,
                elements: row
                    .elements_from
                    .as_deref()
                    .map(crate::domain::Elements::parse)
                    .transpose()
                    .map_err(corrupt)?,
            },
            enabled: row.enabled,
            signed_url: row.signed_url.clone(),
            signature: row
                .declared_signature
                .clone()
                .map(|value| {
                    let spec: SignatureSpec =
                        serde_json::from_value(value).map_err(|e| StoreError::Corrupt {
                            what: "source",
                            reason: format!("{}: declared signature: {e}", row.source_id),
                        })?;
                    catalogue::declare(spec).map_err(|e| StoreError::Corrupt {
                        what: "source",
                        reason: format!("{}: declared signature: {e}", row.source_id),
                    })
                })
                .transpose()?,
            layouts: row.accepted_layouts.clone(),
            json_form_field: row.json_form_field.clone(),
            address_check: row
                .address_check
                .as_deref()
                .map(AddressCheck::parse)
                .transpose()
                .map_err(|reason| StoreError::Corrupt {
                    what: "source",
                    reason: format!("{}: {reason}", row.source_id),
                })?,
            partner: row
                .partner
                .clone()
                .map(|value| {
                    serde_json::from_value(value)
                        .map_err(|e| e.to_string())
                        .and_then(|auth| {
                            crate::partners::PartnerRules::new(auth).map_err(|e| e.to_string())
                        })
                        .map_err(|e| StoreError::Corrupt {
                            what: "source",
                            reason: format!("{}: partner: {e}", row.source_id),
                        })
                })
                .transpose()?,
            gaps: match (
                row.gap_strategy.as_deref(),
                row.api_base_url,
                row.api_secret_ref,
            ) {
                (None, _, _) => None,
                (Some(strategy), api_base_url, api_secret_ref)
                    if api_base_url.is_some() == api_secret_ref.is_some()
                        && (api_base_url.is_some() || strategy == "sequence") =>
                {
                    Some(GapConfig {
                        strategy: match (strategy, row.id_template) {
                            ("sequence", Some(id_template)) => {
                                GapStrategy::Sequence { id_template }
                            }
                            ("list_api", _) => GapStrategy::ListApi,
                            ("github_deliveries", _) => GapStrategy::github_deliveries(
                                row.github_hook.as_deref().unwrap_or_default(),
                                row.github_app_id,
                            )
                            .map_err(|reason| StoreError::Corrupt {
                                what: "source",
                                reason: format!("{}: {reason}", row.source_id),
                            })?,
                            (other, _) => {
                                return Err(StoreError::Corrupt {
                                    what: "source",
                                    reason: format!("{}: gap strategy {other}", row.source_id),
                                });
                            }
                        },
                        api_base_url,
                        api_secret_ref,
                        grace: Duration::from_secs(
                            u64::try_from(row.gap_grace_seconds).unwrap_or(0),
                        ),
                        window: row.gap_window,
                        event_types: row.gap_event_types,
                    })
                }
                _ => {
                    return Err(StoreError::Corrupt {
                        what: "source",
                        reason: format!("{}: incomplete gap settings", row.source_id),
                    });
                }
            },
        })
    }
}

impl From<&Source> for SourceRow {
    fn from(source: &Source) -> Self {
        let text = |l: &Option<FieldLocator>| l.as_ref().map(ToString::to_string);
        let gaps = source.gaps.as_ref();
        SourceRow {
            source_id: source.source_id.as_str().to_owned(),
            tenant_id: source.tenant_id.as_str().to_owned(),
            scheme: source.scheme.as_str().to_owned(),
            secret_ref: source.secret_ref.clone(),
            tolerance_seconds: i32::try_from(source.tolerance.as_secs()).unwrap_or(i32::MAX),
            external_id_from: source.fields.external_id.to_string(),
            event_type_from: source.fields.event_type.to_string(),
            entity_id_from: text(&source.fields.entity_id),
            entity_version_from: text(&source.fields.entity_version),
            entity_version_fallback_from: text(&source.fields.entity_version_fallback),
            version_tiebreak_from: text(&source.fields.version_tiebreak),
            sequence_from: text(&source.fields.sequence),
            enabled: source.enabled,
            gap_strategy: gaps.map(|g| g.strategy.as_str().to_owned()),
            id_template: gaps.and_then(|g| match &g.strategy {
                GapStrategy::Sequence { id_template } => Some(id_template.clone()),
                GapStrategy::ListApi | GapStrategy::GithubDeliveries { .. } => None,
            }),
            api_base_url: gaps.and_then(|g| g.api_base_url.clone()),
            api_secret_ref: gaps.and_then(|g| g.api_secret_ref.clone()),
            gap_grace_seconds: gaps.map_or(600, |g| {
                i32::try_from(g.grace.as_secs()).unwrap_or(i32::MAX)
            }),
            gap_window: gaps.map_or(100_000, |g| g.window),
            gap_event_types: gaps.and_then(|g| g.event_types.clone()),
            github_hook: gaps.and_then(|g| match &g.strategy {
                GapStrategy::GithubDeliveries { hook, .. } => Some(hook.as_str().to_owned()),
                _ => None,
            }),
            github_app_id: gaps.and_then(|g| match &g.strategy {
                GapStrategy::GithubDeliveries { app_id, .. } => app_id.clone(),
                _ => None,
            }),
            signed_url: source.signed_url.clone(),
            declared_signature: source
                .signature
                .and_then(|spec| serde_json::to_value(spec).ok()),
            accepted_layouts: source.layouts.clone(),
            json_form_field: source.json_form_field.clone(),
            elements_from: source.fields.elements.as_ref().map(ToString::to_string),
            address_check: source.address_check.map(|c| c.as_str().to_owned()),
            partner: source
                .partner
                .as_ref()
                .and_then(|rules| serde_json::to_value(&rules.auth).ok()),
        }
    }
}

impl AddressCheck {
    /// A source's check when it sets none: `observe` for a provider that publishes its
    /// ranges, `off` otherwise.
    pub fn default_for(scheme: Scheme) -> Self {
        if scheme.provider().address_ranges.is_some() {
            AddressCheck::Observe
        } else {
            AddressCheck::Off
        }
    }
}

impl Source {
    /// What a signed delivery from outside its provider's published address ranges gets: the
    /// source's own setting, else `observe` for a provider that publishes them and `off` for
    /// one that does not.
    pub fn address_check(&self) -> AddressCheck {
        self.address_check
            .unwrap_or_else(|| AddressCheck::default_for(self.scheme))
    }

    /// An event of this source with the fields read from it, its payload digested here. Ingest
    /// and backfill both store through this and `store::webhook_events::upsert`.
    pub fn event<'a>(
        &'a self,
        fields: &'a EventFields,
        payload: &'a [u8],
        headers: serde_json::Value,
        verified_with: &'a str,
    ) -> NewEvent<'a> {
        use sha2::Digest as _;
        NewEvent {
            tenant_id: self.tenant_id.as_str(),
            external_id: fields.external_id.as_str(),
            source_id: self.source_id.as_str(),
            event_type: &fields.event_type,
            entity_id: fields.entity_id.as_deref(),
            entity_version: fields.entity_version,
            version_tiebreak: fields.version_tiebreak,
            sequence: fields.sequence,
            payload,
            payload_sha256: sha2::Sha256::digest(payload).into(),
            headers,
            verified_with,
            provider_retries: 0,
            id_outside_signature: false,
            signed_digest: None,
            verified_layout: None,
        }
    }
}

/// How a source is written in a sources file (`hookctl sources apply`, the local runner):
///
/// ```toml
/// [[source]]
/// id = "github-demo"
/// tenant = "acme"
/// scheme = "github"
/// secret_ref = "local/github-demo"
/// tolerance_seconds = 300        # optional, default 300
/// enabled = true                 # optional
/// [source.fields]                # optional, per-field overrides of the scheme's defaults
/// entity_id = "json:/repository/id"
/// entity_version = "json:/updated_at"
/// entity_version_fallback = "header:x-shopify-triggered-at"   # when entity_version finds none
/// version_tiebreak = "header:x-shopify-triggered-at"          # orders events of one version
/// [source.gaps]                  # optional: gap detection and backfill
/// strategy = "sequence"          # or "list_api"
/// id_template = "evt_{seq}"      # sequence only
/// api_base_url = "https://api.example.com"     # a sequence without an API (Xero): both
/// api_secret_ref = "webhooks/example-api-key"  # omitted, gaps are found and alarmed only
/// grace_seconds = 600            # optional, default 600
/// window = 100000                # optional: numbers per window examined, or seconds listed back
/// event_types = ["invoice.paid"] # list_api: the types the endpoint subscribes to, or ["*"]
/// # strategy = "github_deliveries", with hook = "/repos/acme/api/hooks/12345"
/// # (or "/orgs/acme/hooks/7", or "/app/hook" with app_id = "123456")
/// ```
///
/// and, for a provider that publishes the addresses its webhooks come from (GitHub, Stripe),
/// `address_check = "observe"` (its default), `"enforce"` or `"off"`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceSpec {
    pub id: SourceId,
    pub tenant: TenantId,
    /// A catalogue entry or `declared`; none for a partner (`auth = "partner"`).
    #[serde(default)]
    pub scheme: Option<Scheme>,
    /// `partner`: a sender that does not sign, admitted by `[source.partner]`.
    #[serde(default)]
    pub auth: Option<String>,
    /// With `auth = "partner"`: its pinned certificates, addresses and headers.
    #[serde(default)]
    pub partner: Option<crate::partners::PartnerAuth>,
    /// The secret (a bearer token, for a partner with `token_header`); a partner without a
    /// token names none.
    #[serde(default)]
    pub secret_ref: String,
    #[serde(default)]
    pub tolerance_seconds: Option<u32>,
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(default)]
    pub fields: FieldOverrides,
    #[serde(default)]
    pub gaps: Option<GapSpec>,
    /// The URL the provider calls, exactly as configured there, for the schemes that sign it
    /// (Twilio, Square, HubSpot v2/v3) when it is not the one API Gateway sees.
    #[serde(default)]
    pub url: Option<String>,
    /// With `scheme = "declared"`: the signature of a provider not in the catalogue, from the
    /// catalogue's primitives (docs/catalogue.md).
    #[serde(default)]
    pub signature: Option<SignatureSpec>,
    /// The names of the provider's signature layouts this source accepts (`["v3"]`); default:
    /// every one but the legacy ones (docs/providers.md says which are).
    #[serde(default)]
    pub layouts: Option<Vec<String>>,
    /// The form field the provider's JSON arrives in when it posts a form; default: the
    /// provider's (`payload` for GitHub), none for a declared source.
    #[serde(default)]
    pub json_form_field: Option<String>,
    /// The header the provider sends the signature or token in, for a provider that lets its
    /// admin name it (Okta's event hooks); default: the catalogue's.
    #[serde(default)]
    pub signature_header: Option<String>,
    /// `observe`, `enforce` or `off`: what a signed delivery from outside the provider's
    /// published address ranges gets; default: `observe` when the provider publishes them,
    /// else `off`.
    #[serde(default)]
    pub address_check: Option<AddressCheck>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GapSpec {
    strategy: String,
    id_template: Option<String>,
    api_base_url: Option<String>,
    api_secret_ref: Option<String>,
    grace_seconds: Option<u32>,
    window: Option<i64>,
    event_types: Option<Vec<String>>,
    hook: Option<String>,
    app_id: Option<String>,
}

/// The longest event type name accepted in `gaps.event_types`.
pub const MAX_EVENT_TYPE_LEN: usize = 255;

/// The endpoint's event types as a sources file gives them: required for a listing strategy
/// (`["*"]` for an endpoint enabled for every event), refused elsewhere.
fn event_types(
    strategy: &GapStrategy,
    given: Option<Vec<String>>,
) -> Result<Option<Vec<String>>, String> {
    match (strategy, given) {
        (GapStrategy::Sequence { .. }, None) => Ok(None),
        (GapStrategy::Sequence { .. }, Some(_)) => Err(
            "gaps.event_types applies to list_api and github_deliveries only: a sequence lists nothing"
                .into(),
        ),
        (GapStrategy::ListApi, None) => Err(
            "gaps.strategy = \"list_api\" needs event_types: the event types the endpoint \
             subscribes to (the listing asks only for those), or [\"*\"] for every type"
                .into(),
        ),
        // A hook lists only its own deliveries: event types narrow them further, if given.
        (GapStrategy::GithubDeliveries { .. }, None) => Ok(None),
        (_, Some(types)) if types == ["*"] => Ok(None),
        (_, Some(types)) => {
            if types.is_empty() {
                return Err("gaps.event_types is empty".into());
            }
            for t in &types {
                let plain = !t.is_empty()
                    && t.len() <= MAX_EVENT_TYPE_LEN
                    && t.chars().all(|c| c.is_ascii_graphic() && c != '*');
                if !plain {
                    return Err(format!(
                        "gaps.event_types: {t:?} is not an event type name (\"*\" only alone, for every type)"
                    ));
                }
            }
            let mut types = types;
            types.sort();
            types.dedup();
            Ok(Some(types))
        }
    }
}

impl GapSpec {
    fn into_config(self, fields: &FieldMap) -> Result<GapConfig, String> {
        let hook_given = self.hook.is_some();
        let strategy = match (self.strategy.as_str(), self.id_template) {
            ("sequence", Some(t)) if t.contains("{seq}") => {
                if fields.sequence.is_none() {
                    return Err("gaps.strategy = \"sequence\" needs fields.sequence".into());
                }
                GapStrategy::Sequence { id_template: t }
            }
            ("sequence", _) => {
                return Err(
                    "gaps.strategy = \"sequence\" needs an id_template containing {seq}".into(),
                );
            }
            ("list_api", _) => GapStrategy::ListApi,
            ("github_deliveries", _) => {
                let hook = self.hook.ok_or(
                    "gaps.strategy = \"github_deliveries\" needs hook: /repos/{owner}/{repo}/hooks/{hook_id}, \
                     /orgs/{org}/hooks/{hook_id} or /app/hook",
                )?;
                GapStrategy::github_deliveries(&hook, self.app_id)?
            }
            (other, _) => {
                return Err(format!(
                    "gaps.strategy {other:?} is none of sequence, list_api, github_deliveries"
                ));
            }
        };
        if !matches!(strategy, GapStrategy::GithubDeliveries { .. }) && hook_given {
            return Err("gaps.hook is for strategy = \"github_deliveries\" only".into());
        }
        let event_types_given = self.event_types;
        let api = match (self.api_base_url, self.api_secret_ref) {
            (Some(url), Some(secret)) => {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(format!("gaps.api_base_url {url:?} is not an http(s) URL"));
                }
                Some((url.trim_end_matches('/').to_owned(), secret))
            }
            (None, None) if matches!(strategy, GapStrategy::Sequence { .. }) => None,
            (None, None) => {
                return Err(format!(
                    "gaps.strategy = \"{}\" needs api_base_url and api_secret_ref: it lists or \
                     fetches through the provider's API (only a sequence may go without, its \
                     gaps then found and alarmed, never fetched)",
                    strategy.as_str()
                ));
            }
            (Some(_), None) | (None, Some(_)) => {
                return Err(
                    "gaps.api_base_url and gaps.api_secret_ref go together: both, or (a sequence \
                     the provider offers no API for) neither"
                        .into(),
                );
            }
        };
        let window = self.window.unwrap_or(100_000);
        if window <= 0 {
            return Err("gaps.window must be positive".into());
        }
        let event_types = event_types(&strategy, event_types_given)?;
        Ok(GapConfig {
            strategy,
            api_base_url: api.as_ref().map(|(url, _)| url.clone()),
            api_secret_ref: api.map(|(_, secret)| secret),
            grace: Duration::from_secs(self.grace_seconds.unwrap_or(600).into()),
            window,
            event_types,
        })
    }
}

fn yes() -> bool {
    true
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FieldOverrides {
    external_id: Option<crate::FieldLocator>,
    event_type: Option<crate::FieldLocator>,
    entity_id: Option<crate::FieldLocator>,
    entity_version: Option<crate::FieldLocator>,
    entity_version_fallback: Option<crate::FieldLocator>,
    version_tiebreak: Option<crate::FieldLocator>,
    sequence: Option<crate::FieldLocator>,
    /// Where a batched delivery's events are (`json:/data/events`, `form:mandrill_events`), or
    /// `"none"`: a delivery is one event, whatever the catalogue says (a source that keeps the
    /// ids it stored before its provider's entry split batches).
    elements: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SourcesFile {
    #[serde(default)]
    source: Vec<SourceSpec>,
}

#[derive(Debug, thiserror::Error)]
pub enum SourcesFileError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("{path}: source {id}: {reason}")]
    Invalid {
        path: String,
        id: String,
        reason: String,
    },
}

impl SourceSpec {
    pub fn into_source(mut self) -> Result<Source, String> {
        let partner = match (self.auth.as_deref(), self.partner.take()) {
            (None, None) => None,
            (Some("partner"), Some(auth)) => {
                if let Some(scheme) = self.scheme {
                    return Err(format!(
                        "auth = \"partner\" is a sender that does not sign: it names no scheme ({scheme})"
                    ));
                }
                if self.signature.is_some() || self.signature_header.is_some() {
                    return Err(
                        "auth = \"partner\" has no signature: its token is partner.token_header"
                            .into(),
                    );
                }
                let rules =
                    crate::partners::PartnerRules::new(auth).map_err(|e| format!("partner.{e}"))?;
                match (&rules.auth.token_header, self.secret_ref.trim().is_empty()) {
                    (Some(_), true) => {
                        return Err(
                            "partner.token_header needs secret_ref: the secret holding the token"
                                .into(),
                        );
                    }
                    (None, false) => {
                        return Err(
                            "secret_ref is for partner.token_header: a partner without a token names no secret"
                                .into(),
                        );
                    }
                    (None, true) => self.secret_ref = "none".into(),
                    (Some(_), false) => {}
                }
                self.scheme = Some(Scheme::Declared);
                self.signature = rules
                    .auth
                    .token_header
                    .as_deref()
                    .map(crate::partners::token_layout)
                    .transpose()
                    .map_err(|e| format!("partner.token_header: {e}"))?;
                let fields = &mut self.fields;
                if fields.external_id.is_none() {
                    let id = match &rules.auth.event_id_header {
                        Some(header) => format!("header:{}", header.to_ascii_lowercase()),
                        None => "digest:sha256".to_owned(),
                    };
                    fields.external_id =
                        Some(crate::FieldLocator::parse(&id).map_err(|e| format!("partner: {e}"))?);
                }
                if fields.event_type.is_none() {
                    return Err(
                        "auth = \"partner\" needs [source.fields] event_type: where its event type is (\"json:/type\", \"header:x-event-type\")"
                            .into(),
                    );
                }
                Some(rules)
            }
            (Some("partner"), None) => {
                return Err(
                    "auth = \"partner\" needs a [source.partner] table: its client_certificates and cidrs"
                        .into(),
                );
            }
            (None, Some(_)) => {
                return Err("[source.partner] is for auth = \"partner\"".into());
            }
            (Some(other), _) => {
                return Err(format!(
                    "auth {other:?}: the only auth a sources file names is \"partner\" (a signing provider names its scheme)"
                ));
            }
        };
        let Some(scheme) = self.scheme else {
            return Err(
                "scheme is missing: a catalogue entry (hookctl providers list), \"declared\", or auth = \"partner\""
                    .into(),
            );
        };
        let mut source = self.into_signing_source(scheme, partner.is_some())?;
        source.partner = partner;
        Ok(source)
    }

    fn into_signing_source(self, scheme: Scheme, partner: bool) -> Result<Source, String> {
        if self.secret_ref.trim().is_empty() {
            return Err("secret_ref is empty".into());
        }
        let declared_tolerance = self
            .signature
            .as_ref()
            .and_then(|spec| spec.timestamp.as_ref())
            .map(|ts| ts.tolerance_seconds);
        let tolerance_seconds = self
            .tolerance_seconds
            .or(declared_tolerance)
            .unwrap_or(default_tolerance(scheme).as_secs() as u32);
        if !(1..=86_400).contains(&tolerance_seconds) {
            return Err(format!(
                "tolerance_seconds {tolerance_seconds} is outside 1..=86400"
            ));
        }
        if let Some(url) = &self.url {
            let parsed = url::Url::parse(url).map_err(|e| format!("url {url:?}: {e}"))?;
            if !matches!(parsed.scheme(), "https" | "http") {
                return Err(format!(
                    "url {url:?}: the URL the provider calls is http(s)"
                ));
            }
        }
        let signature = match (scheme == Scheme::Declared, self.signature) {
            (true, Some(spec)) => {
                Some(catalogue::declare(spec).map_err(|e| format!("signature.{e}"))?)
            }
            // A partner without a token: nothing is signed; partners.rs admits it.
            (true, None) if partner => None,
            (true, None) => {
                return Err(
                    "scheme = \"declared\" needs a [source.signature] table: the provider's signature from the catalogue's primitives".into(),
                );
            }
            (false, Some(_)) => {
                return Err(format!(
                    "[source.signature] is for a provider not in the catalogue (scheme = \"declared\"); {} has its own",
                    scheme
                ));
            }
            (false, None) => None,
        };
        let signature = match self.signature_header {
            Some(header) => Some(renamed_header(scheme, &header)?),
            None => signature,
        };
        if let Some(names) = &self.layouts {
            let layouts = &scheme.provider().signatures;
            let known: Vec<&str> = layouts.iter().filter_map(|l| l.name.as_deref()).collect();
            if scheme == Scheme::Declared {
                return Err(
                    "layouts is for a provider with several layouts; a declared source has one"
                        .into(),
                );
            }
            if names.is_empty() {
                return Err("layouts is empty: the source would accept no delivery".into());
            }
            if let Some(unknown) = names.iter().find(|n| !known.contains(&n.as_str())) {
                return Err(format!(
                    "layouts: {} has no layout {unknown:?} (its named layouts: {})",
                    scheme,
                    if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    }
                ));
            }
        }
        if let Some(field) = &self.json_form_field
            && field.trim().is_empty()
        {
            return Err("json_form_field is empty".into());
        }
        let json_form_field = self
            .json_form_field
            .or_else(|| scheme.provider().fields.json_form_field.clone());
        let defaults = FieldMap::defaults_for(scheme);
        let o = self.fields;
        let fields = FieldMap {
            external_id: o.external_id.unwrap_or(defaults.external_id),
            event_type: o.event_type.unwrap_or(defaults.event_type),
            entity_id: o.entity_id.or(defaults.entity_id),
            entity_version: o.entity_version.or(defaults.entity_version),
            entity_version_fallback: o
                .entity_version_fallback
                .or(defaults.entity_version_fallback),
            version_tiebreak: o.version_tiebreak.or(defaults.version_tiebreak),
            sequence: o.sequence.or(defaults.sequence),
            elements: match o.elements.as_deref() {
                None => defaults.elements,
                Some("none") => None,
                Some(raw) => {
                    Some(crate::domain::Elements::parse(raw).map_err(|e| format!("fields.{e}"))?)
                }
            },
        };
        let gaps = self.gaps.map(|g| g.into_config(&fields)).transpose()?;
        if let Some(check @ (AddressCheck::Observe | AddressCheck::Enforce)) = self.address_check
            && scheme.provider().address_ranges.is_none()
        {
            let publishing: Vec<&str> = catalogue::providers()
                .filter(|(_, p)| p.address_ranges.is_some())
                .map(|(scheme, _)| scheme.as_str())
                .collect();
            return Err(format!(
                "address_check = \"{}\": {} publishes no address ranges to check against (those \
                 that do: {})",
                check.as_str(),
                scheme,
                publishing.join(", ")
            ));
        }
        Ok(Source {
            source_id: self.id,
            tenant_id: self.tenant,
            scheme,
            secret_ref: self.secret_ref,
            tolerance: Duration::from_secs(tolerance_seconds.into()),
            fields,
            enabled: self.enabled,
            gaps,
            signed_url: self.url,
            signature,
            layouts: self.layouts,
            json_form_field,
            address_check: self.address_check,
            partner: None,
        })
    }
}

/// The layout of `scheme` whose header its admin names, reading `header`: kept as the source's
/// own layout (stored as a declared one is), so the source verifies with it alone.
fn renamed_header(scheme: Scheme, header: &str) -> Result<&'static SignatureSpec, String> {
    if scheme == Scheme::Declared {
        return Err(
            "signature_header: a declared source names its header in [source.signature]".into(),
        );
    }
    let layouts = &scheme.provider().signatures;
    let Some(layout) = layouts.iter().find(|l| l.header_named_by_source) else {
        let fixed: Vec<&str> = layouts.iter().filter_map(|l| l.header.as_deref()).collect();
        return Err(format!(
            "signature_header: {scheme} always sends its signature in {}; signature_header is for a provider whose admin names the header (okta)",
            if fixed.is_empty() {
                "the body".to_owned()
            } else {
                fixed.join(" or ")
            }
        ));
    };
    let name = header.trim().to_ascii_lowercase();
    if http::HeaderName::from_bytes(name.as_bytes()).is_err() || name.is_empty() {
        return Err(format!("signature_header {header:?} is not a header name"));
    }
    // Through its text, not a clone: a layout keeps what it worked out on first use (its
    // header, parsed), and a copy would keep the old header's.
    let mut text = serde_json::to_value(layout).map_err(|e| format!("signature_header: {e}"))?;
    text["header"] = serde_json::Value::String(name);
    text["header_named_by_source"] = serde_json::Value::Bool(false);
    let spec: SignatureSpec =
        serde_json::from_value(text).map_err(|e| format!("signature_header: {e}"))?;
    catalogue::declare(spec).map_err(|e| format!("signature_header: {e}"))
}

/// Reads and validates a sources file.
pub fn read_sources_file(path: &Path) -> Result<Vec<Source>, SourcesFileError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| SourcesFileError::Read {
        path: shown.clone(),
        source,
    })?;
    let file: SourcesFile = toml::from_str(&text).map_err(|e| SourcesFileError::Parse {
        path: shown.clone(),
        message: e.to_string(),
    })?;
    file.source
        .into_iter()
        .map(|spec| {
            let id = spec.id.to_string();
            spec.into_source()
                .map_err(|reason| SourcesFileError::Invalid {
                    path: shown.clone(),
                    id,
                    reason,
                })
        })
        .collect()
}

/// Why a set of sources was not applied.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Two sequence sources of one tenant would number the same event ids: each one's gap
    /// detection would take the other's events for its own, and their deliveries would collide.
    #[error(
        "sequence sources {} of tenant {tenant} share the id template {id_template:?}: their \
         numbers would name each other's events; give each its own template (or tenant)",
        sources.join(", ")
    )]
    SharedIdTemplate {
        tenant: String,
        id_template: String,
        sources: Vec<String>,
    },
    /// A source with stored events would read its event ids another way: every redelivery of
    /// those events would be stored again as a new event.
    #[error(
        "source {source_id} has stored events under ids read from {stored} (elements: \
         {stored_elements}); reading them from {applied} (elements: {applied_elements}) would \
         store every redelivery of those events again as a new event. To keep the stored ids, \
         set external_id = \"{stored}\" and elements = \"{stored_elements}\" in its \
         [source.fields]; to take the new ones anyway, apply the file with hookctl sources \
         apply --change-event-ids <file>"
    )]
    EventIdChanged {
        source_id: String,
        stored: String,
        /// Where the stored ids were read in a batch (`none`: a delivery was one event).
        stored_elements: String,
        applied: String,
        applied_elements: String,
    },
}

/// Writes sources to the database: inserted, or updated in place. All or nothing: the set is
/// refused when, with the sources already stored, two sequence sources of one tenant would share
/// an id template, or when a source with stored events would read its event ids another way
/// (its redeliveries would become new events: [`apply_changing_event_ids`] takes that change).
/// Applies run one at a time (the checks see every other apply's sources).
pub async fn apply(pool: &PgPool, sources: &[Source]) -> Result<(), ApplyError> {
    apply_checked(pool, sources, false).await
}

/// [`apply`], letting a source with stored events read its event ids another way: the
/// operator's decision that redeliveries of the stored events may be stored again.
pub async fn apply_changing_event_ids(pool: &PgPool, sources: &[Source]) -> Result<(), ApplyError> {
    apply_checked(pool, sources, true).await
}

async fn apply_checked(
    pool: &PgPool,
    sources: &[Source],
    change_event_ids: bool,
) -> Result<(), ApplyError> {
    let mut tx = pool.begin().await.map_err(StoreError::from)?;
    store::sources::lock_for_apply(&mut *tx).await?;
    for source in sources {
        let row = SourceRow::from(source);
        if !change_event_ids
            && let Some((stored, stored_elements)) =
                store::sources::event_id_locator_in_use(&mut *tx, &row.source_id).await?
            && (stored != row.external_id_from || stored_elements != row.elements_from)
        {
            return Err(ApplyError::EventIdChanged {
                source_id: row.source_id,
                stored,
                stored_elements: stored_elements.unwrap_or_else(|| "none".into()),
                applied: row.external_id_from,
                applied_elements: row.elements_from.unwrap_or_else(|| "none".into()),
            });
        }
        store::sources::upsert(&mut *tx, &row).await?;
    }
    if let Some(clash) = store::sources::shared_id_templates(&mut *tx)
        .await?
        .into_iter()
        .next()
    {
        return Err(ApplyError::SharedIdTemplate {
            tenant: clash.tenant_id,
            id_template: clash.id_template,
            sources: clash.source_ids,
        });
    }
    tx.commit().await.map_err(StoreError::from)?;
    Ok(())
}

/// Sources by id, cached in the warm process. Unknown ids are cached too (for the same TTL),
/// so a flood of requests to random paths costs one query per id per TTL, and the cache is
/// bounded so it cannot be grown without limit.
///
/// When the database cannot answer (a retryable [`StoreError`]), a cached entry is served past
/// its TTL for at most `stale_if_error` (stale-if-error, see [`crate::stale`]): deliveries to a
/// source this process has read keep being verified during an outage. Never for an error that
/// will not pass; never for a source this process has not read.
pub struct SourceRegistry {
    pool: PgPool,
    policy: Policy,
    clock: Clock,
    cache: Mutex<HashMap<SourceId, CachedSource>>,
}

/// When a source was read, and what was found (`None`: no enabled source with that id).
struct CachedSource {
    freshness: Freshness,
    source: Option<Arc<Source>>,
}

const MAX_CACHED_SOURCES: usize = 10_000;

impl SourceRegistry {
    /// Entries fresh for `ttl`, served stale for at most
    /// [`crate::stale::DEFAULT_STALE_IF_ERROR`] past it while the database cannot answer.
    pub fn new(pool: PgPool, ttl: Duration) -> Self {
        Self {
            pool,
            policy: Policy {
                ttl,
                stale_if_error: crate::stale::DEFAULT_STALE_IF_ERROR,
            },
            clock: system_clock(),
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Serves entries at most `stale_if_error` past their TTL while the database cannot answer
    /// (zero: never).
    pub fn with_stale_if_error(mut self, stale_if_error: Duration) -> Self {
        self.policy.stale_if_error = stale_if_error;
        self
    }

    /// Reads the time from `clock` (tests move it to cross the TTL and the bound).
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, HashMap<SourceId, CachedSource>> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The enabled source with this id, if there is one.
    pub async fn get(&self, id: &SourceId) -> Result<Option<Arc<Source>>, StoreError> {
        let now = (self.clock)();
        let bounded = {
            let mut cache = self.cache();
            match cache.get_mut(id) {
                None => false,
                Some(entry) => match entry.freshness.lookup(&self.policy, now) {
                    Use::Fresh | Use::Refreshing => return Ok(entry.source.clone()),
                    Use::Stale => {
                        served_stale(id, &mut entry.freshness, now, None);
                        return Ok(entry.source.clone());
                    }
                    Use::Ask => entry.freshness.bounded(&self.policy, now),
                },
            }
        };
        let read = async {
            find(&self.pool, id)
                .await
                .map(|found| found.filter(|s| s.enabled).map(Arc::new))
        };
        let read = if bounded {
            tokio::time::timeout(REFRESH_TIMEOUT, read)
                .await
                .unwrap_or_else(|_| Err(StoreError::Unavailable(sqlx::Error::PoolTimedOut)))
        } else {
            read.await
        };
        match read {
            Ok(source) => {
                let mut cache = self.cache();
                if cache.len() >= MAX_CACHED_SOURCES {
                    cache.clear();
                }
                let recovered = cache.get(id).is_some_and(|e| e.freshness.failing());
                if recovered {
                    tracing::info!(source_id = %id, "source read again: no longer served stale");
                }
                cache.insert(
                    id.clone(),
                    CachedSource {
                        freshness: Freshness::new(now),
                        source: source.clone(),
                    },
                );
                Ok(source)
            }
            Err(error) if error.is_retryable() => {
                let now = (self.clock)();
                let mut cache = self.cache();
                if let Some(entry) = cache.get_mut(id)
                    && entry.freshness.failed(&self.policy, now)
                {
                    served_stale(id, &mut entry.freshness, now, Some(&error));
                    return Ok(entry.source.clone());
                }
                Err(error)
            }
            Err(error) => {
                // Not an outage: whatever was cached is not served again.
                self.cache().remove(id);
                Err(error)
            }
        }
    }
}

/// Counts a stale source served, and says so at most once a minute per source.
fn served_stale(
    id: &SourceId,
    freshness: &mut Freshness,
    now: Instant,
    error: Option<&StoreError>,
) {
    crate::metrics::stale_served("source");
    if freshness.warn_now(now) {
        let age_seconds = freshness.age(now).as_secs();
        match error {
            Some(error) => tracing::warn!(
                source_id = %id, age_seconds, %error,
                "serving a stale source: the database cannot answer"
            ),
            None => tracing::warn!(
                source_id = %id, age_seconds,
                "serving a stale source: the database could not answer"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source names the header its provider's admin chose only where the entry allows it
    /// (Okta); the source verifies with its own copy of the layout, the catalogue's untouched.
    #[test]
    fn a_source_names_its_signature_header_only_where_the_provider_lets_its_admin() {
        let spec = |scheme: &str, header: &str| -> Result<Source, String> {
            let text = format!(
                "id = 'src'\ntenant = 'acme'\nscheme = '{scheme}'\nsecret_ref = 's'\nsignature_header = '{header}'\n"
            );
            toml::from_str::<SourceSpec>(&text)
                .map_err(|e| e.to_string())?
                .into_source()
        };
        let okta = spec("okta", "X-Okta-Hook-Secret").unwrap();
        let layout = okta.signature.expect("the source's own layout");
        assert_eq!(layout.header.as_deref(), Some("x-okta-hook-secret"));
        assert!(!layout.header_named_by_source);
        // The catalogue's layout is untouched.
        assert_eq!(
            Scheme::Okta.provider().signatures[0].header.as_deref(),
            Some("authorization")
        );

        let stripe = spec("stripe", "x-my-signature").unwrap_err();
        assert!(
            stripe.contains("stripe-signature") && stripe.contains("signature_header"),
            "{stripe}"
        );
        let bad = spec("okta", "not a header").unwrap_err();
        assert!(bad.contains("not a header name"), "{bad}");
    }

    /// A source of a provider not in the catalogue declares its signature from the
    /// catalogue's primitives; a mistake in it is refused with an error naming the field.
    #[test]
    fn a_declared_signature_is_validated_and_errors_name_the_field() {
        let file = |signature: &str, scheme: &str| -> Result<Source, String> {
            let text = format!(
                "[[source]]\nid='acme'\ntenant='t'\nscheme='{scheme}'\nsecret_ref='x'\n{signature}"
            );
            let parsed: SourcesFile = toml::from_str(&text).map_err(|e| e.to_string())?;
            parsed.source.into_iter().next().unwrap().into_source()
        };
        let good = "[source.signature]\nkind='hmac'\nhash='sha256'\nheader='x-acme-signature'\nprefix='sha256='\nsigned=['{timestamp}', '.', '{body}']\ntimestamp={header='x-acme-timestamp', tolerance_seconds=120}\nsigned_headers=['x-acme-timestamp']\n";
        let source = file(good, "declared").unwrap();
        assert_eq!(source.scheme, Scheme::Declared);
        assert_eq!(
            source.signature.unwrap().header.as_deref(),
            Some("x-acme-signature")
        );
        assert_eq!(
            source.tolerance,
            Duration::from_secs(120),
            "the layout's own tolerance"
        );
        // The same layout twice is one copy.
        assert!(std::ptr::eq(
            source.signature.unwrap(),
            file(good, "declared").unwrap().signature.unwrap()
        ));

        let missing_hash = good.replace("hash='sha256'\n", "");
        assert_eq!(
            file(&missing_hash, "declared").unwrap_err(),
            "signature.hash: hmac and digest need a hash"
        );
        let bad_part = good.replace("'{body}'", "'{bdy}'");
        assert!(
            file(&bad_part, "declared").unwrap_err().contains("{bdy}"),
            "names the part"
        );
        let typo = good.replace("prefix=", "prefx=");
        assert!(
            file(&typo, "declared").unwrap_err().contains("prefx"),
            "names the field"
        );
        assert!(
            file("", "declared")
                .unwrap_err()
                .contains("[source.signature]")
        );
        assert!(file(good, "github").unwrap_err().contains("declared"));
    }

    /// A layout cannot call unsigned parts signed: a header listed in `signed_headers` must be
    /// one the signed parts read, and a timestamp must be among them, else the engine trusts an
    /// id or a window the sender controls.
    #[test]
    fn a_declared_signature_cannot_call_unsigned_parts_signed() {
        let file = |signature: &str| -> Result<Source, String> {
            let text = format!(
                "[[source]]\nid='acme'\ntenant='t'\nscheme='declared'\nsecret_ref='x'\n{signature}"
            );
            let parsed: SourcesFile = toml::from_str(&text).map_err(|e| e.to_string())?;
            parsed.source.into_iter().next().unwrap().into_source()
        };
        let good = "[source.signature]\nkind='hmac'\nhash='sha256'\nheader='x-acme-signature'\nsigned=['{header:x-acme-id}', '.', '{timestamp}', '.', '{body}']\ntimestamp={header='x-acme-timestamp', tolerance_seconds=120}\nsigned_headers=['x-acme-id', 'x-acme-timestamp']\n";
        file(good).unwrap();

        let id_not_signed = good.replace("'{header:x-acme-id}', '.', ", "");
        assert_eq!(
            file(&id_not_signed).unwrap_err(),
            "signature.signed_headers: \"x-acme-id\" is listed as signed but no signed part reads it"
        );
        let window_not_signed = good
            .replace("'{timestamp}', '.', ", "")
            .replace(", 'x-acme-timestamp'", "");
        assert_eq!(
            file(&window_not_signed).unwrap_err(),
            "signature.timestamp: the timestamp is not among the signed parts: the sender could move it"
        );
        let json_window = good
            .replace(
                "timestamp={header='x-acme-timestamp',",
                "timestamp={json='/sent_at',",
            )
            .replace("'{timestamp}', '.', '{body}'", "'{header:x-acme-id}'")
            .replace(", 'x-acme-timestamp'", "");
        assert_eq!(
            file(&json_window).unwrap_err(),
            "signature.timestamp: the timestamp is not among the signed parts: the sender could move it"
        );
        // A JSON timestamp inside a signed body is signed.
        let json_in_body = good
            .replace(
                "timestamp={header='x-acme-timestamp',",
                "timestamp={json='/sent_at',",
            )
            .replace("'{timestamp}', '.', ", "")
            .replace(", 'x-acme-timestamp'", "");
        file(&json_in_body).unwrap();
    }

    /// `address_check` defaults to `observe` for a provider that publishes its ranges and to
    /// `off` otherwise; a source may enforce or turn it off, and may not check against ranges
    /// its provider does not publish.
    #[test]
    fn a_source_checks_addresses_only_where_its_provider_publishes_them() {
        let spec = |scheme: &str, check: Option<&str>| -> Result<Source, String> {
            let line = check.map_or(String::new(), |c| format!("address_check = '{c}'\n"));
            let text = format!(
                "id = 'src'\ntenant = 'acme'\nscheme = '{scheme}'\nsecret_ref = 's'\n{line}"
            );
            toml::from_str::<SourceSpec>(&text)
                .map_err(|e| e.to_string())?
                .into_source()
        };
        let github = spec("github", None).unwrap();
        assert_eq!(github.address_check, None);
        assert_eq!(github.address_check(), AddressCheck::Observe);
        assert_eq!(
            spec("stripe", Some("enforce")).unwrap().address_check(),
            AddressCheck::Enforce
        );
        assert_eq!(
            spec("github", Some("off")).unwrap().address_check(),
            AddressCheck::Off
        );
        assert_eq!(
            spec("slack", None).unwrap().address_check(),
            AddressCheck::Off
        );
        assert_eq!(
            spec("slack", Some("off")).unwrap().address_check(),
            AddressCheck::Off
        );
        let refused = spec("slack", Some("enforce")).unwrap_err();
        assert!(
            refused.contains("publishes no address ranges") && refused.contains("github"),
            "{refused}"
        );
        assert!(
            spec("github", Some("strict"))
                .unwrap_err()
                .contains("strict")
        );
        // Stored and read back, the source's own setting (or none) is kept.
        let row = SourceRow::from(&github);
        assert_eq!(row.address_check, None);
        assert_eq!(Source::try_from(row).unwrap().address_check, None);
        let enforcing = spec("github", Some("enforce")).unwrap();
        let row = SourceRow::from(&enforcing);
        assert_eq!(row.address_check.as_deref(), Some("enforce"));
        assert_eq!(
            Source::try_from(row).unwrap().address_check,
            Some(AddressCheck::Enforce)
        );
    }

    #[test]
    fn a_minimal_spec_takes_the_scheme_defaults() {
        let file: SourcesFile = toml::from_str(
            r#"
            [[source]]
            id = "gh"
            tenant = "acme"
            scheme = "github"
            secret_ref = "local/gh"
            [source.fields]
            entity_id = "json:/repository/id"
            "#,
        )
        .unwrap();
        let source = file
            .source
            .into_iter()
            .next()
            .unwrap()
            .into_source()
            .unwrap();
        assert_eq!(source.tolerance, DEFAULT_TOLERANCE);
        assert_eq!(
            source.fields.external_id,
            crate::FieldLocator::header("x-github-delivery")
        );
        assert_eq!(
            source.fields.entity_id,
            Some(crate::FieldLocator::json("/repository/id"))
        );
        assert!(source.enabled);
    }

    /// A source takes its provider's batch from the catalogue, names its own (a declared
    /// provider that batches), or keeps a delivery as one event (`elements = "none"`).
    #[test]
    fn a_source_says_where_its_batches_are_or_that_it_has_none() {
        let read = |scheme: &str, elements: Option<&str>| {
            let line = elements.map_or(String::new(), |e| format!("elements = {e:?}\n"));
            let file: SourcesFile = toml::from_str(&format!(
                "[[source]]\nid='s'\ntenant='t'\nscheme='{scheme}'\nsecret_ref='x'\n[source.fields]\n{line}"
            ))
            .unwrap();
            file.source
                .into_iter()
                .next()
                .unwrap()
                .into_source()
                .map(|s| s.fields.elements.map(|e| e.to_string()))
        };
        assert_eq!(read("hubspot", None), Ok(Some("json:/".into())));
        assert_eq!(read("hubspot", Some("none")), Ok(None));
        assert_eq!(read("stripe", None), Ok(None));
        assert_eq!(
            read("stripe", Some("json:/data/events")),
            Ok(Some("json:/data/events".into()))
        );
        assert_eq!(
            read("okta", Some("form:events")),
            Ok(Some("form:events".into()))
        );
        assert!(
            read("hubspot", Some("events"))
                .unwrap_err()
                .contains("elements")
        );
    }

    #[test]
    fn gap_settings_are_read_and_checked() {
        let spec = |gaps: &str| {
            let file: SourcesFile = toml::from_str(&format!(
                "[[source]]\nid='p'\ntenant='t'\nscheme='stripe'\nsecret_ref='x'\n[source.fields]\nsequence='json:/sequence'\n[source.gaps]\n{gaps}"
            ))
            .unwrap();
            file.source.into_iter().next().unwrap().into_source()
        };
        let ok = spec("strategy='sequence'\nid_template='evt_{seq}'\napi_base_url='http://127.0.0.1:9/'\napi_secret_ref='k'").unwrap();
        let gaps = ok.gaps.unwrap();
        assert_eq!(
            gaps.strategy,
            GapStrategy::Sequence {
                id_template: "evt_{seq}".into()
            }
        );
        assert_eq!(
            (gaps.api_base_url.as_deref(), gaps.grace, gaps.window),
            (
                Some("http://127.0.0.1:9"),
                Duration::from_secs(600),
                100_000
            )
        );
        // A sequence the provider offers no API for (Xero): found and alarmed, never fetched.
        let unfetchable = spec("strategy='sequence'\nid_template='xero-seq-{seq}'")
            .unwrap()
            .gaps
            .unwrap();
        assert_eq!(
            (unfetchable.api_base_url, unfetchable.api_secret_ref),
            (None, None)
        );
        assert!(
            spec("strategy='list_api'\nevent_types=['*']")
                .unwrap_err()
                .contains("needs api_base_url and api_secret_ref")
        );
        assert!(
            spec("strategy='sequence'\nid_template='evt_{seq}'\napi_base_url='http://x'")
                .unwrap_err()
                .contains("go together")
        );
        assert!(
            spec("strategy='sequence'\napi_base_url='http://x'\napi_secret_ref='k'")
                .unwrap_err()
                .contains("{seq}")
        );
        assert!(
            spec("strategy='list'\napi_base_url='http://x'\napi_secret_ref='k'")
                .unwrap_err()
                .contains("list_api")
        );
        assert!(
            spec("strategy='list_api'\napi_base_url='x'\napi_secret_ref='k'")
                .unwrap_err()
                .contains("http")
        );
        let listing = |types: &str| {
            spec(&format!(
                "strategy='list_api'\napi_base_url='http://x'\napi_secret_ref='k'\n{types}"
            ))
            .map(|s| s.gaps.unwrap().event_types)
        };
        assert!(listing("").unwrap_err().contains("event_types"));
        assert_eq!(listing("event_types=['*']").unwrap(), None);
        assert_eq!(
            listing("event_types=['invoice.paid','charge.refunded','invoice.paid']").unwrap(),
            Some(vec!["charge.refunded".into(), "invoice.paid".into()])
        );
        for bad in [
            "[]",
            "['charge.*']",
            "['*','invoice.paid']",
            "['']",
            "['a b']",
        ] {
            assert!(listing(&format!("event_types={bad}")).is_err(), "{bad}");
        }
        assert!(
            spec("strategy='sequence'\nid_template='evt_{seq}'\napi_base_url='http://x'\napi_secret_ref='k'\nevent_types=['a']")
                .unwrap_err()
                .contains("list_api")
        );
    }

    #[test]
    fn sequence_numbers_are_read_back_from_ids_the_template_gives() {
        assert_eq!(sequence_of_id("evt_{seq}", "evt_42"), Some(42));
        assert_eq!(sequence_of_id("{seq}", "7"), Some(7));
        assert_eq!(sequence_of_id("n-{seq}-live", "n-9-live"), Some(9));
        for not_ours in ["evt_042", "evt_", "evt_x", "charge_42", "evt_42 ", "evt_+4"] {
            assert_eq!(sequence_of_id("evt_{seq}", not_ours), None, "{not_ours}");
        }
        assert_eq!(sequence_of_id("evt", "evt"), None);
        assert_eq!(
            sequence_of_id("evt_{seq}", &id_of_sequence("evt_{seq}", i64::MAX)),
            Some(i64::MAX)
        );
        assert_eq!(
            sequence_of_id("evt_{seq}", "evt_99999999999999999999"),
            None
        );
    }

    #[test]
    fn bad_specs_are_refused_with_the_reason() {
        let bad_scheme = toml::from_str::<SourcesFile>(
            "[[source]]\nid='a'\ntenant='t'\nscheme='paypal'\nsecret_ref='x'\n",
        );
        assert!(bad_scheme.unwrap_err().to_string().contains("paypal"));
        let bad_locator = toml::from_str::<SourcesFile>(
            "[[source]]\nid='a'\ntenant='t'\nscheme='github'\nsecret_ref='x'\n[source.fields]\nexternal_id='id'\n",
        );
        assert!(
            bad_locator
                .unwrap_err()
                .to_string()
                .contains("header:<name>")
        );
        let spec: SourcesFile = toml::from_str("[[source]]\nid='a'\ntenant='t'\nscheme='github'\nsecret_ref='x'\ntolerance_seconds=0\n").unwrap();
        assert!(
            spec.source
                .into_iter()
                .next()
                .unwrap()
                .into_source()
                .unwrap_err()
                .contains("tolerance")
        );
    }
}
