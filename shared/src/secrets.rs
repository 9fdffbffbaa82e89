//! Signing secrets: where they come from, how long they are cached, and a type that never
//! prints them.
//!
//! A source's `secret_ref` names a secret. In AWS it is a Secrets Manager secret whose
//! `AWSCURRENT` value is the signing secret; during a rotation its `AWSPREVIOUS` value is
//! accepted too, so rotating is one `put-secret-value` and no redeploy. Both values are cached
//! together in the warm process for a TTL, so a rotation is picked up whole within that TTL
//! without a restart.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_secretsmanager::error::DisplayErrorContext;
use aws_sdk_secretsmanager::operation::get_secret_value::GetSecretValueError;
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use crate::domain::SecretVersion;
use crate::stale::{Freshness, Policy, REFRESH_TIMEOUT, Use};

/// One signing secret. Its `Debug` never shows the value and it has no `Display`.
pub struct SigningSecret(SecretString);

impl SigningSecret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(SecretString::from(value.into()))
    }

    /// The secret's text. Only signature code should call this.
    pub fn expose(&self) -> &str {
        self.0.expose_secret()
    }
}

impl fmt::Debug for SigningSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SigningSecret([redacted])")
    }
}

/// The secrets a delivery may be signed with: the current one and, during a rotation, the
/// previous one.
#[derive(Debug)]
pub struct SecretSet {
    pub current: SigningSecret,
    pub previous: Option<SigningSecret>,
}

impl SecretSet {
    pub fn new(current: impl Into<String>, previous: Option<String>) -> Self {
        Self {
            current: SigningSecret::new(current),
            previous: previous.map(SigningSecret::new),
        }
    }

    /// Current first, then previous.
    pub fn candidates(&self) -> impl Iterator<Item = (SecretVersion, &SigningSecret)> {
        std::iter::once((SecretVersion::Current, &self.current))
            .chain(self.previous.iter().map(|s| (SecretVersion::Previous, s)))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("secret {secret_ref:?} does not exist")]
    NotFound { secret_ref: String },
    #[error("secret {secret_ref:?} has no string value")]
    NotAString { secret_ref: String },
    #[error("secret store unavailable while reading {secret_ref:?}: {reason}")]
    Unavailable { secret_ref: String, reason: String },
    #[error("local secrets file {path}: {reason}")]
    File { path: PathBuf, reason: String },
}

impl SecretError {
    /// A missing or malformed secret is a configuration fault; anything else may pass.
    pub fn is_misconfiguration(&self) -> bool {
        !matches!(self, SecretError::Unavailable { .. })
    }
}

/// Where signing secrets are read from. Built once per process.
pub enum SecretStore {
    /// AWS Secrets Manager, each secret cached as one snapshot of its current and previous
    /// values.
    Aws(AwsSecrets),
    /// A TOML file re-read on every lookup (local development only), so editing it rotates.
    File(PathBuf),
    /// Secrets held in memory: tests and the `verify` command.
    Memory(HashMap<String, Arc<SecretSet>>),
}

impl SecretStore {
    pub fn memory(entries: impl IntoIterator<Item = (String, SecretSet)>) -> Self {
        Self::Memory(entries.into_iter().map(|(k, v)| (k, Arc::new(v))).collect())
    }

    #[tracing::instrument(skip_all, fields(secret_ref = %secret_ref), err)]
    pub async fn secrets(&self, secret_ref: &str) -> Result<Arc<SecretSet>, SecretError> {
        match self {
            // Boxed: the AWS SDK future is deep enough to overflow the compiler's layout
            // query depth in every crate that awaits ingest otherwise.
            SecretStore::Aws(aws) => Box::pin(aws.secrets(secret_ref)).await,
            SecretStore::File(path) => read_secrets_file(path, secret_ref).await.map(Arc::new),
            SecretStore::Memory(map) => {
                map.get(secret_ref)
                    .cloned()
                    .ok_or_else(|| SecretError::NotFound {
                        secret_ref: secret_ref.to_owned(),
                    })
            }
        }
    }
}

/// Format of the local secrets file:
///
/// ```toml
/// [secrets."local/github-demo"]
/// current = "It's a Secret to Everybody"
/// previous = "optional, accepted during a rotation"
/// ```
#[derive(Deserialize)]
struct SecretsFile {
    #[serde(default)]
    secrets: HashMap<String, SecretsFileEntry>,
}

#[derive(Deserialize)]
struct SecretsFileEntry {
    current: String,
    previous: Option<String>,
}

