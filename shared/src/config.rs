//! Settings, read once at cold start into typed values with named defaults. An invalid
//! setting fails the start with a message naming the variable.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use sqlx::postgres::{PgConnectOptions, PgSslMode};

use crate::secrets::AwsSecretsSettings;
use crate::store::{PoolSettings, SessionTimeouts};

pub const DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;
pub const DEFAULT_SECRET_CACHE_TTL: Duration = Duration::from_secs(60);
pub const DEFAULT_SOURCE_CACHE_TTL: Duration = Duration::from_secs(30);
pub use crate::stale::DEFAULT_STALE_IF_ERROR;
/// How long a migration waits for a lock before it gives up (`MIGRATE_LOCK_TIMEOUT_MS`). Short:
/// an `ALTER TABLE` queued behind a long transaction would queue every ingest behind itself.
pub const DEFAULT_MIGRATE_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

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
    /// Secrets Manager could not be asked (unreachable, throttled, slow): may pass.
    #[error("database credentials from Secrets Manager secret {secret_id:?} unavailable: {reason}")]
    DatabaseSecretUnavailable { secret_id: String, reason: String },
}

impl ConfigError {
    /// The settings may be right: only the secret store could not answer now.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, ConfigError::DatabaseSecretUnavailable { .. })
    }
}

/// How long a read of the database secret may take before it counts as unavailable: well
/// inside the shortest function's timeout (ingest, 10 s), where it is read per request while
/// it cannot be read.
pub const DATABASE_SECRET_READ_TIMEOUT: Duration = Duration::from_secs(3);

/// Where the database is.
#[derive(Clone)]
pub enum DatabaseLocation {
    /// `DATABASE_URL`, as libpq would take it.
    Url(SecretString),
    /// `DATABASE_SECRET_ID`: a Secrets Manager secret with the credentials, in either shape RDS
    /// writes: `{"username","password"}` (the master-user secret RDS manages itself,
    /// `ManageMasterUserPassword`; the host, port and database then come from `DATABASE_HOST`,
    /// `DATABASE_PORT`, `DATABASE_NAME`), or `{"host","port","username","password","dbname"}`.
    Secret { secret_id: String },
}

#[derive(Clone)]
pub struct DatabaseSettings {
    pub location: DatabaseLocation,
    /// `DATABASE_HOST`: connect here instead of the secret's (or URL's) host: an RDS Proxy
    /// endpoint, or the instance's endpoint for a secret that names no host.
    pub host_override: Option<String>,
    /// `DATABASE_PORT`: this port instead of the secret's (or URL's); 5432 when none says.
    pub port_override: Option<u16>,
    /// `DATABASE_NAME`: this database instead of the secret's `dbname` (or the URL's); when
    /// none says, the server's default (the database named after the user).
    pub name_override: Option<String>,
    pub tls: DatabaseTls,
    pub pool: PoolSettings,
    /// From `FUNCTION_TIMEOUT_SECONDS`, the function's own Lambda timeout: the server-side
    /// limits of every session (see [`SessionTimeouts`]). Unset (the CLI, the local runner):
    /// the server's defaults.
    pub session: Option<SessionTimeouts>,
}

/// How the connection is secured, in libpq's terms. A `sslmode` or `sslrootcert` on
/// `DATABASE_URL` wins over these settings.
#[derive(Debug, Clone, Default)]
pub struct DatabaseTls {
    /// `DATABASE_SSLMODE`. Unset: `verify-full`, except `prefer` (libpq's default) for a
    /// loopback host or a Unix socket, where there is no network to protect.
    pub mode: Option<PgSslMode>,
    /// `DATABASE_SSLROOTCERT`: a PEM bundle trusted besides the public roots; the RDS CA bundle
    /// for a direct RDS connection (RDS Proxy needs none: its certificates chain to public
    /// roots).
    pub root_cert: Option<PathBuf>,
}

pub enum SecretsBackend {
    Aws(AwsSecretsSettings),
    File(PathBuf),
}

impl SecretsBackend {
    /// The store these settings describe (Secrets Manager's snapshots served stale for at most
    /// [`DEFAULT_STALE_IF_ERROR`] when it cannot answer).
    pub async fn open(&self) -> crate::secrets::SecretStore {
        self.open_with_stale_if_error(DEFAULT_STALE_IF_ERROR).await
    }

