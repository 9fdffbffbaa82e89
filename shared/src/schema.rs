//! Bringing the schema up to date within a deadline: the migrate function's work, whether the
//! stack's custom resource or an operator invoked it.
//!
//! Everything fallible happens here, inside the deadline, so a caller that must answer (a
//! CloudFormation custom resource) always has an answer to give: settings, the database
//! secret, the connection, each lock and each migration.

use std::time::{Duration, Instant};

use crate::config::{ConfigError, Vars};
use crate::store::schema::{self, SchemaError};

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error(transparent)]
    Settings(#[from] ConfigError),
    #[error(transparent)]
    Schema(#[from] SchemaError),
    #[error(
        "the migrations did not finish before the invocation's deadline (gave up after \
         {waited:?}); each migration is its own transaction, so an unfinished one was rolled \
         back: look for a long transaction holding a table, then deploy again"
    )]
    Deadline { waited: Duration },
}

impl MigrateError {
    /// The error type a Lambda function reports.
    pub fn diagnostic_type(&self) -> &'static str {
        match self {
            MigrateError::Settings(_) => "MigrateSettingsInvalid",
            MigrateError::Schema(SchemaError::Store(e)) => e.diagnostic_type(),
            MigrateError::Schema(SchemaError::Migrate(_)) => "MigrationFailed",
            MigrateError::Deadline { .. } => "MigrationDeadline",
        }
    }
}

/// Reads the settings, connects (fetching the database secret if that is where it lives) and
/// applies every pending migration, giving up at `stop_at`. Returns the schema version.
pub async fn bring_up_to_date<F: Fn(&str) -> Option<String>>(
    vars: &Vars<F>,
    stop_at: Instant,
) -> Result<i64, MigrateError> {
    let started = Instant::now();
    let work = async {
        let database = vars.database()?;
        let lock_timeout = vars.migrate_lock_timeout()?;
        let options = database.connect_options(&vars.aws_secrets()?).await?;
        let version = schema::apply(&options, lock_timeout).await?;
        tracing::info!(version, "schema is up to date");
        Ok(version)
    };
    match tokio::time::timeout_at(stop_at.into(), work).await {
        Ok(result) => result,
        Err(_) => Err(MigrateError::Deadline {
            waited: started.elapsed(),
        }),
    }
}