async fn read_secrets_file(path: &PathBuf, secret_ref: &str) -> Result<SecretSet, SecretError> {
    let file_error = |reason: String| SecretError::File {
        path: path.clone(),
        reason,
    };
    let text = tokio::fs::read_to_string(path)
        .await
        .map_err(|e| file_error(e.to_string()))?;
    // The TOML error message may quote file content; report only its position.
    let mut parsed: SecretsFile = toml::from_str(&text)
        .map_err(|e| file_error(format!("not valid TOML (at byte range {:?})", e.span())))?;
    let entry = parsed
        .secrets
        .remove(secret_ref)
        .ok_or_else(|| SecretError::NotFound {
            secret_ref: secret_ref.to_owned(),
        })?;
    Ok(SecretSet::new(entry.current, entry.previous))
}

/// Settings of the Secrets Manager client.
#[derive(Debug, Clone)]
pub struct AwsSecretsSettings {
    /// Endpoint override (moto in tests, a VPC endpoint in production if needed).
    pub endpoint_url: Option<String>,
    pub region: Option<String>,
    /// How long a fetched value is served before Secrets Manager is asked again.
    pub ttl: Duration,
}

impl AwsSecretsSettings {
    pub fn endpoint(&self) -> crate::aws::AwsEndpoint {
        crate::aws::AwsEndpoint {
            endpoint_url: self.endpoint_url.clone(),
            region: self.region.clone(),
        }
    }
}

/// What the secret cache reads the time from: [`system_clock`] in production, a clock the
/// test moves in tests (so a TTL is crossed without sleeping).
pub type Clock = Arc<dyn Fn() -> Instant + Send + Sync>;

pub fn system_clock() -> Clock {
    Arc::new(Instant::now)
}

/// Secrets Manager, cached in the warm process.
///
/// A secret's `AWSCURRENT` and `AWSPREVIOUS` values are fetched together and cached as one
/// snapshot with one expiry, so a rotation is seen whole: there is no moment at which the new
/// current value is served beside a stale "no previous version", which would refuse the
/// retired secret while providers may still sign with it.
///
/// When Secrets Manager cannot answer ([`SecretError::Unavailable`]), the last snapshot is
/// served past its TTL for at most `stale_if_error` (stale-if-error, see [`crate::stale`]), and
/// Secrets Manager is asked again at most once a second meanwhile. A secret deleted or unusable
/// is never served stale.
pub struct AwsSecrets {
    client: aws_sdk_secretsmanager::Client,
    policy: Policy,
    clock: Clock,
    snapshots: Mutex<HashMap<String, Snapshot>>,
}

struct Snapshot {
    set: Arc<SecretSet>,
    freshness: Freshness,
}

const CURRENT_STAGE: &str = "AWSCURRENT";
const PREVIOUS_STAGE: &str = "AWSPREVIOUS";

impl AwsSecrets {
    pub async fn connect(settings: &AwsSecretsSettings) -> Self {
        Self::with_clock(settings, system_clock()).await
    }

    /// As [`AwsSecrets::connect`], reading the time from `clock`.
    pub async fn with_clock(settings: &AwsSecretsSettings, clock: Clock) -> Self {
        let sdk_config = crate::aws::sdk_config(&settings.endpoint()).await;
        Self {
            client: aws_sdk_secretsmanager::Client::new(&sdk_config),
            policy: Policy {
                ttl: settings.ttl,
                stale_if_error: crate::stale::DEFAULT_STALE_IF_ERROR,
            },
            clock,
            snapshots: Mutex::new(HashMap::new()),
        }
    }

    /// Serves a snapshot at most `stale_if_error` past its TTL while Secrets Manager cannot
    /// answer (zero: never).
    pub fn with_stale_if_error(mut self, stale_if_error: Duration) -> Self {
        self.policy.stale_if_error = stale_if_error;
        self
    }