    /// As [`SecretsBackend::open`], a snapshot served past its TTL for at most `stale_if_error`
    /// while Secrets Manager cannot answer. A secrets file is re-read on every lookup: nothing
    /// is cached to serve.
    pub async fn open_with_stale_if_error(
        &self,
        stale_if_error: Duration,
    ) -> crate::secrets::SecretStore {
        match self {
            SecretsBackend::File(path) => crate::secrets::SecretStore::File(path.clone()),
            SecretsBackend::Aws(aws) => crate::secrets::SecretStore::Aws(
                crate::secrets::AwsSecrets::connect(aws)
                    .await
                    .with_stale_if_error(stale_if_error),
            ),
        }
    }
}

/// Everything the ingest function needs.
pub struct IngestSettings {
    pub database: DatabaseSettings,
    pub secrets: SecretsBackend,
    pub max_body_bytes: usize,
    pub source_cache_ttl: Duration,
    /// Where a delivery goes when PostgreSQL cannot take it (or, in `queue` mode, always).
    pub buffer: BufferSettings,
    /// `STALE_IF_ERROR_SECONDS`: how long past its TTL a source or secret is served while the
    /// database or Secrets Manager cannot answer; 0: never.
    pub stale_if_error: Duration,
}

/// How long the direct path may try before a delivery spills to the buffer
/// (`SPILLOVER_AFTER_MS`): well inside the providers' own timeouts (Slack's 3 s, GitHub's 10 s)
/// and the ingest function's, so the send to SQS has time left.
pub const DEFAULT_SPILLOVER_AFTER: Duration = Duration::from_millis(2000);

/// The second buffer's mode and queue.
#[derive(Debug, Clone)]
pub struct BufferSettings {
    pub mode: crate::buffer::BufferMode,
    /// `None` exactly when the mode is `database`.
    pub queue: Option<crate::buffer::QueueSettings>,
    pub spill_after: Duration,
    /// `SPILLOVER_HOLD_MS`: after the database failed a delivery, the next ones go straight to
    /// the buffer for this long, instead of each waiting `spill_after` first.
    pub spill_hold: Duration,
}

/// [`BufferSettings::spill_hold`]'s default: one probe of the database a second during an
/// outage.
pub const DEFAULT_SPILLOVER_HOLD: Duration = Duration::from_millis(1000);

