//! The database a function connects to, and how it keeps connecting when its credentials
//! change under it.
//!
//! A database located by a Secrets Manager secret (`DATABASE_SECRET_ID`) is read once at the
//! start and its credentials kept in the pool's connect options. RDS rotates such secrets (every
//! 7 days by default): the role's password changes, sessions already open live on, and the
//! next connection of a warm process is refused (SQLSTATE 28P01). Then the secret is read again
//! and the pool's connect options replaced; the process is not restarted. Reads are shared (one
//! at a time; a caller that waited for another's read uses it) and rate-limited
//! ([`REREAD_AT_MOST_EVERY`]), so a storm of refused connections does not become a storm of
//! Secrets Manager calls.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

use crate::config::{ConfigError, DatabaseLocation, DatabaseSettings};
use crate::secrets::AwsSecretsSettings;
use crate::store::{self, StoreError};

/// The database secret is read again at most this often, however many connections are refused.
pub const REREAD_AT_MOST_EVERY: Duration = Duration::from_secs(10);

/// A function's pool, with what reads its credentials again when they are refused.
#[derive(Clone)]
pub struct Database {
    pool: PgPool,
    credentials: Option<Arc<Credentials>>,
}

/// The credentials of a database located by a secret.
struct Credentials {
    settings: DatabaseSettings,
    aws: AwsSecretsSettings,
    pool: PgPool,
    /// Whether the pool's connect options hold credentials read from the secret.
    known: AtomicBool,
    /// Counts the successful reads: a caller that saw an older value knows another caller has
    /// read the secret since.
    generation: AtomicU64,
    /// The last read attempted after the start; held while reading, so reads are one at a time.
    last_attempt: tokio::sync::Mutex<Option<Instant>>,
}

impl Database {
    /// The database for a function, from its environment: its pool, and for a database located
    /// by a secret, what reads the secret again when the server refuses the credentials.
    pub async fn from_vars<F: Fn(&str) -> Option<String>>(
        vars: &crate::config::Vars<F>,
    ) -> Result<Self, ConfigError> {
        // Boxed: keeps the AWS SDK's deep future out of the functions' `main`.
        Box::pin(Self::open(vars.database()?, vars.aws_secrets()?)).await
    }

    /// A pool whose credentials never change (tests; a `DATABASE_URL`).
    pub fn from_pool(pool: PgPool) -> Self {
        Self {
            pool,
            credentials: None,
        }
    }

    /// The pool for `settings`, lazily connected. A secret that cannot be read fails the
    /// start: right for the scheduled functions, whose next invocation starts afresh.
    pub async fn open(
        settings: DatabaseSettings,
        aws: AwsSecretsSettings,
    ) -> Result<Self, ConfigError> {
        Self::opened(settings, aws, false).await
    }

    /// As [`Database::open`], except that a secret Secrets Manager cannot serve now (not one
    /// that is missing or malformed) does not fail the start: [`Database::ready`] reads it again
    /// per request until it can, and the request is answered as the database being unavailable
    /// meanwhile (ingest: 503). A failed start would be answered 500 by API Gateway.
    pub async fn open_or_read_later(
        settings: DatabaseSettings,
        aws: AwsSecretsSettings,
    ) -> Result<Self, ConfigError> {
        Self::opened(settings, aws, true).await
    }

    async fn opened(
        settings: DatabaseSettings,
        aws: AwsSecretsSettings,
        read_later: bool,
    ) -> Result<Self, ConfigError> {
        if matches!(settings.location, DatabaseLocation::Url(_)) {
            return Ok(Self::from_pool(settings.pool(&aws).await?));
        }
        let (options, known) = match settings.connect_options(&aws).await {
            Ok(options) => (options, true),
            Err(error) if read_later && error.is_unavailable() => {
                tracing::warn!(
                    %error,
                    "database secret unreadable at the start: read again per request (answered as the database being unavailable meanwhile)"
                );
                // Never connected to: every use waits for `ready`.
                let unread = PgConnectOptions::new_without_pgpass()
                    .host("database-secret-not-read-yet.invalid");
                (unread, false)
            }
            Err(error) => return Err(error),
        };
        let pool = store::lazy_pool(options, &settings.pool);
        let credentials = Credentials {
            settings,
            aws,
            pool: pool.clone(),
            known: AtomicBool::new(known),
            generation: AtomicU64::new(0),
            // The start's read does not count against the rate: a rotation right after the
            // start is picked up at once. A failed one does.
            last_attempt: tokio::sync::Mutex::new((!known).then(Instant::now)),
        };
        Ok(Self {
            pool,
            credentials: Some(Arc::new(credentials)),
        })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// What [`Database::recover`] needs to tell whether another caller has read the credentials
    /// since: take it before using the pool.
    pub fn credentials_seen(&self) -> u64 {
        self.credentials
            .as_ref()
            .map_or(0, |c| c.generation.load(Ordering::SeqCst))
    }

    /// Ok when the pool holds credentials; otherwise reads the secret (at most every
    /// [`REREAD_AT_MOST_EVERY`]) and fails as unavailable while it cannot be read.
    pub async fn ready(&self) -> Result<(), StoreError> {
        let Some(credentials) = &self.credentials else {
            return Ok(());
        };
        if credentials.known.load(Ordering::SeqCst) {
            return Ok(());
        }
        let seen = credentials.generation.load(Ordering::SeqCst);
        credentials.reread(seen).await;
        if credentials.known.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(StoreError::CredentialsUnavailable {
                reason: "the database secret could not be read yet; it is read again at most \
                         every 10 s"
                    .into(),
            })
        }
    }

    /// After `error`, met by a caller that took [`Database::credentials_seen`] before using the
    /// pool: when the server refused the credentials, reads the secret again and replaces the
    /// pool's connect options. True when the caller should try once more now (the credentials
    /// were read, by this call or by another since `seen`).
    pub async fn recover(&self, error: &StoreError, seen: u64) -> bool {
        match (&self.credentials, error) {
            (Some(credentials), StoreError::CredentialsRejected(_)) => {
                credentials.reread(seen).await
            }
            _ => false,
        }
    }

    /// For a function whose invocation failed with diagnostic type `error_type`: after
    /// [`store::CREDENTIALS_REJECTED`], reads the credentials again for the next invocation.
    pub async fn after_failure(&self, error_type: Option<&str>) {
        if error_type == Some(store::CREDENTIALS_REJECTED)
            && let Some(credentials) = &self.credentials
        {
            let seen = credentials.generation.load(Ordering::SeqCst);
            credentials.reread(seen).await;
        }
    }
}

impl Credentials {
    /// Reads the secret and replaces the pool's connect options, unless another caller has
    /// read it since `seen` (true: use that) or the last attempt was under
    /// [`REREAD_AT_MOST_EVERY`] ago (false).
    async fn reread(&self, seen: u64) -> bool {
        let mut last_attempt = self.last_attempt.lock().await;
        if self.generation.load(Ordering::SeqCst) != seen {
            return true;
        }
        if let Some(at) = *last_attempt
            && at.elapsed() < REREAD_AT_MOST_EVERY
        {
            return false;
        }
        *last_attempt = Some(Instant::now());
        match self.settings.connect_options(&self.aws).await {
            Ok(options) => {
                self.pool.set_connect_options(options);
                self.known.store(true, Ordering::SeqCst);
                self.generation.fetch_add(1, Ordering::SeqCst);
                tracing::info!("database credentials read again from the secret");
                true
            }
            Err(error) => {
                tracing::warn!(%error, "could not read the database credentials again");
                false
            }
        }
    }
}
