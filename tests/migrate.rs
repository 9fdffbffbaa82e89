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
/// (033) and giving `webhook_events` room to complete (034) must not wait for a transaction
/// that is writing those tables, as every ingest and every drain batch is during a deploy, or
/// the deploy fails on `MIGRATE_LOCK_TIMEOUT_MS` (here 300 ms) behind live traffic.
#[sqlx::test(migrations = false)]
async fn the_migrations_after_032_wait_for_no_live_write(pool: PgPool) {
    shared::store::MIGRATOR
        .run_to(20261201000032, &pool)
        .await
        .unwrap();
    let mut writer = sqlx::PgConnection::connect(&url_of(&pool)).await.unwrap();
    sqlx::query("BEGIN").execute(&mut writer).await.unwrap();
    sqlx::query(
        "INSERT INTO outbox (tenant_id, external_id, action, payload, idempotency_key) \
         VALUES ('t', 'evt_live', 'entity.changed', '{}', 'key-live')",
    )
    .execute(&mut writer)
    .await
    .unwrap();
    // What an ingest's upsert or a drain's completion holds until it commits.
    sqlx::query("LOCK TABLE webhook_events IN ROW EXCLUSIVE MODE")
        .execute(&mut writer)
        .await
        .unwrap();

    let impatient = vars(&[
        ("DATABASE_URL", &url_of(&pool)),
        ("MIGRATE_LOCK_TIMEOUT_MS", "300"),
    ]);
    let answer = answer_of("Update", &impatient, Duration::from_secs(60)).await;
    assert_eq!(answer["Status"], "SUCCESS", "{answer}");

    sqlx::query("COMMIT").execute(&mut writer).await.unwrap();
    let (validated, options): (bool, Vec<String>) = sqlx::query_as(
        "SELECT (SELECT convalidated FROM pg_constraint WHERE conname = 'outbox_status_check'), \
                (SELECT reloptions FROM pg_class WHERE relname = 'webhook_events')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(validated);
    assert_eq!(options, ["fillfactor=50"]);
    let live: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE external_id = 'evt_live'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(live, 1);
}