impl BufferSettings {
    /// Today's path only: no buffer.
    pub fn database_only() -> Self {
        Self {
            mode: crate::buffer::BufferMode::Database,
            queue: None,
            spill_after: DEFAULT_SPILLOVER_AFTER,
            spill_hold: DEFAULT_SPILLOVER_HOLD,
        }
    }
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
        let mode = match self.get("DATABASE_SSLMODE") {
            None => None,
            Some(raw) => Some(parse_ssl_mode(&raw).map_err(|reason| ConfigError::Invalid {
                var: "DATABASE_SSLMODE",
                reason,
            })?),
        };
        let root_cert = match self.get("DATABASE_SSLROOTCERT") {
            None => None,
            Some(path) => Some(existing_file(&path).map_err(|reason| ConfigError::Invalid {
                var: "DATABASE_SSLROOTCERT",
                reason,
            })?),
        };
        let port_override = match self.get("DATABASE_PORT") {
            None => None,
            Some(_) => Some(self.parsed("DATABASE_PORT", 5432u16)?),
        };
        let session = match self.get("FUNCTION_TIMEOUT_SECONDS") {
            None => None,
            Some(_) => {
                let timeout = self.seconds("FUNCTION_TIMEOUT_SECONDS", Duration::ZERO)?;
                if timeout.is_zero() {
                    return Err(ConfigError::Invalid {
                        var: "FUNCTION_TIMEOUT_SECONDS",
                        reason: "must be at least 1 (the function's Lambda timeout)".into(),
                    });
                }
                Some(SessionTimeouts::below(timeout))
            }
        };
        Ok(DatabaseSettings {
            location,
            host_override: self.get("DATABASE_HOST"),
            port_override,
            name_override: self.get("DATABASE_NAME"),
            tls: DatabaseTls { mode, root_cert },
            pool: PoolSettings {
                max_connections,
                acquire_timeout: Duration::from_millis(acquire_timeout_ms),
            },
            session,
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
            buffer: self.buffer()?,
            stale_if_error: self.seconds("STALE_IF_ERROR_SECONDS", DEFAULT_STALE_IF_ERROR)?,
        })
    }

    /// `BUFFER_MODE` (`database`, `spillover`, `queue`; unset: `spillover` when a queue is
    /// configured, else `database`) with its queue and `SPILLOVER_AFTER_MS`.
    pub fn buffer(&self) -> Result<BufferSettings, ConfigError> {
        use crate::buffer::BufferMode;
        let queue = self.buffer_queue()?;
        let mode = match self.get("BUFFER_MODE") {
            Some(raw) => raw.trim().parse().map_err(|reason| ConfigError::Invalid {
                var: "BUFFER_MODE",
                reason,
            })?,
            None if queue.is_some() => BufferMode::Spillover,
            None => BufferMode::Database,
        };
        if mode != BufferMode::Database && queue.is_none() {
            return Err(ConfigError::Missing {
                var: "BUFFER_QUEUE_URL",
                hint: " (BUFFER_MODE spillover and queue send to it; BUFFER_MODE=database buffers nothing)",
            });
        }
        let spill_after = self.millis("SPILLOVER_AFTER_MS", DEFAULT_SPILLOVER_AFTER)?;
        if spill_after.is_zero() {
            return Err(ConfigError::Invalid {
                var: "SPILLOVER_AFTER_MS",
                reason: "must be at least 1".into(),
            });
        }
        Ok(BufferSettings {
            queue: if mode == BufferMode::Database {
                None
            } else {
                queue
            },
            mode,
            spill_after,
            spill_hold: self.millis("SPILLOVER_HOLD_MS", DEFAULT_SPILLOVER_HOLD)?,
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
        self.database()?.pool(&self.aws_secrets()?).await
    }

    /// `MIGRATE_LOCK_TIMEOUT_MS`: how long a migration waits for any one lock.
    pub fn migrate_lock_timeout(&self) -> Result<Duration, ConfigError> {
        let timeout = self.millis("MIGRATE_LOCK_TIMEOUT_MS", DEFAULT_MIGRATE_LOCK_TIMEOUT)?;
        if timeout.is_zero() {
            return Err(ConfigError::Invalid {
                var: "MIGRATE_LOCK_TIMEOUT_MS",
                reason: "must be at least 1 (0 would wait forever)".into(),
            });
        }
        Ok(timeout)
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
            idle_poll: self.millis("DRAIN_IDLE_POLL_MS", d.idle_poll)?,
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
            sweep_window_events: self
                .parsed("ANOMALY_SWEEP_WINDOW_EVENTS", d.sweep_window_events)?
                .max(1),
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
            buffer_hold: self.seconds("BUFFER_GAP_HOLD_SECONDS", d.buffer_hold)?,
        })
    }

    /// `ADDRESS_RANGES_*`: the ranges pass (`crate::address_ranges`), run by the backfill
    /// function and `hookctl providers ranges refresh`.
    pub fn address_ranges(&self) -> Result<crate::address_ranges::RangesSettings, ConfigError> {
        let d = crate::address_ranges::RangesSettings::default();
        let urls = match self.get("ADDRESS_RANGES_URLS") {
            None => d.urls.clone(),
            Some(raw) => {
                crate::address_ranges::RangesSettings::parse_urls(&raw).map_err(|reason| {
                    ConfigError::Invalid {
                        var: "ADDRESS_RANGES_URLS",
                        reason,
                    }
                })?
            }
        };
        Ok(crate::address_ranges::RangesSettings {
            refresh_after: self.seconds("ADDRESS_RANGES_REFRESH_SECONDS", d.refresh_after)?,
            request_timeout: self.millis("ADDRESS_RANGES_TIMEOUT_MS", d.request_timeout)?,
            urls,
        })
    }

    /// `RETENTION_*`. `RETENTION_MAX_BATCHES` is no longer read: it capped a run at that many
    /// batches of each purge, and a run now purges until nothing is past its horizons or its
    /// time is up. A deployment that still sets it is warned, not stopped: refusing it would
    /// stop retention altogether on upgrade, the one thing the cap was there to prevent.
    pub fn retention(&self) -> Result<crate::retention::RetentionSettings, ConfigError> {
        if self.get("RETENTION_MAX_BATCHES").is_some() {
            tracing::warn!(
                var = "RETENTION_MAX_BATCHES",
                "is no longer read and is ignored: a retention run purges until nothing is past \
                 its horizons or it is DEADLINE_MARGIN_MS from its timeout; unset it"
            );
        }
        let d = crate::retention::RetentionSettings::default();
        let s = crate::retention::RetentionSettings {
            payload_after: self.seconds("RETENTION_PAYLOAD_SECONDS", d.payload_after)?,
            identity_after: self.seconds("RETENTION_IDENTITY_SECONDS", d.identity_after)?,
            history_after: self.seconds("RETENTION_HISTORY_SECONDS", d.history_after)?,
            replay_after: self.seconds("RETENTION_REPLAY_SECONDS", d.replay_after)?,
            batch_size: self.parsed("RETENTION_BATCH_SIZE", d.batch_size)?,
        };
        s.validate().map_err(|reason| ConfigError::Invalid {
            var: "RETENTION_*",
            reason,
        })?;
        Ok(s)
    }

    /// Where the buffer is (`BUFFER_QUEUE_URL`, `BUFFER_DEAD_LETTER_QUEUE_URL`, `SQS_ENDPOINT`,
    /// `CLOUDWATCH_ENDPOINT`, `AWS_REGION`); `None` when no buffer queue is configured. A dead-letter queue without
    /// the buffer queue is an error: the redrive would have nowhere to send.
    pub fn buffer_queue(&self) -> Result<Option<crate::buffer::QueueSettings>, ConfigError> {
        let url = |var: &'static str| -> Result<Option<String>, ConfigError> {
            match self.get(var) {
                None => Ok(None),
                Some(u) if u.starts_with("https://") || u.starts_with("http://") => Ok(Some(u)),
                Some(u) => Err(ConfigError::Invalid {
                    var,
                    reason: format!(
                        "{u:?} is not an SQS queue URL (https://sqs.<region>.amazonaws.com/<account>/<name>)"
                    ),
                }),
            }
        };
        let queue_url = url("BUFFER_QUEUE_URL")?;
        let dead_letter_queue_url = url("BUFFER_DEAD_LETTER_QUEUE_URL")?;
        let endpoint_url = url("SQS_ENDPOINT")?;
        let metrics_endpoint_url = url("CLOUDWATCH_ENDPOINT")?;
        match (queue_url, dead_letter_queue_url) {
            (None, None) => Ok(None),
            (None, Some(_)) => Err(ConfigError::Missing {
                var: "BUFFER_QUEUE_URL",
                hint: " (BUFFER_DEAD_LETTER_QUEUE_URL is set: a redrive sends back to the buffer queue)",
            }),
            (Some(queue_url), dead_letter_queue_url) => Ok(Some(crate::buffer::QueueSettings {
                queue_url,
                dead_letter_queue_url,
                endpoint: crate::aws::AwsEndpoint {
                    endpoint_url,
                    region: self.get("AWS_REGION"),
                },
                metrics_endpoint_url,
            })),
        }
    }

    /// The secret store the settings describe (Secrets Manager, or a file locally).
    pub async fn secret_store(&self) -> Result<crate::secrets::SecretStore, ConfigError> {
        Ok(self.secrets_backend()?.open().await)
    }

    /// Where the outbox's AWS destinations are: `EVENTBRIDGE_ENDPOINT`, `SQS_ENDPOINT` and
    /// `SNS_ENDPOINT` override AWS's (moto locally and in tests, VPC endpoints in production).
    pub fn outbox_endpoints(&self) -> crate::outbox::destinations::AwsDestinationEndpoints {
        let endpoint = |var: &'static str| crate::aws::AwsEndpoint {
            endpoint_url: self.get(var),
            region: self.get("AWS_REGION"),
        };
        crate::outbox::destinations::AwsDestinationEndpoints {
            eventbridge: endpoint("EVENTBRIDGE_ENDPOINT"),
            sqs: endpoint("SQS_ENDPOINT"),
            sns: endpoint("SNS_ENDPOINT"),
        }
    }

    pub fn outbox(&self) -> Result<crate::outbox::OutboxSettings, ConfigError> {
        let target = self.get("OUTBOX_TARGET_URL").ok_or(ConfigError::Missing {
            var: "OUTBOX_TARGET_URL",
            hint: " (where outbox messages no route covers are POSTed, or `none`: routes only)",
        })?;
        let d = if target == "none" {
            crate::outbox::OutboxSettings::routed()
        } else if target.starts_with("https://") || target.starts_with("http://") {
            crate::outbox::OutboxSettings::new(target)
        } else {
            return Err(ConfigError::Invalid {
                var: "OUTBOX_TARGET_URL",
                reason: format!("{target:?} is not an http(s) URL (nor `none`)"),
            });
        };
        let settings = crate::outbox::OutboxSettings {
            endpoints: self.outbox_endpoints(),
            batch_size: self.parsed("OUTBOX_BATCH_SIZE", d.batch_size)?,
            max_attempts: self.parsed("OUTBOX_MAX_ATTEMPTS", d.max_attempts)?,
            request_timeout: self.millis("OUTBOX_TIMEOUT_MS", d.request_timeout)?,
            http_concurrency: self.parsed("OUTBOX_CONCURRENCY", d.http_concurrency)?,
            workers: self.parsed("OUTBOX_WORKERS", d.workers)?,
            idle_poll: self.millis("OUTBOX_IDLE_POLL_MS", d.idle_poll)?,
            ..d
        };
        settings.validate().map_err(|reason| ConfigError::Invalid {
            var: "OUTBOX_*",
            reason,
        })?;
        Ok(settings)
    }
}

