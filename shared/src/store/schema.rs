//! The schema itself: the embedded migrations, applied on one session within a deadline.

use std::time::{Duration, Instant};

use sqlx::migrate::{MigrateError, Migration, Migrator};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

use super::StoreError;

/// The schema, embedded from `migrations/`.
///
/// # The rules every migration keeps
///
/// The pipeline writes while a deploy migrates, and the previous release may run against the
/// schema again (a rollback), so a migration:
///
/// - **is additive.** New tables, new nullable columns or columns with a constant default,
///   new indexes, new constraints: what the previous release's code reads and writes is still
///   there and still means the same. Nothing it uses is dropped, renamed or narrowed in the same
///   release that stops using it (that comes one release later). This is what lets a build
///   older than the schema run against it: [`apply`] answers success for a schema ahead of its
///   build rather than failing a rollback.
/// - **never changes once committed**, not even a comment: sqlx records each migration's
///   checksum, and a database that applied the first text refuses every build with another
///   (`VersionMismatch`). A change is a new migration.
/// - **never holds a lock on a table the pipeline writes for more than a moment.** No table
///   rewrite (ALTER COLUMN ... TYPE, ADD COLUMN with a volatile default, VACUUM FULL,
///   CLUSTER). An index on an existing table is built `CREATE INDEX CONCURRENTLY`, alone in a
///   file whose first line is `-- no-transaction` (PostgreSQL refuses CONCURRENTLY in a
///   transaction, and runs several statements sent at once as one). A CHECK or foreign key is
///   added `NOT VALID` and validated in a later migration. Every lock waited for gives up after
///   `lock_timeout`, and every statement ends at the deadline, on the server too.
///
/// `tests/migration_rules.rs` checks the files and `tests/migrate.rs` applies each new
/// migration beside live ingest and drain writes.
pub static MIGRATOR: Migrator = sqlx::migrate!("../migrations");

/// What a migration session is called in `pg_stat_activity`.
pub const SESSION_NAME: &str = "schema migrations";

/// How long ending a migration's session at the deadline may take.
const END_SESSION_WITHIN: Duration = Duration::from_secs(3);

/// The newest migration's version: what a database is at once [`apply`] succeeded.
pub fn newest_version() -> i64 {
    newest_of(MIGRATOR.iter().as_slice())
}

fn newest_of(migrations: &[Migration]) -> i64 {
    migrations
        .iter()
        .map(|m| m.version)
        .max()
        .unwrap_or_default()
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
    /// The deadline came first. The migration's session was ended on the server, so nothing
    /// it did stays locked or half-done: an unfinished migration rolled back.
    #[error("the deadline came before the migrations finished; their session was ended")]
    Deadline,
}

/// Applies every pending migration embedded in this build; see [`apply_migrations`].
pub async fn apply(
    options: &PgConnectOptions,
    lock_timeout: Duration,
    stop_at: Instant,
) -> Result<i64, SchemaError> {
    apply_migrations(MIGRATOR.iter().as_slice(), options, lock_timeout, stop_at).await
}

/// Opens one session and applies every pending one of `migrations` on it, each in its own
/// transaction unless it is a `-- no-transaction` file. Returns the newest of `migrations`.
///
/// - Each lock a migration waits for (including the migrations' own advisory lock) gives up
///   after `lock_timeout` rather than queueing the live traffic behind it.
/// - Each migration's statements end at `stop_at` on the server (`statement_timeout`), and if
///   the server cannot be told in time the session itself is ended: at the deadline nothing is
///   left running under a lock.
/// - Migrations the database has and `migrations` lacks are newer ones: this is an older build
///   (a rollback) on a schema ahead of it, which additive migrations keep safe. They are left
///   as they are. One that both hold must match byte for byte (`VersionMismatch`).
pub async fn apply_migrations(
    migrations: &[Migration],
    options: &PgConnectOptions,
    lock_timeout: Duration,
    stop_at: Instant,
) -> Result<i64, SchemaError> {
    let options = options.clone().application_name(SESSION_NAME);
    let mut conn = within(stop_at, PgConnection::connect_with(&options))
        .await?
        .map_err(StoreError::from)?;
    // Nothing but session settings runs before the pid is known; at the deadline the
    // connection just closes as it drops.
    let pid = within(stop_at, prepare_session(&mut conn, lock_timeout, stop_at)).await??;

    let mut migrator = Migrator::with_migrations(migrations.to_vec());
    migrator.set_ignore_missing(true);
    let applied = within(stop_at, run_each(&migrator, &mut conn, stop_at)).await;
    match applied {
        Ok(result) => {
            // Best effort: the server ends the session anyway when the socket closes.
            let _ = conn.close().await;
            match result {
                // The server ended a statement at the deadline (`statement_timeout`).
                Err(e) if is_statement_timeout(&e) => Err(SchemaError::Deadline),
                other => other.map(|()| newest_of(migrations)),
            }
        }
        Err(deadline) => {
            drop(conn);
            end_session(&options, pid).await;
            Err(deadline)
        }
    }
}

