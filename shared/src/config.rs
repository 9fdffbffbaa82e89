//! Settings, read once at cold start into typed values with named defaults. An invalid
//! setting fails the start with a message naming the variable.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use sqlx::postgres::PgConnectOptions;

use crate::secrets::AwsSecretsSettings;
use crate::store::PoolSettings;

pub const DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;
pub const DEFAULT_SECRET_CACHE_TTL: Duration = Duration::from_secs(60);
pub const DEFAULT_SOURCE_CACHE_TTL: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{var} is not set{hint}")]
    Missing {
        var: &'static str,
        hint: &'static str,
    },
    #[error("{var}: {reason}")]
    Invalid { var: &'static str, reason: String },
    #[error("database credentials from Secrets Manager secret {secret_id:?}: {reason}")]
    DatabaseSecret { secret_id: String, reason: String },
}

/// Where the database is.
pub enum DatabaseLocation {
    /// `DATABASE_URL`, as libpq would take it.
    Url(SecretString),
    /// `DATABASE_SECRET_ID`: a Secrets Manager secret in the format RDS writes
    /// (`{"host","port","username","password","dbname"}`).
    Secret { secret_id: String },
}

pub struct DatabaseSettings {
    pub location: DatabaseLocation,
    /// `DATABASE_HOST`: connect here instead (an RDS Proxy endpoint), with the same credentials.
    pub host_override: Option<String>,
    pub pool: PoolSettings,
}

pub enum SecretsBackend {
    Aws(AwsSecretsSettings),
    File(PathBuf),
}

impl SecretsBackend {
    /// The store these settings describe.
    pub async fn open(&self) -> Result<crate::secrets::SecretStore, ConfigError> {
        Ok(match self {
            SecretsBackend::File(path) => crate::secrets::SecretStore::File(path.clone()),
            SecretsBackend::Aws(aws) => crate::secrets::SecretStore::Aws(
                crate::secrets::AwsSecrets::connect(aws)
                    .await
                    .map_err(|e| ConfigError::Invalid {
                        var: "SECRETS_MANAGER_ENDPOINT",
                        reason: e.to_string(),
                    })?,
            ),
        })
    }
}

/// Everything the ingest function needs.
pub struct IngestSettings {
    pub database: DatabaseSettings,
    pub secrets: SecretsBackend,
    pub max_body_bytes: usize,
    pub source_cache_ttl: Duration,
}

/// Reads variables through a lookup function, so tests need not touch the process environment.
pub struct Vars<F: Fn(&str) -> Option<String>>(pub F);

impl Vars<fn(&str) -> Option<String>> {
    pub fn process() -> Self {
        Vars(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
    }
}

impl<F: Fn(&str) -> Option<String>> Vars<F> {
    fn get(&self, var: &'static str) -> Option<String> {
        (self.0)(var)
    }

