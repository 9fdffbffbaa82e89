//! The migrate function as CloudFormation calls it: a custom resource request whose answer goes
//! to a pre-signed URL (a local HTTP server here). CloudFormation waits for that answer, so
//! every path answers, within the invocation's deadline: success, an unreadable database
//! secret, an unreachable database, a migration stuck behind a lock (its deadline, and
//! `lock_timeout`), and Delete, which touches neither secrets nor the database.

use std::time::{Duration, Instant};

use pipeline_tests::lambda::*;
use pipeline_tests::{admin_client, moto_endpoint, new_secret};
use sqlx::{Connection, PgPool};

fn newest() -> String {
    shared::store::schema::newest_version().to_string()
}

async fn tables(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables \
         WHERE table_name IN ('webhook_events', 'event_queue', 'tombstones')",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Invokes the function with a custom resource request and returns CloudFormation's one answer.
async fn answer_of(
    request_type: &str,
    vars: &TestVars,
    deadline_in: Duration,
) -> serde_json::Value {
    let (url, answers) = cloudformation_response_url().await;
    let request = custom_resource_request(request_type, &url);
    migrate::handler(invocation(request, deadline_in), &vars.vars)
        .await
        .expect("answered");
    let answers = answers.lock().unwrap().clone();
    assert_eq!(answers.len(), 1, "exactly one answer");
    let (content_type, answer) = &answers[0];
    assert_eq!(
        content_type, "",
        "the pre-signed URL signs an empty content type"
    );
    assert_eq!(answer["RequestId"], format!("req-{request_type}"));
    assert_eq!(answer["PhysicalResourceId"], migrate::PHYSICAL_ID);
    answer.clone()
}

fn reason(answer: &serde_json::Value) -> &str {
    answer["Reason"].as_str().unwrap_or_default()
}

#[sqlx::test(migrations = false)]
async fn create_applies_the_schema_and_answers_success_and_by_hand_is_idempotent(pool: PgPool) {
    let vars = vars(&[("DATABASE_URL", &url_of(&pool))]);

    let answer = answer_of("Create", &vars, Duration::from_secs(60)).await;

    assert_eq!(answer["Status"], "SUCCESS", "{answer}");
    assert_eq!(answer["Data"]["SchemaVersion"], newest().as_str());
    assert_eq!(tables(&pool).await, 3);

    let update = answer_of("Update", &vars, Duration::from_secs(60)).await;
    assert_eq!(update["Status"], "SUCCESS", "{update}");

    let by_hand = migrate::handler(
        invocation(serde_json::json!({}), Duration::from_secs(60)),
        &vars.vars,
    )
    .await
    .unwrap();
    assert_eq!(by_hand, serde_json::json!({"schema_version": newest()}));
}

#[tokio::test]
async fn delete_answers_success_without_reading_a_secret_or_the_database() {
    // Settings that would fail if anything were read: a secret on an endpoint nobody serves.
    let vars = vars(&[
        (
            "DATABASE_SECRET_ID",
            "arn:aws:secretsmanager:us-east-1:123456789012:secret:db",
        ),
        ("SECRETS_MANAGER_ENDPOINT", "http://127.0.0.1:1"),
    ]);

    let answer = answer_of("Delete", &vars, Duration::from_secs(60)).await;

    assert_eq!(answer["Status"], "SUCCESS", "{answer}");
    let read = vars.read.lock().unwrap().clone();
    assert!(
        !read
            .iter()
            .any(|v| v.starts_with("DATABASE") || v.starts_with("SECRETS")),
        "Delete read {read:?}"
    );
}

#[tokio::test]
async fn an_unreadable_database_secret_is_answered_failed_with_the_reason() {
    let missing = "webhooks/database-credentials-that-do-not-exist";
    let vars = vars(&[
        ("DATABASE_SECRET_ID", missing),
        ("SECRETS_MANAGER_ENDPOINT", &moto_endpoint()),
        ("AWS_REGION", "us-east-1"),
    ]);

    let answer = answer_of("Create", &vars, Duration::from_secs(60)).await;

    assert_eq!(answer["Status"], "FAILED", "{answer}");
    assert!(reason(&answer).contains(missing), "{answer}");
}

#[tokio::test]
async fn a_database_secret_in_the_wrong_shape_is_answered_failed_with_the_reason() {
    let admin = admin_client(&moto_endpoint()).await;
    let name = new_secret(&admin, "webhooks/db", "postgres://not-the-json-rds-writes").await;
    let vars = vars(&[
        ("DATABASE_SECRET_ID", &name),
        ("SECRETS_MANAGER_ENDPOINT", &moto_endpoint()),
        ("AWS_REGION", "us-east-1"),
    ]);

    let answer = answer_of("Update", &vars, Duration::from_secs(60)).await;

    assert_eq!(answer["Status"], "FAILED", "{answer}");
    assert!(
        reason(&answer).contains("not the JSON RDS writes"),
        "{answer}"
    );
    assert!(
        !reason(&answer).contains("not-the-json"),
        "the secret's value never reaches the answer: {answer}"
    );
}

#[tokio::test]
async fn an_unreachable_database_is_answered_failed_with_the_reason() {
    let vars = vars(&[("DATABASE_URL", "postgres://postgres@127.0.0.1:1/webhooks")]);

    let answer = answer_of("Create", &vars, Duration::from_secs(60)).await;

    assert_eq!(answer["Status"], "FAILED", "{answer}");
    assert!(reason(&answer).contains("database unavailable"), "{answer}");
}

#[tokio::test]
async fn invalid_settings_are_answered_failed_naming_the_variable() {
    let vars = vars(&[
        ("DATABASE_URL", "postgres://postgres@127.0.0.1:1/webhooks"),
        ("MIGRATE_LOCK_TIMEOUT_MS", "soon"),
    ]);

    let answer = answer_of("Create", &vars, Duration::from_secs(60)).await;

    assert_eq!(answer["Status"], "FAILED", "{answer}");
    assert!(
        reason(&answer).contains("MIGRATE_LOCK_TIMEOUT_MS"),
        "{answer}"
    );
}

/// A second session holds the migrations table, as a long transaction or a concurrent
/// migration would; returns it (the lock lasts while it lives).
async fn hold_the_migrations_table(pool: &PgPool) -> sqlx::PgConnection {
    let url = url_of(pool);
    let mut holder = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    sqlx::query("LOCK TABLE _sqlx_migrations IN ACCESS EXCLUSIVE MODE")
        .execute(&mut holder)
        .await
        .unwrap();
    holder
}

#[sqlx::test(migrations = false)]
async fn a_migration_past_its_deadline_is_answered_failed_before_the_deadline(pool: PgPool) {
    let url = url_of(&pool);
    let patient = vars(&[
        ("DATABASE_URL", &url),
        ("MIGRATE_LOCK_TIMEOUT_MS", "600000"),
    ]);
    assert_eq!(
        answer_of("Create", &patient, Duration::from_secs(60)).await["Status"],
        "SUCCESS"
    );
    let _holder = hold_the_migrations_table(&pool).await;

    // Two seconds of work left once the answer's margin is kept back.
    let deadline_in = migrate::ANSWER_MARGIN + Duration::from_secs(2);
    let started = Instant::now();
    let answer = answer_of("Update", &patient, deadline_in).await;

    assert!(
        started.elapsed() < deadline_in,
        "answered after the deadline: {:?}",
        started.elapsed()
    );
    assert_eq!(answer["Status"], "FAILED", "{answer}");
    assert!(
        reason(&answer).contains("did not finish before the invocation's deadline"),
        "{answer}"
    );
}

#[sqlx::test(migrations = false)]
async fn a_migration_waiting_on_a_lock_gives_up_after_lock_timeout(pool: PgPool) {
    let url = url_of(&pool);
    let impatient = vars(&[("DATABASE_URL", &url), ("MIGRATE_LOCK_TIMEOUT_MS", "300")]);
    assert_eq!(
        answer_of("Create", &impatient, Duration::from_secs(60)).await["Status"],
        "SUCCESS"
    );
    let _holder = hold_the_migrations_table(&pool).await;

    let started = Instant::now();
    let answer = answer_of("Update", &impatient, Duration::from_secs(300)).await;

    assert_eq!(answer["Status"], "FAILED", "{answer}");
    assert!(reason(&answer).contains("lock timeout"), "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[sqlx::test(migrations = false)]
async fn an_answer_that_cannot_be_delivered_is_an_error_so_lambda_retries(pool: PgPool) {
    let vars = vars(&[("DATABASE_URL", &url_of(&pool))]);
    let request = custom_resource_request("Create", "http://127.0.0.1:1/cfn-response");

    let result = migrate::handler(invocation(request, Duration::from_secs(60)), &vars.vars).await;

    let error = result.expect_err("CloudFormation never heard back");
    assert_eq!(error.error_type, "ResponseFailed");
    // The migration itself ran; the retried invocation finds nothing to do and answers again.
    assert_eq!(tables(&pool).await, 3);
}

/// A stack whose migrate function was built before its newest migrations were written (a stale
/// build deployed with a new template) asks for a schema the function does not hold: the
/// answer is FAILED with the reason and nothing is applied, so the deploy stops before code that
/// needs that schema. A SchemaVersion that is not a version at all is refused the same way.
#[sqlx::test(migrations = false)]
async fn a_schema_the_build_does_not_hold_is_answered_failed_and_nothing_is_applied(pool: PgPool) {
    let vars = vars(&[("DATABASE_URL", &url_of(&pool))]);
    let ahead = (shared::store::schema::newest_version() + 1).to_string();
    for (asked, expected) in [
        (
            ahead.as_str(),
            format!(
                "the template asks for schema {ahead}, and this build of the migrate function holds the migrations up to {}",
                newest()
            ),
        ),
        (
            "latest",
            "SchemaVersion \"latest\" is not a migration version".to_owned(),
        ),
    ] {
        let (url, answers) = cloudformation_response_url().await;
        let mut request = custom_resource_request("Update", &url);
        request["ResourceProperties"]["SchemaVersion"] = asked.into();
        migrate::handler(invocation(request, Duration::from_secs(60)), &vars.vars)
            .await
            .expect("answered");
        let answers = answers.lock().unwrap().clone();
        assert_eq!(answers.len(), 1, "exactly one answer");
        let answer = &answers[0].1;
        assert_eq!(answer["Status"], "FAILED", "{answer}");
        assert!(reason(answer).contains(&expected), "{}", reason(answer));
        assert_eq!(tables(&pool).await, 0, "nothing applied");
    }
}

/// The migrations after 032 run while the pipeline writes: validating the outbox's status check
/// (033), giving `webhook_events` room to complete (034, and for small rows 20261210000100) and
/// the outbox room to lease (20261213000100) must not wait for a transaction that is writing
/// those tables, as every ingest and every drain batch is during a deploy, or the deploy fails
/// on its lock timeout (here 300 ms) behind live traffic. Each migration is applied as the
/// migrate function applies them, one after another, with a writer's transaction open.
///
/// An index built or dropped CONCURRENTLY is the one exception PostgreSQL makes by design: it
/// blocks no write, but waits for the transactions already writing its table to end (each of
/// the pipeline's lasts milliseconds). For such a migration the writer commits first and opens its
/// transaction again after; `every_migration_after_the_baseline_keeps_live_writes_flowing`
/// applies it beside the pipeline's real writes.
#[sqlx::test(migrations = false)]
async fn the_migrations_after_032_wait_for_no_live_write(pool: PgPool) {
    shared::store::MIGRATOR
        .run_to(20261201000032, &pool)
        .await
        .unwrap();
    let mut writer = sqlx::PgConnection::connect(&url_of(&pool)).await.unwrap();
    let mut written = 0;
    let mut write = async |writer: &mut sqlx::PgConnection| {
        written += 1;
        sqlx::query("BEGIN").execute(&mut *writer).await.unwrap();
        sqlx::query(
            "INSERT INTO outbox (tenant_id, external_id, action, payload, idempotency_key) \
             VALUES ('t', 'evt_live_' || $1, 'entity.changed', '{}', 'key-live-' || $1)",
        )
        .bind(written)
        .execute(&mut *writer)
        .await
        .unwrap();
        // What an ingest's upsert or a drain's completion holds until it commits.
        sqlx::query("LOCK TABLE webhook_events IN ROW EXCLUSIVE MODE")
            .execute(&mut *writer)
            .await
            .unwrap();
    };
    write(&mut writer).await;

    let all = shared::store::MIGRATOR.iter().as_slice();
    let mut concurrent = Vec::new();
    for (i, migration) in all.iter().enumerate() {
        if migration.version <= 20261201000032 {
            continue;
        }
        let concurrently = migration.sql.as_str().contains("INDEX CONCURRENTLY");
        if concurrently {
            sqlx::query("COMMIT").execute(&mut writer).await.unwrap();
            concurrent.push(migration.version);
        }
        let applied = shared::store::schema::apply_migrations(
            &all[..=i],
            pool.connect_options().as_ref(),
            Duration::from_millis(300),
            Instant::now() + Duration::from_secs(60),
        )
        .await;
        assert!(
            applied.is_ok(),
            "migration {} waited for the live write: {applied:?}",
            migration.version
        );
        if concurrently {
            write(&mut writer).await;
        }
    }
    sqlx::query("COMMIT").execute(&mut writer).await.unwrap();

    assert!(
        concurrent.contains(&20261213000200) && concurrent.contains(&20261213000300),
        "the outbox's due index is built, and the one it replaces dropped, concurrently: {concurrent:?}"
    );
    let (validated, options): (bool, Vec<String>) = sqlx::query_as(
        "SELECT (SELECT convalidated FROM pg_constraint WHERE conname = 'outbox_status_check'), \
                (SELECT reloptions FROM pg_class WHERE relname = 'webhook_events')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(validated);
    assert_eq!(options, ["fillfactor=45"]);
    let live: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE external_id LIKE 'evt_live_%'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(live, written);
}

/// The sessions of this test's database other than the caller's and `except`'s, that are
/// running a statement or hold or wait for a lock: what a migration given up on would leave.
async fn left_on_the_server(pool: &PgPool, except: i32) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT a.pid || ' ' || a.state || ' ' || coalesce(a.wait_event_type, '-') || ': ' || a.query \
         FROM pg_stat_activity AS a \
         WHERE a.datname = current_database() AND a.pid NOT IN (pg_backend_pid(), $1) \
           AND (a.state = 'active' OR EXISTS (SELECT 1 FROM pg_locks AS l WHERE l.pid = a.pid \
                                              AND l.locktype <> 'virtualxid'))",
    )
    .bind(except)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// At the deadline the function answers FAILED; the migration's statement must end with it,
/// on the server: a statement left running holds (or queues for) its lock after the answer,
/// and blocks the writes behind it for however long it takes.
#[sqlx::test(migrations = false)]
async fn at_the_deadline_the_migration_is_ended_on_the_server_too(pool: PgPool) {
    let url = url_of(&pool);
    let patient = vars(&[
        ("DATABASE_URL", &url),
        ("MIGRATE_LOCK_TIMEOUT_MS", "600000"),
    ]);
    assert_eq!(
        answer_of("Create", &patient, Duration::from_secs(60)).await["Status"],
        "SUCCESS"
    );
    let mut holder = hold_the_migrations_table(&pool).await;
    let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut holder)
        .await
        .unwrap();

    let deadline_in = migrate::ANSWER_MARGIN + Duration::from_secs(2);
    let answer = answer_of("Update", &patient, deadline_in).await;
    assert_eq!(answer["Status"], "FAILED", "{answer}");

    assert_eq!(
        left_on_the_server(&pool, holder_pid).await,
        Vec::<String>::new(),
        "the migration's session is still there after the deadline's answer"
    );
}

/// A build made before the newest migration (the previous release redeployed, or
/// CloudFormation rolling an Update back to it) meets a database that already has it. The
/// migrations are additive, so that schema serves the older code: it answers SUCCESS and
/// changes nothing, rather than failing the rollback (`UPDATE_ROLLBACK_FAILED`).
#[sqlx::test(migrations = false)]
async fn an_older_build_answers_success_for_a_schema_ahead_of_it(pool: PgPool) {
    shared::store::MIGRATOR.run(&pool).await.unwrap();
    let before: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT version, checksum FROM _sqlx_migrations ORDER BY version")
            .fetch_all(&pool)
            .await
            .unwrap();
    let all: Vec<_> = shared::store::MIGRATOR.iter().cloned().collect();
    let older = &all[..all.len() - 1];

    // As the migrate function of that build applies its migrations.
    let applied = shared::store::schema::apply_migrations(
        older,
        pool.connect_options().as_ref(),
        shared::config::DEFAULT_MIGRATE_LOCK_TIMEOUT,
        Instant::now() + Duration::from_secs(30),
    )
    .await;

    assert_eq!(
        applied.as_ref().ok(),
        Some(&older.last().unwrap().version),
        "{applied:?}"
    );
    let after: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT version, checksum FROM _sqlx_migrations ORDER BY version")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(after, before, "nothing changed");

    // One both hold that differs from what the database applied is still refused.
    let mut edited = older.to_vec();
    edited[0].checksum = vec![0; 48].into();
    let refused = shared::store::schema::apply_migrations(
        &edited,
        pool.connect_options().as_ref(),
        shared::config::DEFAULT_MIGRATE_LOCK_TIMEOUT,
        Instant::now() + Duration::from_secs(30),
    )
    .await;
    assert!(
        matches!(
            refused,
            Err(shared::store::schema::SchemaError::Migrate(
                sqlx::migrate::MigrateError::VersionMismatch(v)
            )) if v == edited[0].version
        ),
        "{refused:?}"
    );
}

/// A migration still running at the deadline (building an index, say) is ended on the
/// server, not only given up on by the client: afterwards no statement of it runs and no lock
/// of it is held, and what it did was rolled back.
#[sqlx::test(migrations = false)]
async fn a_migration_running_at_the_deadline_is_cancelled_on_the_server(pool: PgPool) {
    shared::store::MIGRATOR.run(&pool).await.unwrap();
    let mut migrations: Vec<_> = shared::store::MIGRATOR.iter().cloned().collect();
    let next = shared::store::schema::newest_version() + 1;
    migrations.push(synthetic(
        next,
        "CREATE TABLE synthetic_slow (a int); SELECT pg_sleep(600);",
    ));

    let applied = shared::store::schema::apply_migrations(
        &migrations,
        pool.connect_options().as_ref(),
        shared::config::DEFAULT_MIGRATE_LOCK_TIMEOUT,
        Instant::now() + Duration::from_secs(2),
    )
    .await;

    assert!(
        matches!(applied, Err(shared::store::schema::SchemaError::Deadline)),
        "{applied:?}"
    );
    assert_eq!(left_on_the_server(&pool, 0).await, Vec::<String>::new());
    let (table, recorded): (Option<String>, i64) = sqlx::query_as(
        "SELECT to_regclass('synthetic_slow')::text,                 (SELECT count(*) FROM _sqlx_migrations WHERE version = $1)",
    )
    .bind(next)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((table, recorded), (None, 0), "rolled back, not recorded");
}

/// An index build CONCURRENTLY that the deadline ended leaves an INVALID index behind; the
/// next attempt drops it and builds it again, rather than failing on its name forever or
/// (`IF NOT EXISTS`) keeping an index that is never used yet written by every insert.
#[sqlx::test(migrations = false)]
async fn a_concurrent_index_build_cut_short_is_built_again_next_time(pool: PgPool) {
    shared::store::MIGRATOR.run(&pool).await.unwrap();
    let mut migrations: Vec<_> = shared::store::MIGRATOR.iter().cloned().collect();
    let next = shared::store::schema::newest_version() + 1;
    migrations.push(synthetic(
        next,
        "-- no-transaction
CREATE INDEX CONCURRENTLY IF NOT EXISTS synthetic_by_type          ON webhook_events (event_type)",
    ));
    let valid = || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT indisvalid FROM pg_index              WHERE indexrelid = to_regclass('synthetic_by_type')",
        )
        .fetch_optional(&pool)
        .await
        .unwrap()
    };
    // A writer's transaction still open: the build waits for it to finish.
    let mut writer = sqlx::PgConnection::connect(&url_of(&pool)).await.unwrap();
    sqlx::query("BEGIN").execute(&mut writer).await.unwrap();
    sqlx::query("LOCK TABLE webhook_events IN ROW EXCLUSIVE MODE")
        .execute(&mut writer)
        .await
        .unwrap();
    let options = pool.connect_options().as_ref().clone();
    let apply = |within: Duration| {
        shared::store::schema::apply_migrations(
            &migrations,
            &options,
            Duration::from_secs(600),
            Instant::now() + within,
        )
    };

    let cut_short = apply(Duration::from_secs(2)).await;
    assert!(
        matches!(cut_short, Err(shared::store::schema::SchemaError::Deadline)),
        "{cut_short:?}"
    );
    assert_eq!(valid().await, Some(false), "left INVALID");

    sqlx::query("COMMIT").execute(&mut writer).await.unwrap();
    let again = apply(Duration::from_secs(30)).await;
    assert_eq!(again.ok(), Some(next));
    assert_eq!(valid().await, Some(true), "built again");
}