/// A credentials secret RDS writes: the master-user secret it manages holds only `username`
/// and `password`; the secret of the "credentials for an RDS database" type adds `host`,
/// `port` and `dbname` (and `engine`, ignored here).
#[derive(Deserialize)]
struct RdsSecret {
    host: Option<String>,
    #[serde(default)]
    port: Option<SecretPort>,
    username: String,
    password: String,
    dbname: Option<String>,
}

/// A port as a number, or as the string some hand-written secrets hold.
#[derive(Deserialize)]
#[serde(untagged)]
enum SecretPort {
    Number(u16),
    Text(String),
}

impl SecretPort {
    fn value(&self) -> Option<u16> {
        match self {
            SecretPort::Number(n) => Some(*n),
            SecretPort::Text(t) => t.trim().parse().ok(),
        }
    }
}

impl DatabaseSettings {
    /// Connection options; for a Secrets Manager location this fetches the secret once.
    pub async fn connect_options(
        &self,
        aws: &AwsSecretsSettings,
    ) -> Result<PgConnectOptions, ConfigError> {
        // Boxed: keeps the AWS SDK's deep future out of every caller's future (the compiler's
        // layout query depth has been hit by the functions' `main` in release builds).
        let (mut options, explicit) = Box::pin(self.located_options(aws)).await?;
        if let Some(host) = &self.host_override {
            options = options.host(host);
        }
        if let Some(port) = self.port_override {
            options = options.port(port);
        }
        if let Some(name) = &self.name_override {
            options = options.database(name);
        }
        if let Some(session) = &self.session {
            options = session.apply(options);
        }
        Ok(self.secured(options, explicit))
    }