    async fn secrets(&self, secret_ref: &str) -> Result<Arc<SecretSet>, SecretError> {
        let now = (self.clock)();
        let bounded = {
            let mut map = self.snapshots();
            match map.get_mut(secret_ref) {
                None => false,
                Some(snapshot) => match snapshot.freshness.lookup(&self.policy, now) {
                    Use::Fresh | Use::Refreshing => return Ok(snapshot.set.clone()),
                    Use::Stale => {
                        served_stale(secret_ref, &mut snapshot.freshness, now, None);
                        return Ok(snapshot.set.clone());
                    }
                    Use::Ask => snapshot.freshness.bounded(&self.policy, now),
                },
            }
        };
        let fetched = if bounded {
            tokio::time::timeout(REFRESH_TIMEOUT, self.fetch(secret_ref))
                .await
                .unwrap_or_else(|_| {
                    Err(SecretError::Unavailable {
                        secret_ref: secret_ref.to_owned(),
                        reason: format!("no answer within {REFRESH_TIMEOUT:?}"),
                    })
                })
        } else {
            self.fetch(secret_ref).await
        };
        match fetched {
            Ok(set) => {
                let set = Arc::new(set);
                let mut map = self.snapshots();
                if map.get(secret_ref).is_some_and(|s| s.freshness.failing()) {
                    tracing::info!(secret_ref, "secret read again: no longer served stale");
                }
                map.insert(
                    secret_ref.to_owned(),
                    Snapshot {
                        set: set.clone(),
                        freshness: Freshness::new(now),
                    },
                );
                Ok(set)
            }
            Err(error @ SecretError::Unavailable { .. }) => {
                // Serve the last snapshot, within the bound, when a refresh fails transiently: a
                // Secrets Manager outage must not turn into 503s for deliveries we could verify.
                let now = (self.clock)();
                let mut map = self.snapshots();
                if let Some(snapshot) = map.get_mut(secret_ref)
                    && snapshot.freshness.failed(&self.policy, now)
                {
                    served_stale(secret_ref, &mut snapshot.freshness, now, Some(&error));
                    return Ok(snapshot.set.clone());
                }
                Err(error)
            }
            Err(error) => {
                // Deleted or unusable: stop serving what was cached.
                self.snapshots().remove(secret_ref);
                Err(error)
            }
        }
    }

    /// Both stages, read together.
    async fn fetch(&self, secret_ref: &str) -> Result<SecretSet, SecretError> {
        let current = self
            .stage(secret_ref, CURRENT_STAGE)
            .await?
            .ok_or_else(|| SecretError::NotFound {
                secret_ref: secret_ref.to_owned(),
            })?;
        let previous = self.stage(secret_ref, PREVIOUS_STAGE).await?;
        Ok(SecretSet::new(current, previous))
    }

    /// The string value of one stage of a secret; `None` when that stage does not exist.
    async fn stage(&self, secret_ref: &str, stage: &str) -> Result<Option<String>, SecretError> {
        let output = self
            .client
            .get_secret_value()
            .secret_id(secret_ref)
            .version_stage(stage)
            .send()
            .await;
        match output {
            Ok(value) => value
                .secret_string
                .map(Some)
                .ok_or_else(|| SecretError::NotAString {
                    secret_ref: secret_ref.to_owned(),
                }),
            Err(error) => {
                let not_found = error
                    .as_service_error()
                    .is_some_and(GetSecretValueError::is_resource_not_found_exception);
                if not_found {
                    Ok(None)
                } else {
                    Err(SecretError::Unavailable {
                        secret_ref: secret_ref.to_owned(),
                        reason: DisplayErrorContext(error).to_string(),
                    })
                }
            }
        }
    }

    fn snapshots(&self) -> std::sync::MutexGuard<'_, HashMap<String, Snapshot>> {
        self.snapshots.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Counts a stale secret served, and says so at most once a minute per secret.
fn served_stale(
    secret_ref: &str,
    freshness: &mut Freshness,
    now: Instant,
    error: Option<&SecretError>,
) {
    crate::metrics::stale_served("secret");
    if freshness.warn_now(now) {
        let age_seconds = freshness.age(now).as_secs();
        match error {
            Some(error) => tracing::warn!(
                secret_ref, age_seconds, %error,
                "serving a stale secret: Secrets Manager cannot answer"
            ),
            None => tracing::warn!(
                secret_ref,
                age_seconds,
                "serving a stale secret: Secrets Manager could not answer"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print() {
        let set = SecretSet::new("hunter2-signing", Some("old-signing".into()));
        let shown = format!("{set:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("old-signing"),
            "{shown}"
        );
    }

    #[tokio::test]
    async fn file_store_reads_current_and_previous_and_rereads_on_change() {
        let dir = std::env::temp_dir().join(format!("secrets-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("secrets.toml");
        std::fs::write(&path, "[secrets.a]\ncurrent = \"one\"\n").unwrap();
        let store = SecretStore::File(path.clone());
        let set = store.secrets("a").await.unwrap();
        assert_eq!(set.current.expose(), "one");
        assert!(set.previous.is_none());

        std::fs::write(
            &path,
            "[secrets.a]\ncurrent = \"two\"\nprevious = \"one\"\n",
        )
        .unwrap();
        let set = store.secrets("a").await.unwrap();
        assert_eq!(set.current.expose(), "two");
        assert_eq!(set.previous.as_ref().unwrap().expose(), "one");
        assert!(matches!(
            store.secrets("b").await,
            Err(SecretError::NotFound { .. })
        ));

        std::fs::write(&path, "[secrets.a]\ncurrent = \"leaked-if-printed").unwrap();
        let error = store.secrets("a").await.unwrap_err().to_string();
        assert!(!error.contains("leaked-if-printed"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