/// The newest migration that landed before every later one had to run beside live writes.
const BASELINE: i64 = 20261201000034;
/// `webhook_events` when a migration runs: processed history, and a backlog the drain works
/// through meanwhile.
const HISTORY: i64 = 40_000;
const BACKLOG: i64 = 4_000;
/// The longest any live write may wait for a lock while a migration runs.
const LONGEST_WAIT_SECS: f64 = 1.0;
/// The `application_name` of the live writers' sessions.
const LIVE_WRITE: &str = "live write";

/// The hot tables at a realistic size: the entity source, `HISTORY` processed events as the
/// drain leaves them, and `BACKLOG` pending in the queue.
async fn fill_hot_tables(pool: &PgPool) {
    use pipeline_tests::drain::{bulk_events, entity_source};
    // The schema here is the baseline's, older than today's `sources` columns (signed_url,
    // declared_signature): the source is written with the columns the baseline has.
    let row = shared::store::sources::SourceRow::from(&entity_source());
    sqlx::query(
        "INSERT INTO sources (source_id, tenant_id, scheme, secret_ref, tolerance_seconds, \
         external_id_from, event_type_from, entity_id_from, entity_version_from, sequence_from, enabled) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
    )
    .bind(&row.source_id)
    .bind(&row.tenant_id)
    .bind(&row.scheme)
    .bind(&row.secret_ref)
    .bind(row.tolerance_seconds)
    .bind(&row.external_id_from)
    .bind(&row.event_type_from)
    .bind(&row.entity_id_from)
    .bind(&row.entity_version_from)
    .bind(&row.sequence_from)
    .bind(row.enabled)
    .execute(pool)
    .await
    .unwrap();
    bulk_events(pool, HISTORY + BACKLOG).await;
    sqlx::query(
        "WITH done AS ( \
             DELETE FROM event_queue WHERE external_id = ANY( \
                 SELECT 'bulk-' || g FROM generate_series(1, $1) AS g) \
             RETURNING tenant_id, external_id) \
         UPDATE webhook_events AS e SET status = 'processed', processed_at = now(), attempts = 1 \
         FROM done WHERE e.tenant_id = done.tenant_id AND e.external_id = done.external_id",
    )
    .bind(HISTORY)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE").execute(pool).await.unwrap();
}

