//! All SQL lives under this module: one file per table, each function generic over the
//! executor so callers own the transaction. Database errors become [`StoreError`] in one place.

pub mod advisory_locks;
pub mod anomaly;
pub mod batch_requests;
pub mod buffer_receipts;
pub mod consistency_sweep;
pub mod dead_letters;
pub mod deliveries_outside_ranges;
pub mod delivery_hours;
pub mod entities;
pub mod event_history;
pub mod event_queue;
#[cfg(feature = "drill")]
pub mod faults;
pub mod gaps;
pub mod ingest_anomalies;
pub mod maintenance_runs;
pub mod operator_actions;
pub mod operator_jobs;
pub mod orders;
pub mod outbox;
pub mod outbox_routes;
pub mod partner_certificates;
pub mod processing_completions;
pub mod provider_address_ranges;
pub mod provider_notices;
pub mod recent_changes;
pub mod reconcile;
pub mod refused_deliveries;
pub mod retention;
pub mod schema;
pub mod sources;
pub mod subscriptions;
pub mod unrepaired_losses;
pub mod webhook_events;

use std::time::Duration;

pub use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

pub use schema::MIGRATOR;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached or cannot serve now; the caller may retry.
    #[error("database unavailable: {0}")]
    Unavailable(#[source] sqlx::Error),
    /// The server's TLS certificate was refused: not signed by a trusted CA, or not issued for
    /// the host connected to. Retried like an outage (a CA rotation is an operational event),
    /// but the message says what to fix.
    #[error(
        "the database server's certificate is not trusted ({reason}): trust its CA with \
         sslrootcert on DATABASE_URL or DATABASE_SSLROOTCERT (the RDS CA bundle for a direct \
         RDS connection), and connect with the host name the certificate names"
    )]
    UntrustedServer {
        reason: String,
        #[source]
        source: sqlx::Error,
    },
    /// The server refused the credentials (SQLSTATE 28P01 or 28000): the password was rotated
    /// under a warm process, or the role changed. Retried like an outage: a function whose
    /// database is located by a secret reads the secret again and reconnects.
    #[error("the database refused the credentials: {0}")]
    CredentialsRejected(#[source] sqlx::Error),
    /// The database's credentials could not be read (Secrets Manager unreachable or slow); no
    /// connection was attempted. Retried like an outage.
    #[error("database credentials unavailable: {reason}")]
    CredentialsUnavailable { reason: String },
    /// A stored row does not parse into the domain (hand-edited configuration, say).
    #[error("stored {what} is invalid: {reason}")]
    Corrupt { what: &'static str, reason: String },
    #[error("database error: {0}")]
    Query(#[source] sqlx::Error),
}

impl StoreError {
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            StoreError::Unavailable(_)
                | StoreError::UntrustedServer { .. }
                | StoreError::CredentialsRejected(_)
                | StoreError::CredentialsUnavailable { .. }
        )
    }

    /// A deadlock (40P01) or a serialization failure (40001): the transaction lost a race with
    /// another and may be run again at once.
    pub fn is_lost_race(&self) -> bool {
        let (StoreError::Unavailable(sqlx::Error::Database(db))
        | StoreError::Query(sqlx::Error::Database(db))) = self
        else {
            return false;
        };
        db.code()
            .is_some_and(|code| code == "40P01" || code == "40001")
    }

    /// The error type a Lambda function reports: retried invocations can be told apart.
    pub fn diagnostic_type(&self) -> &'static str {
        match self {
            StoreError::UntrustedServer { .. } => "DatabaseCertificateNotTrusted",
            StoreError::CredentialsRejected(_) => CREDENTIALS_REJECTED,
            _ if self.is_retryable() => "DatabaseUnavailable",
            _ => "DatabaseError",
        }
    }
}

/// The diagnostic type of a function invocation that failed because the database refused its
/// credentials: the function reads them again before its next invocation.
pub const CREDENTIALS_REJECTED: &str = "DatabaseCredentialsRejected";

/// The certificate complaint inside a TLS error, when the server's certificate was refused.
/// The handshake reports it as an I/O error wrapping rustls's, or as a TLS error.
fn refused_certificate(error: &sqlx::Error) -> Option<String> {
    let tls: &(dyn std::error::Error + 'static) = match error {
        sqlx::Error::Tls(source) => source.as_ref(),
        sqlx::Error::Io(io) => io.get_ref()?,
        _ => return None,
    };
    match tls.downcast_ref::<rustls::Error>()? {
        e @ (rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented) => {
            Some(e.to_string())
        }
        _ => None,
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        if let Some(reason) = refused_certificate(&error) {
            return StoreError::UntrustedServer {
                reason,
                source: error,
            };
        }
        if let sqlx::Error::Database(db) = &error
            && db
                .code()
                .is_some_and(|code| code == "28P01" || code == "28000")
        {
            return StoreError::CredentialsRejected(error);
        }
        let unavailable = match &error {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => true,
            // A connection the peer closed during its start-up: sqlx reads the missing answer
            // to its SSLRequest as a byte 0 and says "unexpected response". RDS Proxy, a load
            // balancer or a server going down accepts the TCP connection and closes it; that is
            // an outage (503, or the buffer), not a fault of this delivery (500).
            sqlx::Error::Protocol(message) => message.contains("SSLRequest"),
            sqlx::Error::Database(db) => db.code().is_some_and(|code| {
                // 08: connection exception; 53: insufficient resources; 57P0x: shutdown or
                // cannot connect now; 40001/40P01: serialization failure, deadlock; 55P03 and
                // 57014: a lock wait or a statement outlived the session's lock_timeout or
                // statement_timeout (see [`SessionTimeouts`]).
                code.starts_with("08")
                    || code.starts_with("53")
                    || code.starts_with("57P0")
                    || code == "40001"
                    || code == "40P01"
                    || code == "55P03"
                    || code == "57014"
            }),
            _ => false,
        };
        if unavailable {
            StoreError::Unavailable(error)
        } else {
            StoreError::Query(error)
        }
    }
}