/// `statement_timeout` is set only by [`statement_deadline`]: a statement it cancelled ran
/// into the deadline.
fn is_statement_timeout(error: &SchemaError) -> bool {
    let (SchemaError::Migrate(
        MigrateError::Execute(sqlx::Error::Database(db))
        | MigrateError::ExecuteMigration(sqlx::Error::Database(db), _),
    )
    | SchemaError::Store(
        StoreError::Query(sqlx::Error::Database(db))
        | StoreError::Unavailable(sqlx::Error::Database(db)),
    )) = error
    else {
        return false;
    };
    db.code().as_deref() == Some("57014") && db.message().contains("statement timeout")
}

async fn within<T>(stop_at: Instant, work: impl Future<Output = T>) -> Result<T, SchemaError> {
    tokio::time::timeout_at(stop_at.into(), work)
        .await
        .map_err(|_| SchemaError::Deadline)
}

/// Session settings (a SET rather than startup options: RDS Proxy accepts them, and pins this
/// one session, which is what a migration wants). Returns the session's server process id.
async fn prepare_session(
    conn: &mut PgConnection,
    lock_timeout: Duration,
    stop_at: Instant,
) -> Result<i32, StoreError> {
    sqlx::query("SELECT set_config('lock_timeout', $1, false)")
        .bind(millis(lock_timeout))
        .execute(&mut *conn)
        .await?;
    statement_deadline(conn, stop_at).await?;
    Ok(sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await?)
}

fn millis(d: Duration) -> String {
    format!("{}ms", d.as_millis().max(1))
}

/// Every statement from now on ends on the server by `stop_at`.
async fn statement_deadline(conn: &mut PgConnection, stop_at: Instant) -> Result<(), StoreError> {
    sqlx::query("SELECT set_config('statement_timeout', $1, false)")
        .bind(millis(stop_at.saturating_duration_since(Instant::now())))
        .execute(conn)
        .await?;
    Ok(())
}