/// The database lacks a table, column or unique index this build's statement names (SQLSTATE
/// 42P01, 42703, 42P10).
fn schema_behind_the_build(error: &shared::store::webhook_events::UpsertError) -> bool {
    use shared::store::{StoreError, webhook_events::UpsertError};
    let UpsertError::Store(
        StoreError::Query(sqlx::Error::Database(db))
        | StoreError::Unavailable(sqlx::Error::Database(db)),
    ) = error
    else {
        return false;
    };
    // 42P10: no unique index matches an ON CONFLICT the build names (its migration is next).
    matches!(db.code().as_deref(), Some("42P01" | "42703" | "42P10"))
}

/// The database lacks a table, column or unique index this build's statement names, whatever
/// error wraps the database's (SQLSTATE 42P01, 42703, 42P10).
fn schema_behind(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(sqlx::Error::Database(db)) = e.downcast_ref::<sqlx::Error>() {
            return matches!(db.code().as_deref(), Some("42P01" | "42703" | "42P10"));
        }
        next = e.source();
    }
    false
}

/// A drain batch as the baseline schema takes it, in one transaction: up to 100 ready events
/// claimed with their queue and event rows locked (`SKIP LOCKED`), each event's entity
/// projected, the queue rows deleted and the events marked processed. Returns the events
/// claimed.
async fn baseline_drain_batch(pool: &PgPool) -> Result<u64, String> {
    let completed: i64 = sqlx::query_scalar(
        "WITH c AS ( \
             SELECT q.tenant_id, q.external_id, e.entity_id, e.entity_version FROM event_queue AS q \
             JOIN webhook_events AS e USING (tenant_id, external_id) \
             WHERE q.ready_at <= now() ORDER BY q.ready_at LIMIT 100 FOR UPDATE OF q, e SKIP LOCKED), \
         projected AS ( \
             INSERT INTO entities AS cur (tenant_id, entity_type, entity_id, version, state, last_event_id) \
             SELECT DISTINCT ON (tenant_id, entity_id) tenant_id, 'item', entity_id, entity_version, '{}'::jsonb, \
                 external_id FROM c WHERE entity_id IS NOT NULL ORDER BY tenant_id, entity_id, entity_version DESC \
             ON CONFLICT (tenant_id, entity_type, entity_id) DO UPDATE SET version = EXCLUDED.version, \
                 last_event_id = EXCLUDED.last_event_id, updated_at = now() \
             WHERE cur.version < EXCLUDED.version), \
         done AS ( \
             DELETE FROM event_queue AS q USING c \
             WHERE q.tenant_id = c.tenant_id AND q.external_id = c.external_id \
             RETURNING q.tenant_id, q.external_id), \
         processed AS ( \
             UPDATE webhook_events AS e SET status = 'processed', processed_at = now(), attempts = e.attempts + 1 \
             FROM done WHERE e.tenant_id = done.tenant_id AND e.external_id = done.external_id \
             RETURNING 1) \
         SELECT count(*) FROM processed",
    )
    .fetch_one(pool)
    .await
    .map_err(|e| format!("the baseline's drain batch: {e}"))?;
    Ok(completed as u64)
}