    fn parsed<T: FromStr>(&self, var: &'static str, default: T) -> Result<T, ConfigError>
    where
        T::Err: std::fmt::Display,
    {
        match self.get(var) {
            None => Ok(default),
            Some(raw) => raw.trim().parse().map_err(|e| ConfigError::Invalid {
                var,
                reason: format!("{raw:?}: {e}"),
            }),
        }
    }

    fn seconds(&self, var: &'static str, default: Duration) -> Result<Duration, ConfigError> {
        self.parsed(var, default.as_secs()).map(Duration::from_secs)
    }

    pub fn database(&self) -> Result<DatabaseSettings, ConfigError> {
        let location = match (self.get("DATABASE_URL"), self.get("DATABASE_SECRET_ID")) {
            (Some(url), _) => DatabaseLocation::Url(SecretString::from(url)),
            (None, Some(secret_id)) => DatabaseLocation::Secret { secret_id },
            (None, None) => {
                return Err(ConfigError::Missing {
                    var: "DATABASE_URL",
                    hint: " (nor DATABASE_SECRET_ID, a Secrets Manager secret with the credentials)",
                });
            }
        };
        let defaults = PoolSettings::default();
        let max_connections = self.parsed("DB_MAX_CONNECTIONS", defaults.max_connections)?;
        if max_connections == 0 {
            return Err(ConfigError::Invalid {
                var: "DB_MAX_CONNECTIONS",
                reason: "must be at least 1".into(),
            });
        }
        let acquire_timeout_ms = self.parsed(
            "DB_ACQUIRE_TIMEOUT_MS",
            defaults.acquire_timeout.as_millis() as u64,
        )?;
        Ok(DatabaseSettings {
            location,
            host_override: self.get("DATABASE_HOST"),
            pool: PoolSettings {
                max_connections,
                acquire_timeout: Duration::from_millis(acquire_timeout_ms),
            },
        })
    }

    pub fn aws_secrets(&self) -> Result<AwsSecretsSettings, ConfigError> {
        Ok(AwsSecretsSettings {
            endpoint_url: self.get("SECRETS_MANAGER_ENDPOINT"),
            region: self.get("AWS_REGION"),
            ttl: self.seconds("SECRET_CACHE_TTL_SECONDS", DEFAULT_SECRET_CACHE_TTL)?,
        })
    }

    pub fn secrets_backend(&self) -> Result<SecretsBackend, ConfigError> {
        match self.get("SECRETS_BACKEND").as_deref().unwrap_or("aws") {
            "aws" => Ok(SecretsBackend::Aws(self.aws_secrets()?)),
            "file" => self
                .get("SECRETS_FILE")
                .map(|p| SecretsBackend::File(PathBuf::from(p)))
                .ok_or(ConfigError::Missing {
                    var: "SECRETS_FILE",
                    hint: " (required with SECRETS_BACKEND=file)",
                }),
            other => Err(ConfigError::Invalid {
                var: "SECRETS_BACKEND",
                reason: format!("{other:?} is neither aws nor file"),
            }),
        }
    }

    pub fn ingest(&self) -> Result<IngestSettings, ConfigError> {
        let max_body_bytes = self.parsed("MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES)?;
        if max_body_bytes == 0 {
            return Err(ConfigError::Invalid {
                var: "MAX_BODY_BYTES",
                reason: "must be at least 1".into(),
            });
        }
        Ok(IngestSettings {
            database: self.database()?,
            secrets: self.secrets_backend()?,
            max_body_bytes,
            source_cache_ttl: self.seconds("SOURCE_CACHE_TTL_SECONDS", DEFAULT_SOURCE_CACHE_TTL)?,
        })
    }
}

impl<F: Fn(&str) -> Option<String>> Vars<F> {
    fn millis(&self, var: &'static str, default: Duration) -> Result<Duration, ConfigError> {
        self.parsed(var, default.as_millis() as u64)
            .map(Duration::from_millis)
    }

    /// The database pool for a function, lazily connected.
    pub async fn pool(&self) -> Result<sqlx::PgPool, ConfigError> {
        let database = self.database()?;
        let options = database.connect_options(&self.aws_secrets()?).await?;
        Ok(crate::store::lazy_pool(options, &database.pool))
    }

    /// How close to the Lambda deadline a scheduled function stops starting new batches.
    pub fn deadline_margin(&self) -> Result<Duration, ConfigError> {
        self.millis("DEADLINE_MARGIN_MS", Duration::from_secs(3))
    }

    pub fn drain(&self) -> Result<crate::drain::DrainSettings, ConfigError> {
        let d = crate::drain::DrainSettings::default();
        let settings = crate::drain::DrainSettings {
            batch_size: self.parsed("DRAIN_BATCH_SIZE", d.batch_size)?,
            max_attempts: self.parsed("DRAIN_MAX_ATTEMPTS", d.max_attempts)?,
            backoff_base: self.millis("DRAIN_BACKOFF_BASE_MS", d.backoff_base)?,
            backoff_cap: self.seconds("DRAIN_BACKOFF_CAP_SECONDS", d.backoff_cap)?,
            vacuum_after_rows: self.parsed("DRAIN_VACUUM_AFTER_ROWS", d.vacuum_after_rows)?,
            vacuum_interval: self.seconds("DRAIN_VACUUM_INTERVAL_SECONDS", d.vacuum_interval)?,
        };
        settings.validate().map_err(|reason| ConfigError::Invalid {
            var: "DRAIN_*",
            reason,
        })?;
        Ok(settings)
    }

    pub fn reconcile(&self) -> Result<crate::reconcile::ReconcileSettings, ConfigError> {
        let d = crate::reconcile::ReconcileSettings::default();
        Ok(crate::reconcile::ReconcileSettings {
            pending_sla: self.seconds("RECONCILE_PENDING_SLA_SECONDS", d.pending_sla)?,
            outbox_window: self.seconds("RECONCILE_OUTBOX_WINDOW_SECONDS", d.outbox_window)?,
            untriaged_after: self
                .seconds("RECONCILE_UNTRIAGED_AFTER_SECONDS", d.untriaged_after)?,
            chunk_size: self.parsed("RECONCILE_CHUNK_SIZE", d.chunk_size)?.max(1),
            max_chunks: self.parsed("RECONCILE_MAX_CHUNKS", d.max_chunks)?.max(1),
            drain_for: self.seconds("RECONCILE_DRAIN_SECONDS", d.drain_for)?,
        })
    }

    pub fn anomaly(&self) -> Result<crate::anomaly::AnomalySettings, ConfigError> {
        let d = crate::anomaly::AnomalySettings::default();
        Ok(crate::anomaly::AnomalySettings {
            silence_min_baseline: self
                .parsed("ANOMALY_SILENCE_MIN_BASELINE", d.silence_min_baseline)?,
            min_weeks: self.parsed("ANOMALY_MIN_WEEKS", d.min_weeks)?,
            ..d
        })
    }

    pub fn backfill(&self) -> Result<crate::backfill::BackfillSettings, ConfigError> {
        let d = crate::backfill::BackfillSettings::default();
        Ok(crate::backfill::BackfillSettings {
            fetch_limit: self.parsed("BACKFILL_FETCH_LIMIT", d.fetch_limit)?.max(1),
            max_list_pages: self
                .parsed("BACKFILL_MAX_LIST_PAGES", d.max_list_pages)?
                .max(1),
            request_timeout: self.millis("BACKFILL_TIMEOUT_MS", d.request_timeout)?,
            max_windows: self.parsed("BACKFILL_MAX_WINDOWS", d.max_windows)?.max(1),
        })
    }

    pub fn retention(&self) -> Result<crate::retention::RetentionSettings, ConfigError> {
        let d = crate::retention::RetentionSettings::default();
        let s = crate::retention::RetentionSettings {
            payload_after: self.seconds("RETENTION_PAYLOAD_SECONDS", d.payload_after)?,
            identity_after: self.seconds("RETENTION_IDENTITY_SECONDS", d.identity_after)?,
            history_after: self.seconds("RETENTION_HISTORY_SECONDS", d.history_after)?,
            batch_size: self.parsed("RETENTION_BATCH_SIZE", d.batch_size)?,
            max_batches: self.parsed("RETENTION_MAX_BATCHES", d.max_batches)?,
        };
        s.validate().map_err(|reason| ConfigError::Invalid {
            var: "RETENTION_*",
            reason,
        })?;
        Ok(s)
    }

    /// The secret store the settings describe (Secrets Manager, or a file locally).
    pub async fn secret_store(&self) -> Result<crate::secrets::SecretStore, ConfigError> {
        self.secrets_backend()?.open().await
    }

    pub fn outbox(&self) -> Result<crate::outbox::OutboxSettings, ConfigError> {
        let target = self.get("OUTBOX_TARGET_URL").ok_or(ConfigError::Missing {
            var: "OUTBOX_TARGET_URL",
            hint: " (where outbox messages are POSTed)",
        })?;
        if !(target.starts_with("https://") || target.starts_with("http://")) {
            return Err(ConfigError::Invalid {
                var: "OUTBOX_TARGET_URL",
                reason: format!("{target:?} is not an http(s) URL"),
            });
        }
        let d = crate::outbox::OutboxSettings::new(target);
        let settings = crate::outbox::OutboxSettings {
            batch_size: self.parsed("OUTBOX_BATCH_SIZE", d.batch_size)?,
            max_attempts: self.parsed("OUTBOX_MAX_ATTEMPTS", d.max_attempts)?,
            request_timeout: self.millis("OUTBOX_TIMEOUT_MS", d.request_timeout)?,
            ..d
        };
        settings.validate().map_err(|reason| ConfigError::Invalid {
            var: "OUTBOX_*",
            reason,
        })?;
        Ok(settings)
    }
}

/// The credentials secret RDS writes for a database.
#[derive(Deserialize)]
struct RdsSecret {
    host: String,
    port: Option<u16>,
    username: String,
    password: String,
    dbname: Option<String>,
}

impl DatabaseSettings {
    /// Connection options; for a Secrets Manager location this fetches the secret once.
    pub async fn connect_options(
        &self,
        aws: &AwsSecretsSettings,
    ) -> Result<PgConnectOptions, ConfigError> {
        let options = self.located_options(aws).await?;
        Ok(match &self.host_override {
            Some(host) => options.host(host),
            None => options,
        })
    }

    async fn located_options(
        &self,
        aws: &AwsSecretsSettings,
    ) -> Result<PgConnectOptions, ConfigError> {
        match &self.location {
            DatabaseLocation::Url(url) => {
                PgConnectOptions::from_str(url.expose_secret()).map_err(|e| ConfigError::Invalid {
                    var: "DATABASE_URL",
                    reason: e.to_string(),
                })
            }
            DatabaseLocation::Secret { secret_id } => {
                let failed = |reason: String| ConfigError::DatabaseSecret {
                    secret_id: secret_id.clone(),
                    reason,
                };
                let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
                if let Some(endpoint) = &aws.endpoint_url {
                    loader = loader.endpoint_url(endpoint);
                }
                let client = aws_sdk_secretsmanager::Client::new(&loader.load().await);
                let output = client
                    .get_secret_value()
                    .secret_id(secret_id)
                    .send()
                    .await
                    .map_err(|e| {
                        failed(aws_sdk_secretsmanager::error::DisplayErrorContext(e).to_string())
                    })?;
                let text = output
                    .secret_string()
                    .ok_or_else(|| failed("no string value".into()))?;
                let secret: RdsSecret = serde_json::from_str(text).map_err(|_| {
                    failed(
                        "not the JSON RDS writes (host, port, username, password, dbname)".into(),
                    )
                })?;
                let mut options = PgConnectOptions::new()
                    .host(&secret.host)
                    .port(secret.port.unwrap_or(5432))
                    .username(&secret.username)
                    .password(&secret.password);
                if let Some(dbname) = &secret.dbname {
                    options = options.database(dbname);
                }
                Ok(options)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> Vars<impl Fn(&str) -> Option<String>> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Vars(move |k: &str| map.get(k).cloned())
    }

    #[test]
    fn defaults_apply_when_only_the_database_is_set() {
        let s = vars(&[("DATABASE_URL", "postgres://localhost/x")])
            .ingest()
            .unwrap();
        assert_eq!(s.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
        assert_eq!(s.source_cache_ttl, DEFAULT_SOURCE_CACHE_TTL);
        assert_eq!(s.database.pool.max_connections, 2);
        assert!(
            matches!(s.secrets, SecretsBackend::Aws(ref a) if a.ttl == DEFAULT_SECRET_CACHE_TTL)
        );
    }

    #[test]
    fn drain_and_outbox_settings_read_and_validate() {
        let v = vars(&[
            ("DRAIN_BATCH_SIZE", "50"),
            ("DRAIN_BACKOFF_BASE_MS", "250"),
            ("OUTBOX_TARGET_URL", "https://x.example/hook"),
        ]);
        let drain = v.drain().unwrap();
        assert_eq!(
            (drain.batch_size, drain.backoff_base),
            (50, Duration::from_millis(250))
        );
        assert_eq!(v.outbox().unwrap().target_url, "https://x.example/hook");
        assert!(vars(&[("DRAIN_BATCH_SIZE", "0")]).drain().is_err());
        assert!(vars(&[("OUTBOX_TARGET_URL", "ftp://x")]).outbox().is_err());
        let url = ("OUTBOX_TARGET_URL", "https://x.example/hook");
        assert!(vars(&[url, ("OUTBOX_BATCH_SIZE", "0")]).outbox().is_err());
        assert!(vars(&[url, ("OUTBOX_MAX_ATTEMPTS", "0")]).outbox().is_err());
        let outbox = vars(&[
            url,
            ("OUTBOX_BATCH_SIZE", "10"),
            ("OUTBOX_TIMEOUT_MS", "2000"),
        ])
        .outbox()
        .unwrap();
        // The lease outlasts a batch whose every delivery times out.
        assert_eq!(outbox.lease(), Duration::from_secs(22));
        assert!(
            vars(&[])
                .outbox()
                .err()
                .unwrap()
                .to_string()
                .starts_with("OUTBOX_TARGET_URL is not set")
        );
    }

    #[test]
    fn errors_name_the_variable() {
        let err = vars(&[]).ingest().err().unwrap().to_string();
        assert!(err.starts_with("DATABASE_URL is not set"), "{err}");
        let err = vars(&[("DATABASE_URL", "x"), ("MAX_BODY_BYTES", "lots")])
            .ingest()
            .err()
            .unwrap()
            .to_string();
        assert!(err.starts_with("MAX_BODY_BYTES: \"lots\""), "{err}");
        let err = vars(&[("DATABASE_URL", "x"), ("SECRETS_BACKEND", "file")])
            .ingest()
            .err()
            .unwrap()
            .to_string();
        assert!(err.starts_with("SECRETS_FILE is not set"), "{err}");
    }
}
