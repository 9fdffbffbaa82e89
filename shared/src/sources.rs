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
use sqlx::PgPool;

use crate::domain::{Scheme, SourceId, TenantId};
use crate::extract::FieldMap;
use crate::store::{self, StoreError};

/// The default timestamp tolerance, both directions.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(300);

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
/// ```
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceSpec {
    pub id: SourceId,
    pub tenant: TenantId,
    pub scheme: Scheme,
    pub secret_ref: String,
    #[serde(default)]
    pub tolerance_seconds: Option<u32>,
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(default)]
    pub fields: FieldOverrides,
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
    sequence: Option<crate::FieldLocator>,
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
    pub fn into_source(self) -> Result<Source, String> {
        if self.secret_ref.trim().is_empty() {
            return Err("secret_ref is empty".into());
        }
        let tolerance_seconds = self
            .tolerance_seconds
            .unwrap_or(DEFAULT_TOLERANCE.as_secs() as u32);
        if !(1..=86_400).contains(&tolerance_seconds) {
            return Err(format!(
                "tolerance_seconds {tolerance_seconds} is outside 1..=86400"
            ));
        }
        let defaults = FieldMap::defaults_for(self.scheme);
        let o = self.fields;
        Ok(Source {
            source_id: self.id,
            tenant_id: self.tenant,
            scheme: self.scheme,
            secret_ref: self.secret_ref,
            tolerance: Duration::from_secs(tolerance_seconds.into()),
            fields: FieldMap {
                external_id: o.external_id.unwrap_or(defaults.external_id),
                event_type: o.event_type.unwrap_or(defaults.event_type),
                entity_id: o.entity_id.or(defaults.entity_id),
                entity_version: o.entity_version.or(defaults.entity_version),
                sequence: o.sequence.or(defaults.sequence),
            },
            enabled: self.enabled,
        })
    }
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

/// Writes sources to the database: inserted, or updated in place.
pub async fn apply(pool: &PgPool, sources: &[Source]) -> Result<(), StoreError> {
    let mut tx = pool.begin().await?;
    for source in sources {
        store::sources::upsert(&mut *tx, source).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Sources by id, cached in the warm process. Unknown ids are cached too (for the same TTL),
/// so a flood of requests to random paths costs one query per id per TTL, and the cache is
/// bounded so it cannot be grown without limit.
pub struct SourceRegistry {
    pool: PgPool,
    ttl: Duration,
    cache: Mutex<HashMap<SourceId, CachedSource>>,
}

/// When a source was read, and what was found (`None`: no enabled source with that id).
type CachedSource = (Instant, Option<Arc<Source>>);

const MAX_CACHED_SOURCES: usize = 10_000;

impl SourceRegistry {
    pub fn new(pool: PgPool, ttl: Duration) -> Self {
        Self {
            pool,
            ttl,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The enabled source with this id, if there is one.
    pub async fn get(&self, id: &SourceId) -> Result<Option<Arc<Source>>, StoreError> {
        if let Some((fetched, source)) = self.cache.lock().expect("lock poisoned").get(id)
            && fetched.elapsed() < self.ttl
        {
            return Ok(source.clone());
        }
        let source = store::sources::find(&self.pool, id)
            .await?
            .filter(|s| s.enabled)
            .map(Arc::new);
        let mut cache = self.cache.lock().expect("lock poisoned");
        if cache.len() >= MAX_CACHED_SOURCES {
            cache.clear();
        }
        cache.insert(id.clone(), (Instant::now(), source.clone()));
        Ok(source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