    /// The pool for these settings, lazily connected.
    pub async fn pool(&self, aws: &AwsSecretsSettings) -> Result<sqlx::PgPool, ConfigError> {
        let options = self.connect_options(aws).await?;
        Ok(crate::store::lazy_pool(options, &self.pool))
    }

    /// Applies the TLS settings where the URL said nothing, and says so when the server will
    /// not be verified: never a silent fallback. Only a `DATABASE_URL` to a loopback host or a
    /// socket defaults to `prefer`; a database located by a secret is always verified unless
    /// `DATABASE_SSLMODE` says otherwise.
    fn secured(&self, mut options: PgConnectOptions, explicit: UrlTls) -> PgConnectOptions {
        let local = options.get_socket().is_some() || is_loopback(options.get_host());
        let url = matches!(self.location, DatabaseLocation::Url(_));
        let mode = explicit.mode.or(self.tls.mode).unwrap_or(if local && url {
            PgSslMode::Prefer
        } else {
            PgSslMode::VerifyFull
        });
        if !explicit.root_cert
            && let Some(path) = &self.tls.root_cert
        {
            options = options.ssl_root_cert(path);
        }
        if !local && !matches!(mode, PgSslMode::VerifyFull) {
            tracing::warn!(
                sslmode = ssl_mode_name(&mode),
                host = options.get_host(),
                "the database connection does not verify the server's certificate and host name"
            );
        }
        options.ssl_mode(mode)
    }