/// The migrations one at a time, so that each one's `statement_timeout` is what is left of the
/// deadline when it starts.
async fn run_each(
    migrator: &Migrator,
    conn: &mut PgConnection,
    stop_at: Instant,
) -> Result<(), SchemaError> {
    let applied: Vec<i64> =
        if sqlx::query_scalar::<_, bool>("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
            .fetch_one(&mut *conn)
            .await
            .map_err(StoreError::from)?
        {
            sqlx::query_scalar("SELECT version FROM _sqlx_migrations")
                .fetch_all(&mut *conn)
                .await
                .map_err(StoreError::from)?
        } else {
            Vec::new()
        };
    let pending: Vec<&Migration> = migrator
        .iter()
        .filter(|m| !m.migration_type.is_down_migration() && !applied.contains(&m.version))
        .collect();
    if pending.is_empty() {
        // Still checks that every migration both hold is the one the database applied.
        return migrator.run(&mut *conn).await.map_err(SchemaError::Migrate);
    }
    for migration in pending {
        statement_deadline(conn, stop_at).await?;
        if migration.no_tx {
            drop_unfinished_index(conn, migration).await?;
        }
        migrator
            .run_to(migration.version, &mut *conn)
            .await
            .map_err(SchemaError::Migrate)?;
    }
    Ok(())
}

/// A `CREATE INDEX CONCURRENTLY` that was ended (by the deadline, `lock_timeout`, a failover)
/// leaves its index behind, INVALID: never used, yet written by every insert. Trying again
/// would fail on the name, or skip it for `IF NOT EXISTS`, so an INVALID index of the name
/// the migration builds is dropped first (concurrently too), unless a build of it is under
/// way (another migrate invocation's).
async fn drop_unfinished_index(
    conn: &mut PgConnection,
    migration: &Migration,
) -> Result<(), StoreError> {
    let Some(name) = concurrent_index_name(migration.sql.as_str()) else {
        return Ok(());
    };
    let invalid: Option<String> = sqlx::query_scalar(
        "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_index AS i \
         JOIN pg_class AS c ON c.oid = i.indexrelid JOIN pg_namespace AS n ON n.oid = c.relnamespace \
         WHERE NOT i.indisvalid AND c.relname = $1 AND n.nspname = current_schema() \
           AND NOT EXISTS (SELECT 1 FROM pg_stat_progress_create_index AS p \
                           WHERE p.index_relid = i.indexrelid)",
    )
    .bind(&name)
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(qualified) = invalid {
        tracing::warn!(
            index = name,
            version = migration.version,
            "dropping the INVALID index an unfinished build left, to build it again"
        );
        // An identifier cannot be a bind parameter; this one is quoted by format('%I').
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP INDEX CONCURRENTLY IF EXISTS {qualified}"
        )))
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// The name in `CREATE [UNIQUE] INDEX CONCURRENTLY [IF NOT EXISTS] name ON ...`.
fn concurrent_index_name(sql: &str) -> Option<String> {
    let words: Vec<&str> = sql
        .lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .flat_map(str::split_whitespace)
        .collect();
    let mut words = words.into_iter();
    let mut keyword = || words.next().map(str::to_lowercase);
    if keyword().as_deref() != Some("create") {
        return None;
    }
    let mut word = keyword()?;
    if word == "unique" {
        word = keyword()?;
    }
    if word != "index" || keyword().as_deref() != Some("concurrently") {
        return None;
    }
    let mut name = words.next()?;
    if name.eq_ignore_ascii_case("if") {
        let _not_exists = (words.next()?, words.next()?);
        name = words.next()?;
    }
    let name = name.rsplit('.').next()?;
    if name.eq_ignore_ascii_case("on") || name.is_empty() {
        return None;
    }
    // A quoted name keeps its case; PostgreSQL folds any other to lower case.
    Some(
        match name.strip_prefix('"').and_then(|n| n.strip_suffix('"')) {
            Some(quoted) => quoted.to_owned(),
            None => name.to_lowercase(),
        },
    )
}

/// Ends a migration's session from another one: its statement, its transaction and every lock
/// it holds, and waits (briefly) until it is gone.
async fn end_session(options: &PgConnectOptions, pid: i32) {
    let ended = tokio::time::timeout(END_SESSION_WITHIN, async {
        let mut conn = PgConnection::connect_with(options).await?;
        let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, $2)")
            .bind(pid)
            .bind(i64::try_from(END_SESSION_WITHIN.as_millis()).unwrap_or(i64::MAX) / 2)
            .fetch_one(&mut conn)
            .await?;
        let _ = conn.close().await;
        Ok::<bool, sqlx::Error>(ended)
    })
    .await;
    match ended {
        Ok(Ok(_)) => tracing::warn!(pid, "ended the migration session at the deadline"),
        // Its statement_timeout ends the statement anyway, at the deadline.
        Ok(Err(e)) => tracing::error!(pid, error = %e, "could not end the migration session"),
        Err(_) => tracing::error!(pid, "could not end the migration session in time"),
    }
}

#[cfg(test)]
mod tests {
    use super::concurrent_index_name;

    #[test]
    fn the_index_a_concurrent_build_names() {
        for (sql, name) in [
            (
                "-- no-transaction\n-- why\nCREATE INDEX CONCURRENTLY events_by_type ON webhook_events (event_type);",
                Some("events_by_type"),
            ),
            (
                "-- no-transaction\ncreate unique index concurrently if not exists \"Outbox_Key\" on outbox (k)",
                Some("Outbox_Key"),
            ),
            (
                "-- no-transaction\nCREATE INDEX CONCURRENTLY public.x ON t (a)",
                Some("x"),
            ),
            (
                "-- no-transaction\nCREATE INDEX CONCURRENTLY ON t (a)",
                None,
            ),
            ("CREATE INDEX x ON t (a)", None),
            ("-- no-transaction\nVACUUM ANALYZE t", None),
        ] {
            assert_eq!(concurrent_index_name(sql).as_deref(), name, "{sql}");
        }
    }
}
