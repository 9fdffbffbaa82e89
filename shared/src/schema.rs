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
         {waited:?}); their session was ended on the server, so an unfinished migration was \
         rolled back and holds no lock (an index it was building CONCURRENTLY is dropped and \
         built again by the next attempt): look for a long transaction holding a table, then \
         deploy again"
    )]
    Deadline { waited: Duration },
    #[error(
        "the template asks for schema {requested}, and this build of the migrate function holds \
         the migrations up to {held} only: it was built before the newer ones were written. \
         Nothing was applied; build again (sam build) and deploy"
    )]
    BuildBehindTemplate { requested: i64, held: i64 },
    #[error("SchemaVersion {0:?} is not a migration version (the newest migration's number)")]
    BadSchemaVersion(String),
}

impl MigrateError {
    /// The error type a Lambda function reports.
    pub fn diagnostic_type(&self) -> &'static str {
        match self {
            MigrateError::Settings(_) => "MigrateSettingsInvalid",
            MigrateError::Schema(SchemaError::Store(e)) => e.diagnostic_type(),
            MigrateError::Schema(SchemaError::Migrate(_)) => "MigrationFailed",
            MigrateError::Schema(SchemaError::Deadline) => "MigrationDeadline",
            MigrateError::Deadline { .. } => "MigrationDeadline",
            MigrateError::BuildBehindTemplate { .. } | MigrateError::BadSchemaVersion(_) => {
                "SchemaVersionNotHeld"
            }
        }
    }
}

/// The schema a deploy asks for (the template's `SchemaVersion`, when there is one) must be one
/// this build holds. A newer one means the function was built before its migrations were
/// written: applying what it holds and answering SUCCESS would let the deploy go on to code
/// that finds the schema it needs missing.
pub fn check_requested(requested: Option<&serde_json::Value>) -> Result<(), MigrateError> {
    let Some(requested) = requested else {
        return Ok(());
    };
    let version = requested
        .as_str()
        .and_then(|v| v.trim().parse::<i64>().ok())
        .ok_or_else(|| {
            MigrateError::BadSchemaVersion(
                requested
                    .as_str()
                    .map_or_else(|| requested.to_string(), str::to_owned),
            )
        })?;
    let held = schema::newest_version();
    if version > held {
        return Err(MigrateError::BuildBehindTemplate {
            requested: version,
            held,
        });
    }
    Ok(())
}

/// Reads the settings, connects (fetching the database secret if that is where it lives) and
/// applies every pending migration, giving up at `stop_at`. Returns the schema version.
pub async fn bring_up_to_date<F: Fn(&str) -> Option<String>>(
    vars: &Vars<F>,
    stop_at: Instant,
) -> Result<i64, MigrateError> {
    let started = Instant::now();
    let deadline = || MigrateError::Deadline {
        waited: started.elapsed(),
    };
    let settings = async {
        let database = vars.database()?;
        let lock_timeout = vars.migrate_lock_timeout()?;
        let options = database.connect_options(&vars.aws_secrets()?).await?;
        Ok::<_, MigrateError>((options, lock_timeout))
    };
    let (options, lock_timeout) = tokio::time::timeout_at(stop_at.into(), settings)
        .await
        .map_err(|_| deadline())??;
    // Not under a timeout of its own here: at the deadline it ends its session on the server
    // before it returns, and cutting it short would leave that undone.
    match schema::apply(&options, lock_timeout, stop_at).await {
        Ok(version) => {
            tracing::info!(version, "schema is up to date");
            Ok(version)
        }
        Err(SchemaError::Deadline) => Err(deadline()),
        Err(e) => Err(e.into()),
    }
}
