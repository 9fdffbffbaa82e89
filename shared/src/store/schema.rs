//! The schema itself: the embedded migrations, applied on one session.

use std::time::Duration;

use sqlx::migrate::{MigrateError, Migrator};
use sqlx::{Connection, PgConnection};

use super::StoreError;

/// The schema, embedded from `migrations/`.
pub static MIGRATOR: Migrator = sqlx::migrate!("../migrations");

/// The newest migration's version: what a database is at once [`apply`] succeeded.
pub fn newest_version() -> i64 {
    MIGRATOR.iter().map(|m| m.version).max().unwrap_or_default()
}

/// Why the schema could not be brought up to date.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A migration waited for a lock longer than `lock_timeout` (a long transaction holds the
    /// table, or another migration runs), or failed.
    #[error("applying the migrations: {0}")]
    Migrate(#[source] MigrateError),
}

/// Opens one session and applies every pending migration on it. Each lock a migration waits
/// for (including the migrations' own advisory lock) gives up after `lock_timeout` rather than
/// queueing the live traffic behind it.
pub async fn apply(
    options: &sqlx::postgres::PgConnectOptions,
    lock_timeout: Duration,
) -> Result<i64, SchemaError> {
    let mut conn = PgConnection::connect_with(options)
        .await
        .map_err(StoreError::from)?;
    // A session SET rather than a startup option: RDS Proxy accepts it (and pins this one
    // session, which is what a migration wants).
    sqlx::query("SELECT set_config('lock_timeout', $1, false)")
        .bind(format!("{}ms", lock_timeout.as_millis().max(1)))
        .execute(&mut conn)
        .await
        .map_err(StoreError::from)?;
    let applied = MIGRATOR.run(&mut conn).await;
    // Best effort: the server ends the session anyway when the socket closes.
    let _ = conn.close().await;
    applied.map_err(SchemaError::Migrate)?;
    Ok(newest_version())
}