    async fn located_options(
        &self,
        aws: &AwsSecretsSettings,
    ) -> Result<(PgConnectOptions, UrlTls), ConfigError> {
        match &self.location {
            DatabaseLocation::Url(url) => {
                let invalid = |reason: String| ConfigError::Invalid {
                    var: "DATABASE_URL",
                    reason,
                };
                let (url, explicit) = url_tls(url.expose_secret()).map_err(invalid)?;
                let options =
                    PgConnectOptions::from_str(&url).map_err(|e| invalid(e.to_string()))?;
                Ok((options, explicit))
            }
            DatabaseLocation::Secret { secret_id } => {
                let failed = |reason: String| ConfigError::DatabaseSecret {
                    secret_id: secret_id.clone(),
                    reason,
                };
                let unavailable = |reason: String| ConfigError::DatabaseSecretUnavailable {
                    secret_id: secret_id.clone(),
                    reason,
                };
                let read = async {
                    let sdk_config = crate::aws::sdk_config(&aws.endpoint()).await;
                    let client = aws_sdk_secretsmanager::Client::new(&sdk_config);
                    client.get_secret_value().secret_id(secret_id).send().await
                };
                let output = match tokio::time::timeout(DATABASE_SECRET_READ_TIMEOUT, read).await {
                    Err(_) => {
                        return Err(unavailable(format!(
                            "no answer within {DATABASE_SECRET_READ_TIMEOUT:?}"
                        )));
                    }
                    Ok(Err(e)) => {
                        let misconfigured = e.as_service_error().is_some_and(|s| {
                            s.is_resource_not_found_exception()
                                || s.is_decryption_failure()
                                || s.is_invalid_parameter_exception()
                                || s.is_invalid_request_exception()
                        });
                        let reason =
                            aws_sdk_secretsmanager::error::DisplayErrorContext(e).to_string();
                        return Err(if misconfigured {
                            failed(reason)
                        } else {
                            unavailable(reason)
                        });
                    }
                    Ok(Ok(output)) => output,
                };
                let text = output
                    .secret_string()
                    .ok_or_else(|| failed("no string value".into()))?;
                // The parse error may quote the secret: never reported.
                let secret: RdsSecret = serde_json::from_str(text).map_err(|_| {
                    failed(
                        "not the JSON RDS writes: it needs username and password (and host, \
                         port, dbname unless DATABASE_HOST, DATABASE_PORT, DATABASE_NAME say \
                         where the database is)"
                            .into(),
                    )
                })?;
                let host = match (&self.host_override, &secret.host) {
                    (Some(host), _) | (None, Some(host)) => host,
                    (None, None) => {
                        return Err(failed(
                            "it names no host (RDS's managed master-user secret never does): set \
                             DATABASE_HOST, the stack's DatabaseHost parameter, to the instance's \
                             endpoint (or DatabaseProxyEndpoint to an RDS Proxy)"
                                .into(),
                        ));
                    }
                };
                let port = match &secret.port {
                    None => 5432,
                    Some(port) => port
                        .value()
                        .ok_or_else(|| failed("its port is not a port".into()))?,
                };
                let mut options = PgConnectOptions::new_without_pgpass()
                    .host(host)
                    .port(port)
                    .username(&secret.username)
                    .password(&secret.password);
                if let Some(dbname) = &secret.dbname {
                    options = options.database(dbname);
                }
                Ok((options, UrlTls::default()))
            }
        }
    }
}

/// What `DATABASE_URL` itself says about TLS.
#[derive(Debug, Default)]
struct UrlTls {
    mode: Option<PgSslMode>,
    root_cert: bool,
}

