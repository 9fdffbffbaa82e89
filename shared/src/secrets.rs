//! Signing secrets: where they come from, how long they are cached, and a type that never
//! prints them.
//!
//! A source's `secret_ref` names a secret. In AWS it is a Secrets Manager secret whose
//! `AWSCURRENT` value is the signing secret; during a rotation its `AWSPREVIOUS` value is
//! accepted too, so rotating is one `put-secret-value` and no redeploy. Values are cached in the
//! warm process for a TTL, so a rotation is picked up within that TTL without a restart.

use std::collections::HashMap;
use std::fmt;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_secretsmanager::error::SdkError;
use aws_sdk_secretsmanager::operation::get_secret_value::GetSecretValueError;
use aws_secretsmanager_caching::SecretsManagerCachingClient;
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use crate::domain::SecretVersion;

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
    /// AWS Secrets Manager through AWS's caching client.
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
            SecretStore::Aws(aws) => Box::pin(aws.secrets(secret_ref)).await.map(Arc::new),
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

/// Secrets Manager behind `aws_secretsmanager_caching`, AWS's own caching client.
pub struct AwsSecrets {
    client: SecretsManagerCachingClient,
    ttl: Duration,
    /// Secrets known to have no `AWSPREVIOUS` version, until when. Without this, every
    /// delivery to a never-rotated secret would cost a Secrets Manager call.
    no_previous_until: Mutex<HashMap<String, Instant>>,
}

const CURRENT_STAGE: &str = "AWSCURRENT";
const PREVIOUS_STAGE: &str = "AWSPREVIOUS";

impl AwsSecrets {
    pub async fn connect(settings: &AwsSecretsSettings) -> Result<Self, SecretError> {
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
        if let Some(endpoint) = &settings.endpoint_url {
            loader = loader.endpoint_url(endpoint);
        }
        if let Some(region) = &settings.region {
            loader = loader.region(aws_config::Region::new(region.clone()));
        }
        let sdk_config = loader.load().await;
        let builder = aws_sdk_secretsmanager::config::Builder::from(&sdk_config);
        let client = SecretsManagerCachingClient::from_builder(
            builder,
            NonZeroUsize::new(1000).expect("non-zero"),
            settings.ttl,
            // Serve the cached value when a refresh fails transiently: a Secrets Manager
            // hiccup must not turn into 503s for deliveries we could verify.
            true,
        )
        .await
        .map_err(|e| SecretError::Unavailable {
            secret_ref: String::new(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            client,
            ttl: settings.ttl,
            no_previous_until: Mutex::new(HashMap::new()),
        })
    }

    async fn secrets(&self, secret_ref: &str) -> Result<SecretSet, SecretError> {
        let current = self
            .stage(secret_ref, CURRENT_STAGE)
            .await?
            .ok_or_else(|| SecretError::NotFound {
                secret_ref: secret_ref.to_owned(),
            })?;
        let previous = if self.known_without_previous(secret_ref) {
            None
        } else {
            match self.stage(secret_ref, PREVIOUS_STAGE).await {
                Ok(Some(previous)) => Some(previous),
                Ok(None) => {
                    self.remember_without_previous(secret_ref);
                    None
                }
                Err(error) => {
                    // The current secret still verifies; do not fail the delivery for this.
                    tracing::warn!(%error, "could not read the previous secret version");
                    None
                }
            }
        };
        Ok(SecretSet {
            current: SigningSecret::new(current),
            previous: previous.map(SigningSecret::new),
        })
    }

    /// The string value of one stage of a secret; `None` when that stage does not exist.
    async fn stage(&self, secret_ref: &str, stage: &str) -> Result<Option<String>, SecretError> {
        let output = self
            .client
            .get_secret_value(secret_ref, None, Some(stage), false)
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
                    .downcast_ref::<SdkError<GetSecretValueError>>()
                    .and_then(SdkError::as_service_error)
                    .is_some_and(GetSecretValueError::is_resource_not_found_exception);
                if not_found {
                    Ok(None)
                } else {
                    Err(SecretError::Unavailable {
                        secret_ref: secret_ref.to_owned(),
                        reason: error.to_string(),
                    })
                }
            }
        }
    }

    fn known_without_previous(&self, secret_ref: &str) -> bool {
        let map = self.no_previous_until.lock().expect("lock poisoned");
        map.get(secret_ref)
            .is_some_and(|until| Instant::now() < *until)
    }

    fn remember_without_previous(&self, secret_ref: &str) {
        let mut map = self.no_previous_until.lock().expect("lock poisoned");
        map.retain(|_, until| Instant::now() < *until);
        map.insert(secret_ref.to_owned(), Instant::now() + self.ttl);
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