/// A delivery as the baseline schema stores it: a new event with its queue row, or a
/// redelivery counted on its row, in one statement.
async fn baseline_upsert(
    pool: &PgPool,
    id: &str,
    payload: &[u8],
) -> Result<(), shared::store::StoreError> {
    sqlx::query(
        "WITH e AS ( \
             INSERT INTO webhook_events AS stored (tenant_id, external_id, source_id, event_type, \
                 entity_id, entity_version, payload, payload_sha256, verified_with, received_at, \
                 first_received_at, last_seen_at) \
             VALUES ($1, $2, $3, 'item.updated', 'item-' || $2, 1, $4, sha256($4), 'current', \
                     now(), now(), now()) \
             ON CONFLICT (tenant_id, external_id) DO UPDATE \
                 SET delivery_count = stored.delivery_count + 1, last_seen_at = now() \
             RETURNING tenant_id, external_id, (xmax = 0) AS inserted) \
         INSERT INTO event_queue (tenant_id, external_id) \
         SELECT tenant_id, external_id FROM e WHERE inserted",
    )
    .bind(pipeline_tests::TENANT)
    .bind(id)
    .bind(pipeline_tests::drain::ENTITIES)
    .bind(payload)
    .execute(pool)
    .await
    .map_err(shared::store::StoreError::from)?;
    Ok(())
}