/// One field of every row, as the array a set statement binds (`unnest($1::text[], ...)`).
pub(crate) fn column<'r, T, U>(rows: &'r [T], field: impl Fn(&'r T) -> U) -> Vec<U> {
    rows.iter().map(field).collect()
}

/// Marks the point a failing event's writes roll back to, inside the caller's transaction.
pub async fn savepoint(conn: &mut sqlx::PgConnection) -> Result<(), StoreError> {
    sqlx::query("SAVEPOINT event").execute(conn).await?;
    Ok(())
}

/// Undoes everything since the latest [`savepoint`] and removes it (one round trip); the
/// transaction stays usable. Removed, not kept for reuse: a savepoint opened later would nest
/// inside it, and when that one writes, PostgreSQL gives every enclosing subtransaction an id of
/// its own, each one more in the 64 it caches per backend.
pub async fn rollback_to_savepoint(conn: &mut sqlx::PgConnection) -> Result<(), StoreError> {
    sqlx::raw_sql("ROLLBACK TO SAVEPOINT event; RELEASE SAVEPOINT event")
        .execute(conn)
        .await?;
    Ok(())
}

/// Pool settings. Small by default: a Lambda execution environment serves one request at a
/// time, and the database's connection limit is shared by every warm environment.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    pub max_connections: u32,
    pub acquire_timeout: Duration,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            max_connections: 2,
            acquire_timeout: Duration::from_secs(3),
        }
    }
}

/// The server-side limits every session of a function carries, all below the function's own
/// deadline (its Lambda timeout): a statement, a lock wait, and a transaction left idle (the
/// function frozen, timed out or gone, its TCP connection half-open) are ended by the server, so
/// no abandoned session holds the entity and order locks other drainers wait on.
///
/// Sent as startup parameters (`options=-c ...`), so they hold from a session's first statement
/// at no extra round trip, and a session may still `SET` its own (migrations set `lock_timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionTimeouts {
    pub statement: Duration,
    pub lock_wait: Duration,
    pub idle_in_transaction: Duration,
}

impl SessionTimeouts {
    /// For a function that times out after `deadline`: a statement may run for 80% of it, a
    /// lock be waited for, or a transaction sit idle, for half of it.
    pub fn below(deadline: Duration) -> Self {
        let at_least = |d: Duration| d.max(Duration::from_millis(1));
        Self {
            statement: at_least(deadline * 4 / 5),
            lock_wait: at_least(deadline / 2),
            idle_in_transaction: at_least(deadline / 2),
        }
    }

    /// The connect options with these limits as startup parameters.
    pub fn apply(&self, options: PgConnectOptions) -> PgConnectOptions {
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        options.options([
            ("statement_timeout", ms(self.statement)),
            ("lock_timeout", ms(self.lock_wait)),
            (
                "idle_in_transaction_session_timeout",
                ms(self.idle_in_transaction),
            ),
        ])
    }
}

/// A connection back in the pool for less than this is handed out without a ping; one idle for
/// longer is pinged first, and replaced if it is dead.
///
/// sqlx pings every connection as it comes back to the pool and discards one that fails, so a
/// second ping as it leaves again moments later proves little and costs a round trip before
/// every statement (sqlx's default, `test_before_acquire`). Connections die while idle: a
/// Lambda environment thawed after minutes, a server-side idle timeout, a failover; those are
/// pinged. One that dies within this second fails the statement it carries, which is answered
/// as the database being unavailable (ingest: 503, nothing stored, the provider retries), as a
/// connection that dies mid-statement always was.
pub const PING_IF_IDLE_FOR: Duration = Duration::from_secs(1);

/// The options every pool is built with (see [`lazy_pool`]).
pub fn pool_options(settings: &PoolSettings) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout)
        // Do not keep idle connections forever: RDS connection slots are shared.
        .idle_timeout(Some(Duration::from_secs(300)))
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_IF_IDLE_FOR {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

/// A pool that connects on first use, so a cold start does not fail when the database is
/// briefly unreachable: the request that needs it gets a 503 instead.
pub fn lazy_pool(options: PgConnectOptions, settings: &PoolSettings) -> PgPool {
    pool_options(settings).connect_lazy_with(options)
}