/// Reads `sslmode` and `sslrootcert` off a URL, as libpq does: `sslrootcert=system` means the
/// public roots (every connection trusts them; the parameter is dropped) and, without a
/// `sslmode`, `verify-full`. A root certificate file must exist.
fn url_tls(raw: &str) -> Result<(String, UrlTls), String> {
    let mut url = url::Url::parse(raw).map_err(|e| e.to_string())?;
    let mut explicit = UrlTls::default();
    let mut system_roots = false;
    let mut kept = Vec::new();
    for (key, value) in url.query_pairs() {
        match &*key {
            "sslmode" | "ssl-mode" => explicit.mode = Some(parse_ssl_mode(&value)?),
            "sslrootcert" | "ssl-root-cert" | "ssl-ca" if value == "system" => {
                system_roots = true;
                continue;
            }
            "sslrootcert" | "ssl-root-cert" | "ssl-ca" => {
                existing_file(&value).map_err(|reason| format!("sslrootcert: {reason}"))?;
                explicit.root_cert = true;
            }
            _ => {}
        }
        kept.push((key.into_owned(), value.into_owned()));
    }
    if !system_roots {
        // Untouched, exactly as given.
        return Ok((raw.to_owned(), explicit));
    }
    explicit.root_cert = true;
    explicit.mode.get_or_insert(PgSslMode::VerifyFull);
    if kept.is_empty() {
        url.set_query(None);
    } else {
        url.query_pairs_mut().clear().extend_pairs(kept);
    }
    Ok((url.into(), explicit))
}

fn parse_ssl_mode(raw: &str) -> Result<PgSslMode, String> {
    raw.parse::<PgSslMode>().map_err(|_| {
        format!(
            "{raw:?} is not an sslmode (disable, allow, prefer, require, verify-ca, verify-full)"
        )
    })
}

fn ssl_mode_name(mode: &PgSslMode) -> &'static str {
    match mode {
        PgSslMode::Disable => "disable",
        PgSslMode::Allow => "allow",
        PgSslMode::Prefer => "prefer",
        PgSslMode::Require => "require",
        PgSslMode::VerifyCa => "verify-ca",
        PgSslMode::VerifyFull => "verify-full",
    }
}

fn existing_file(path: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(path);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!("{} is not a readable file", path.display()))
    }
}

fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host
            .trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
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
        assert_eq!(s.stale_if_error, DEFAULT_STALE_IF_ERROR);
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
        assert_eq!(
            v.outbox().unwrap().target_url.as_deref(),
            Some("https://x.example/hook")
        );
        assert_eq!(
            vars(&[("OUTBOX_TARGET_URL", "none")])
                .outbox()
                .unwrap()
                .target_url,
            None,
            "routes only"
        );
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

    /// The options a function would connect with (no secret lookups: URL locations only).
    fn options(pairs: &[(&str, &str)]) -> Result<PgConnectOptions, ConfigError> {
        let v = vars(pairs);
        let database = v.database()?;
        let aws = v.aws_secrets()?;
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(database.connect_options(&aws))
    }

    fn mode(pairs: &[(&str, &str)]) -> &'static str {
        ssl_mode_name(&options(pairs).unwrap().get_ssl_mode())
    }

    #[test]
    fn database_tls_defaults_to_verify_full_except_on_loopback() {
        let url = |u: &'static str| [("DATABASE_URL", u)];
        assert_eq!(mode(&url("postgres://u@db.example.com/w")), "verify-full");
        assert_eq!(mode(&url("postgres://u@10.0.3.7:5432/w")), "verify-full");
        assert_eq!(mode(&url("postgres://u@127.0.0.1:5432/w")), "prefer");
        assert_eq!(mode(&url("postgres://u@localhost/w")), "prefer");
        assert_eq!(mode(&url("postgres://u@[::1]/w")), "prefer");
        // An RDS Proxy host replaces a loopback one: verified.
        assert_eq!(
            mode(&[
                ("DATABASE_URL", "postgres://u@127.0.0.1/w"),
                (
                    "DATABASE_HOST",
                    "proxy.proxy-abc.us-east-1.rds.amazonaws.com"
                ),
            ]),
            "verify-full"
        );
    }

    #[test]
    fn database_tls_honours_the_url_then_the_settings() {
        assert_eq!(
            mode(&[(
                "DATABASE_URL",
                "postgres://u@db.example.com/w?sslmode=require"
            )]),
            "require"
        );
        assert_eq!(
            mode(&[
                (
                    "DATABASE_URL",
                    "postgres://u@db.example.com/w?sslmode=verify-ca"
                ),
                ("DATABASE_SSLMODE", "disable"),
            ]),
            "verify-ca"
        );
        assert_eq!(
            mode(&[
                ("DATABASE_URL", "postgres://u@127.0.0.1/w"),
                ("DATABASE_SSLMODE", "verify-full"),
            ]),
            "verify-full"
        );
        // libpq's sslrootcert=system: the public roots, and verify-full unless said otherwise.
        let system = options(&[(
            "DATABASE_URL",
            "postgres://u@127.0.0.1/w?sslrootcert=system&application_name=x",
        )])
        .unwrap();
        assert_eq!(ssl_mode_name(&system.get_ssl_mode()), "verify-full");
        assert_eq!(system.get_application_name(), Some("x"));
    }

    #[test]
    fn database_tls_settings_that_cannot_work_fail_naming_the_variable() {
        let err = options(&[
            ("DATABASE_URL", "postgres://u@db.example.com/w"),
            ("DATABASE_SSLMODE", "verify"),
        ])
        .err()
        .unwrap()
        .to_string();
        assert!(err.starts_with("DATABASE_SSLMODE: \"verify\""), "{err}");
        let err = options(&[(
            "DATABASE_URL",
            "postgres://u@db.example.com/w?sslrootcert=/nowhere/ca.pem",
        )])
        .err()
        .unwrap()
        .to_string();
        assert!(
            err.starts_with("DATABASE_URL: sslrootcert: /nowhere/ca.pem"),
            "{err}"
        );
    }

    #[test]
    fn the_buffer_queue_is_read_when_configured() {
        assert!(vars(&[]).buffer_queue().unwrap().is_none());
        let q = vars(&[
            (
                "BUFFER_QUEUE_URL",
                "https://sqs.us-east-1.amazonaws.com/1/buffer",
            ),
            (
                "BUFFER_DEAD_LETTER_QUEUE_URL",
                "https://sqs.us-east-1.amazonaws.com/1/dlq",
            ),
            ("SQS_ENDPOINT", "http://127.0.0.1:5000"),
            ("CLOUDWATCH_ENDPOINT", "http://127.0.0.1:5001"),
            ("AWS_REGION", "us-east-1"),
        ])
        .buffer_queue()
        .unwrap()
        .unwrap();
        assert_eq!(q.queue_url, "https://sqs.us-east-1.amazonaws.com/1/buffer");
        assert_eq!(
            q.dead_letter_queue_url.as_deref(),
            Some("https://sqs.us-east-1.amazonaws.com/1/dlq")
        );
        assert_eq!(
            q.endpoint.endpoint_url.as_deref(),
            Some("http://127.0.0.1:5000")
        );
        assert_eq!(q.endpoint.region.as_deref(), Some("us-east-1"));
        assert_eq!(
            q.metrics_endpoint_url.as_deref(),
            Some("http://127.0.0.1:5001")
        );
        let only_dlq = vars(&[("BUFFER_DEAD_LETTER_QUEUE_URL", "https://x/dlq")])
            .buffer_queue()
            .unwrap_err()
            .to_string();
        assert!(
            only_dlq.starts_with("BUFFER_QUEUE_URL is not set"),
            "{only_dlq}"
        );
        let bad = vars(&[("BUFFER_QUEUE_URL", "buffer")])
            .buffer_queue()
            .unwrap_err()
            .to_string();
        assert!(bad.starts_with("BUFFER_QUEUE_URL: \"buffer\""), "{bad}");
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
        let err = vars(&[("DATABASE_URL", "x"), ("STALE_IF_ERROR_SECONDS", "-1")])
            .ingest()
            .err()
            .unwrap()
            .to_string();
        assert!(err.starts_with("STALE_IF_ERROR_SECONDS: \"-1\""), "{err}");
        let off = vars(&[("DATABASE_URL", "x"), ("STALE_IF_ERROR_SECONDS", "0")])
            .ingest()
            .unwrap();
        assert_eq!(off.stale_if_error, Duration::ZERO);
    }

    #[test]
    fn retention_ignores_the_batch_cap_it_no_longer_reads() {
        let r = vars(&[("RETENTION_BATCH_SIZE", "1000")])
            .retention()
            .unwrap();
        assert_eq!(r.batch_size, 1000);
        // Set by an older deployment: warned about, and the rest is read as usual.
        let capped = vars(&[
            ("RETENTION_MAX_BATCHES", "20"),
            ("RETENTION_BATCH_SIZE", "2000"),
        ])
        .retention()
        .unwrap();
        assert_eq!(capped.batch_size, 2000);
        assert!(vars(&[("RETENTION_BATCH_SIZE", "0")]).retention().is_err());
        assert!(
            vars(&[("RETENTION_BATCH_SIZE", "50001")])
                .retention()
                .is_err()
        );
    }
}