/// What happened to the live writes while one migration ran.
struct BesideLiveWrites {
    applied: Result<i64, shared::store::schema::SchemaError>,
    /// Each write that waited for a lock longer than [`LONGEST_WAIT_SECS`]: how long, what it
    /// was, and what held the lock.
    blocked: Vec<String>,
    /// Writes that failed.
    failed: Vec<String>,
    /// Deliveries stored and drain batches committed, over the whole run.
    ingested: u64,
    drained: u64,
}

/// Runs the real ingest upsert (new events and redeliveries of processed ones) and the real
/// drain on their own connections, applies the newest of `migrations` the way the migrate
/// function does (`schema::apply_migrations`, its default lock timeout) on another, and
/// watches `pg_stat_activity` for any writer waiting for a lock.
async fn beside_live_writes(
    pool: &PgPool,
    migrations: &[sqlx::migrate::Migration],
) -> BesideLiveWrites {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    let options = pool.connect_options().as_ref().clone();
    let writers = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.clone().application_name(LIVE_WRITE))
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let ingested = Arc::new(AtomicU64::new(0));
    let drained = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let run = format!("{}", migrations.last().map_or(0, |m| m.version));
    let mut tasks = Vec::new();

    for writer in 0..2 {
        let (writers, stop, ingested, failed, run) = (
            writers.clone(),
            stop.clone(),
            ingested.clone(),
            failed.clone(),
            run.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut i: i64 = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                // Every other delivery a redelivery of a processed event, counted on its row.
                let (id, payload) = if i % 2 == 0 {
                    let k = (i * 7919 + writer) % HISTORY + 1;
                    (format!("bulk-{k}"), format!("bulk-{k}").into_bytes())
                } else {
                    let id = format!("live-{run}-{writer}-{i}");
                    let body = serde_json::json!({"type": "item.updated",
                        "data": {"id": format!("item-{id}"), "version": 1}});
                    (id, serde_json::to_vec(&body).unwrap())
                };
                let entity = format!("item-{id}");
                let event = shared::store::webhook_events::NewEvent {
                    tenant_id: pipeline_tests::TENANT,
                    external_id: &id,
                    source_id: pipeline_tests::drain::ENTITIES,
                    event_type: "item.updated",
                    entity_id: Some(&entity),
                    entity_version: Some(1),
                    version_tiebreak: None,
                    sequence: None,
                    payload: &payload,
                    payload_sha256: pipeline_tests::sha256(&payload).try_into().unwrap(),
                    headers: serde_json::json!({}),
                    verified_with: "current",
                    provider_retries: 0,
                    id_outside_signature: false,
                    signed_digest: None,
                    verified_layout: None,
                };
                let stored = match shared::store::webhook_events::upsert(&writers, &event).await {
                    // This build's upsert needs this build's whole schema; a database one
                    // migration behind it may lack a table or column the statement names. Then
                    // the delivery is written as the baseline's ingest wrote it: the same rows
                    // of the same tables, under the same row locks.
                    Err(e) if schema_behind_the_build(&e) => {
                        baseline_upsert(&writers, &id, &payload)
                            .await
                            .map_err(|e| e.to_string())
                    }
                    other => other.map(drop).map_err(|e| e.to_string()),
                };
                match stored {
                    Ok(()) => {
                        ingested.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => failed.lock().unwrap().push(format!("ingest {id}: {e}")),
                }
            }
        }));
    }
    {
        let (writers, stop, drained, failed) = (
            writers.clone(),
            stop.clone(),
            drained.clone(),
            failed.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let drainer = pipeline_tests::drain::standard_drainer(&writers);
            while !stop.load(Ordering::Relaxed) {
                // This build's drain needs this build's whole schema (its completion records
                // the batch's latencies in a table of 20261208000100); a database behind it is
                // drained as the baseline's drain did: the same rows of the same tables, under
                // the same row locks.
                let claimed = match drainer.run_once().await {
                    Ok(outcome) => Ok(outcome.claimed),
                    Err(e) if schema_behind(&e) => baseline_drain_batch(&writers).await,
                    Err(e) => Err(e.to_string()),
                };
                match claimed {
                    Ok(claimed) if claimed > 0 => {
                        drained.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                    Err(e) => failed.lock().unwrap().push(format!("drain: {e}")),
                }
            }
        }));
    }
    let watcher = {
        let (pool, stop) = (pool.clone(), stop.clone());
        tokio::spawn(async move {
            let mut longest: std::collections::BTreeMap<(i32, String), (f64, String)> =
                Default::default();
            while !stop.load(Ordering::Relaxed) {
                let waiting: Vec<(i32, String, f64, String)> = sqlx::query_as(
                    "SELECT a.pid, a.query_start::text, \
                            extract(epoch FROM clock_timestamp() - a.query_start)::float8, \
                            a.wait_event || ' lock for: ' || left(a.query, 60) || ' held by: ' || \
                            coalesce((SELECT string_agg(b.application_name || ': ' \
                                                        || left(b.query, 100), '; ') \
                                      FROM pg_stat_activity AS b \
                                      WHERE b.pid = ANY(pg_blocking_pids(a.pid))), '?') \
                     FROM pg_stat_activity AS a \
                     WHERE a.datname = current_database() AND a.application_name = $1 \
                       AND a.wait_event_type = 'Lock'",
                )
                .bind(LIVE_WRITE)
                .fetch_all(&pool)
                .await
                .unwrap();
                for (pid, started, waited, what) in waiting {
                    let seen = longest
                        .entry((pid, started))
                        .or_insert((0.0, String::new()));
                    if waited > seen.0 {
                        *seen = (waited, what);
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            longest
                .into_values()
                .filter(|(waited, _)| *waited > LONGEST_WAIT_SECS)
                .map(|(waited, what)| format!("waited {waited:.2}s: {what}"))
                .collect::<Vec<_>>()
        })
    };

    // Every writer under way before the migration starts.
    while ingested.load(Ordering::Relaxed) < 20 || drained.load(Ordering::Relaxed) < 2 {
        assert!(failed.lock().unwrap().is_empty(), "{:?}", failed.lock());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let applied = shared::store::schema::apply_migrations(
        migrations,
        &options,
        shared::config::DEFAULT_MIGRATE_LOCK_TIMEOUT,
        Instant::now() + Duration::from_secs(60),
    )
    .await;
    // And still writing after it.
    let after = ingested.load(Ordering::Relaxed);
    while ingested.load(Ordering::Relaxed) < after + 20 && failed.lock().unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    let blocked = watcher.await.unwrap();
    writers.close().await;
    let failed = failed.lock().unwrap().clone();
    BesideLiveWrites {
        applied,
        blocked,
        failed,
        ingested: ingested.load(Ordering::Relaxed),
        drained: drained.load(Ordering::Relaxed),
    }
}

/// Fails naming the migration when it failed, failed a write, or kept one waiting too long.
fn assert_no_write_waited(version: i64, run: &BesideLiveWrites) {
    assert!(
        run.applied.is_ok(),
        "migration {version} failed beside live writes: {:?}",
        run.applied
    );
    assert!(
        run.failed.is_empty(),
        "live writes failed while migration {version} ran: {:?}",
        run.failed
    );
    assert!(
        run.blocked.is_empty(),
        "migration {version} kept live writes waiting longer than {LONGEST_WAIT_SECS}s for a \
         lock:\n{}",
        run.blocked.join("\n")
    );
    assert!(run.ingested > 0 && run.drained > 0);
}

/// Each migration after the baseline, applied to a database at the migration before it, with
/// the hot tables full and the pipeline writing: no write may wait for it longer than a second.
#[sqlx::test(migrations = false)]
async fn every_migration_after_the_baseline_keeps_live_writes_flowing(pool: PgPool) {
    let all: Vec<_> = shared::store::MIGRATOR.iter().cloned().collect();
    assert!(
        all.iter().any(|m| m.version == BASELINE),
        "the baseline is a migration"
    );
    let Some(first) = all.iter().position(|m| m.version > BASELINE) else {
        // None yet: the check itself is proven on synthetic migrations below.
        return;
    };
    shared::store::MIGRATOR
        .run_to(all[first - 1].version, &pool)
        .await
        .unwrap();
    fill_hot_tables(&pool).await;
    for at in first..all.len() {
        let run = beside_live_writes(&pool, &all[..=at]).await;
        assert_no_write_waited(all[at].version, &run);
    }
}

fn synthetic(version: i64, sql: &'static str) -> sqlx::migrate::Migration {
    use sqlx::SqlSafeStr;
    sqlx::migrate::Migration::new(
        version,
        "synthetic".into(),
        sqlx::migrate::MigrationType::Simple,
        sql.into_sql_str(),
        sql.starts_with("-- no-transaction"),
    )
}

/// The check on a migration built to break the rule and on one that keeps it: a plain CREATE
/// INDEX on `webhook_events` stops the writes for as long as it builds (the sleep stands for
/// the minutes it takes on a production-size table), and the same index built CONCURRENTLY in
/// a `-- no-transaction` migration stops none.
#[sqlx::test(migrations = false)]
async fn the_live_write_check_tells_a_blocking_migration_from_a_concurrent_one(pool: PgPool) {
    shared::store::MIGRATOR.run(&pool).await.unwrap();
    fill_hot_tables(&pool).await;
    let mut migrations: Vec<_> = shared::store::MIGRATOR.iter().cloned().collect();
    let next = shared::store::schema::newest_version() + 1;

    migrations.push(synthetic(
        next,
        "CREATE INDEX synthetic_blocking ON webhook_events (event_type, received_at); \
         SELECT pg_sleep(2);",
    ));
    let blocking = beside_live_writes(&pool, &migrations).await;
    assert!(blocking.applied.is_ok(), "{:?}", blocking.applied);
    assert!(blocking.failed.is_empty(), "{:?}", blocking.failed);
    assert!(
        blocking
            .blocked
            .iter()
            .any(|b| b.contains("held by: schema migrations: ")),
        "the plain index build kept no write waiting: {:?}",
        blocking.blocked
    );

    migrations.push(synthetic(
        next + 1,
        "-- no-transaction\nCREATE INDEX CONCURRENTLY synthetic_concurrent \
         ON webhook_events (event_type, received_at)",
    ));
    let concurrent = beside_live_writes(&pool, &migrations).await;
    assert_no_write_waited(next + 1, &concurrent);
    let valid: bool = sqlx::query_scalar(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = 'synthetic_concurrent'::regclass",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(valid);
}

/// The same through the function, as CloudFormation rolls an Update back: the database holds a
/// migration newer than this build (applied by the release being rolled back), and the
/// rollback's Update asks for the schema this build holds. SUCCESS, and nothing changes.
#[sqlx::test(migrations = false)]
async fn rolling_back_to_this_build_over_a_newer_schema_answers_success(pool: PgPool) {
    let mut newer: Vec<_> = shared::store::MIGRATOR.iter().cloned().collect();
    newer.push(synthetic(
        shared::store::schema::newest_version() + 1,
        "CREATE TABLE next_release (id bigint PRIMARY KEY)",
    ));
    shared::store::schema::apply_migrations(
        &newer,
        pool.connect_options().as_ref(),
        shared::config::DEFAULT_MIGRATE_LOCK_TIMEOUT,
        Instant::now() + Duration::from_secs(30),
    )
    .await
    .unwrap();
    let applied = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM _sqlx_migrations")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = applied().await;

    let vars = vars(&[("DATABASE_URL", &url_of(&pool))]);
    let (url, answers) = cloudformation_response_url().await;
    let mut request = custom_resource_request("Update", &url);
    request["ResourceProperties"]["SchemaVersion"] = newest().into();
    migrate::handler(invocation(request, Duration::from_secs(60)), &vars.vars)
        .await
        .expect("answered");

    let answer = answers.lock().unwrap()[0].1.clone();
    assert_eq!(answer["Status"], "SUCCESS", "{answer}");
    assert_eq!(answer["Data"]["SchemaVersion"], newest().as_str());
    assert_eq!(applied().await, before, "nothing changed");
}
