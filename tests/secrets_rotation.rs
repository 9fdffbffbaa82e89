//! Signing secrets from Secrets Manager (moto in server mode, started by the test command):
//! current and previous versions accepted, a rotation picked up after the cache TTL without a
//! restart and seen whole (current and previous together), a retired secret refused. The cache's
//! time is a clock the tests move: no sleeps.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::StatusCode;
use pipeline_tests::*;
use serde_json::json;
use shared::domain::Scheme;
use shared::ingest::Ingestor;
use shared::secrets::{AwsSecrets, AwsSecretsSettings, Clock, SecretStore};
use sqlx::PgPool;

async fn post(app: &Ingestor, secret: &str, id: &str) -> StatusCode {
    let d = delivery(Scheme::Stripe, secret, id, now(), json!({}));
    post_to(app, "stripe", d.headers, &d.body).await.status
}

/// A clock the test moves: the cache's TTL is crossed without sleeping.
#[derive(Clone)]
struct TestClock(Arc<Mutex<Instant>>);

impl TestClock {
    fn new() -> Self {
        Self(Arc::new(Mutex::new(Instant::now())))
    }

    fn advance(&self, by: Duration) {
        *self.0.lock().unwrap() += by;
    }

    fn clock(&self) -> Clock {
        let at = self.0.clone();
        Arc::new(move || *at.lock().unwrap())
    }
}

async fn rotate(admin: &aws_sdk_secretsmanager::Client, name: &str, value: &str) {
    // AWSCURRENT becomes the new value, AWSPREVIOUS the old one.
    admin
        .put_secret_value()
        .secret_id(name)
        .secret_string(value)
        .send()
        .await
        .unwrap();
}

/// The ingest function reading `name` from moto through a cache whose time `clock` gives.
async fn app_with_secret(pool: PgPool, name: &str, ttl: Duration, clock: &TestClock) -> TestApp {
    let secrets = AwsSecrets::with_clock(
        &AwsSecretsSettings {
            endpoint_url: Some(moto_endpoint()),
            region: Some("us-east-1".into()),
            ttl,
        },
        clock.clock(),
    )
    .await;
    TestApp::with_limits(
        pool,
        &[source("stripe", TENANT, Scheme::Stripe, name)],
        SecretStore::Aws(secrets),
        Duration::from_secs(60),
        MAX_BODY,
    )
    .await
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_rotated_secret_is_picked_up_without_a_restart(pool: PgPool) {
    let admin = admin_client(&moto_endpoint()).await;
    let name = new_secret(&admin, "webhooks/stripe", "whsec_first").await;
    let ttl = Duration::from_secs(60);
    let clock = TestClock::new();
    let app = app_with_secret(pool.clone(), &name, ttl, &clock).await;

    assert_eq!(
        post(&app.ingestor, "whsec_first", "evt_1").await,
        StatusCode::OK
    );
    assert_eq!(
        post(&app.ingestor, "whsec_second", "evt_2").await,
        StatusCode::UNAUTHORIZED
    );

    rotate(&admin, &name, "whsec_second").await;
    clock.advance(ttl + Duration::from_secs(1));

    assert_eq!(
        post(&app.ingestor, "whsec_second", "evt_3").await,
        StatusCode::OK,
        "new secret after the TTL"
    );
    assert_eq!(
        post(&app.ingestor, "whsec_first", "evt_4").await,
        StatusCode::OK,
        "old secret still accepted as previous"
    );
    assert_eq!(
        event(&pool, TENANT, "evt_3").await.unwrap().verified_with,
        "current"
    );
    assert_eq!(
        event(&pool, TENANT, "evt_4").await.unwrap().verified_with,
        "previous"
    );

    // A second rotation retires the first secret.
    rotate(&admin, &name, "whsec_third").await;
    clock.advance(ttl + Duration::from_secs(1));
    assert_eq!(
        post(&app.ingestor, "whsec_first", "evt_5").await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        post(&app.ingestor, "whsec_second", "evt_6").await,
        StatusCode::OK
    );
    assert_eq!(
        post(&app.ingestor, "whsec_third", "evt_7").await,
        StatusCode::OK
    );

    let stored: Vec<String> = events(&pool)
        .await
        .into_iter()
        .map(|r| r.external_id)
        .collect();
    assert_eq!(stored, ["evt_1", "evt_3", "evt_4", "evt_6", "evt_7"]);
}

/// The current and previous values are one snapshot: at no moment after a rotation is the new
/// secret accepted while the retired one is refused (providers switch over gradually, and
/// deliveries signed with the old secret are still in flight and in their retry queues).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_rotation_is_seen_whole_at_every_moment_of_the_cache_ttl(pool: PgPool) {
    let admin = admin_client(&moto_endpoint()).await;
    let name = new_secret(&admin, "webhooks/stripe", "whsec_old").await;
    let ttl = Duration::from_secs(60);
    let clock = TestClock::new();
    let app = app_with_secret(pool.clone(), &name, ttl, &clock).await;

    // Warm the cache at staggered moments, then rotate in the middle of its life.
    assert_eq!(post(&app.ingestor, "whsec_old", "w1").await, StatusCode::OK);
    clock.advance(ttl / 3);
    assert_eq!(post(&app.ingestor, "whsec_old", "w2").await, StatusCode::OK);
    rotate(&admin, &name, "whsec_new").await;

    let mut new_seen = false;
    for step in 0..12 {
        clock.advance(ttl / 6);
        let old = post(&app.ingestor, "whsec_old", &format!("old-{step}")).await;
        let new = post(&app.ingestor, "whsec_new", &format!("new-{step}")).await;
        assert_eq!(
            old,
            StatusCode::OK,
            "step {step}: the retired secret was refused"
        );
        if new == StatusCode::OK {
            new_seen = true;
        } else {
            assert!(
                !new_seen,
                "step {step}: the new secret was refused after being accepted"
            );
            assert_eq!(new, StatusCode::UNAUTHORIZED);
        }
    }
    assert!(new_seen, "the rotation was picked up within two TTLs");
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_missing_secret_is_a_500_and_stores_nothing(pool: PgPool) {
    let endpoint = moto_endpoint();
    let secrets = AwsSecrets::connect(&AwsSecretsSettings {
        endpoint_url: Some(endpoint),
        region: Some("us-east-1".into()),
        ttl: Duration::from_secs(60),
    })
    .await;
    let app = TestApp::with_limits(
        pool.clone(),
        &[source(
            "stripe",
            TENANT,
            Scheme::Stripe,
            "webhooks/does-not-exist",
        )],
        SecretStore::Aws(secrets),
        Duration::from_secs(60),
        MAX_BODY,
    )
    .await;
    assert_eq!(
        post(&app.ingestor, "whsec_any", "evt_1").await,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert!(events(&pool).await.is_empty());
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_unreachable_secrets_manager_is_a_503(pool: PgPool) {
    let secrets = AwsSecrets::connect(&AwsSecretsSettings {
        endpoint_url: Some("http://127.0.0.1:1".into()),
        region: Some("us-east-1".into()),
        ttl: Duration::from_secs(60),
    })
    .await;
    let app = TestApp::with_limits(
        pool.clone(),
        &[source("stripe", TENANT, Scheme::Stripe, "webhooks/x")],
        SecretStore::Aws(secrets),
        Duration::from_secs(60),
        MAX_BODY,
    )
    .await;
    assert_eq!(
        post(&app.ingestor, "whsec_any", "evt_1").await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert!(events(&pool).await.is_empty());
}

// ---- The database's own credentials ---------------------------------------------------------

/// A port, database and user of a pool's connection options.
fn location_of(pool: &PgPool) -> (u16, String) {
    let options = pool.connect_options();
    (
        options.get_port(),
        options.get_database().unwrap_or("postgres").to_owned(),
    )
}

/// The settings every function reads, with the database located by secret `secret_id` in moto.
fn secret_located(secret_id: &str, extra: &[(&str, &str)]) -> pipeline_tests::lambda::TestVars {
    let endpoint = moto_endpoint();
    let mut pairs: Vec<(&str, &str)> = vec![
        ("DATABASE_SECRET_ID", secret_id),
        ("SECRETS_MANAGER_ENDPOINT", &endpoint),
        ("AWS_REGION", "us-east-1"),
        ("SECRETS_BACKEND", "aws"),
        // The test servers speak plaintext on loopback.
        ("DATABASE_SSLMODE", "disable"),
    ];
    pairs.extend_from_slice(extra);
    pipeline_tests::lambda::vars(&pairs)
}

/// RDS's managed master-user secret (`ManageMasterUserPassword`) holds only the user name and
/// the password; the host, port and database name come from the stack's parameters.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_rds_managed_secret_connects_with_the_location_from_the_settings(pool: PgPool) {
    let admin = admin_client(&moto_endpoint()).await;
    let name = new_secret(
        &admin,
        "rds/managed",
        &json!({"username": "postgres", "password": "managed-by-rds"}).to_string(),
    )
    .await;
    let (port, database) = location_of(&pool);
    let port = port.to_string();
    let vars = secret_located(
        &name,
        &[
            ("DATABASE_HOST", "127.0.0.1"),
            ("DATABASE_PORT", &port),
            ("DATABASE_NAME", &database),
        ],
    );
    let function_pool = vars
        .vars
        .pool()
        .await
        .expect("the managed secret is accepted");
    let connected: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&function_pool)
        .await
        .unwrap();
    assert_eq!(connected, database);

    // Without a host anywhere, the start fails naming what is missing.
    let error = secret_located(&name, &[("DATABASE_NAME", &database)])
        .vars
        .pool()
        .await
        .expect_err("no host: refused")
        .to_string();
    assert!(error.contains("DATABASE_HOST"), "{error}");
    assert!(!error.contains("managed-by-rds"), "{error}");
}

fn password_database_url() -> String {
    std::env::var("PASSWORD_DATABASE_URL").expect(
        "PASSWORD_DATABASE_URL is not set: run the tests with scripts/test, which starts a PostgreSQL that checks passwords",
    )
}

/// A role that logs in with `password` on the password-checking server, owning a fresh
/// database of its own name with the schema applied. Returns (role, admin pool).
async fn role_with_password(password: &str) -> (String, PgPool) {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let role = format!(
        "rotating_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    );
    let admin = PgPool::connect(&password_database_url()).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE {role} LOGIN SUPERUSER PASSWORD '{password}'"
    )))
    .execute(&admin)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE {role} OWNER {role}"
    )))
    .execute(&admin)
    .await
    .unwrap();
    let mut url = url::Url::parse(&password_database_url()).unwrap();
    url.set_path(&role);
    let schema = PgPool::connect(url.as_str()).await.unwrap();
    shared::store::MIGRATOR.run(&schema).await.unwrap();
    schema.close().await;
    (role, admin)
}

fn full_secret(role: &str, password: &str) -> String {
    let url = url::Url::parse(&password_database_url()).unwrap();
    json!({
        "engine": "postgres", "host": url.host_str().unwrap(), "port": url.port().unwrap_or(5432),
        "username": role, "password": password, "dbname": role,
    })
    .to_string()
}

/// The ingest function as its `main` builds it, from settings that locate the database by
/// secret `db_secret`, verifying the Stripe source with signing secret `signing`.
async fn ingest_function(db_secret: &str, signing: &str) -> Ingestor {
    let settings = secret_located(db_secret, &[])
        .vars
        .ingest()
        .expect("valid settings");
    let ingestor = Ingestor::from_settings(&settings)
        .await
        .expect("the function starts");
    shared::sources::apply(
        ingestor.pool(),
        &[source("stripe", TENANT, Scheme::Stripe, signing)],
    )
    .await
    .unwrap();
    ingestor
}

/// RDS rotates a database secret every 7 days by default. A warm function holds the
/// credentials it read at its start; after a rotation, its next connection is refused. It reads
/// the secret again and reconnects: a delivery is stored (200), or answered 503 and stored on
/// the provider's retry. Never a 500.
#[tokio::test]
async fn a_rotated_database_password_is_picked_up_by_a_warm_function() {
    let admin = admin_client(&moto_endpoint()).await;
    let (role, pg_admin) = role_with_password("first-password").await;
    let db_secret = new_secret(
        &admin,
        "rds/rotating",
        &full_secret(&role, "first-password"),
    )
    .await;
    let signing = new_secret(&admin, "webhooks/stripe", "whsec_rotating").await;
    let ingestor = ingest_function(&db_secret, &signing).await;
    assert_eq!(
        post(&ingestor, "whsec_rotating", "evt_before").await,
        StatusCode::OK
    );

    // The rotation: the role's password changes, the secret follows, the sessions end.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER ROLE {role} PASSWORD 'second-password'"
    )))
    .execute(&pg_admin)
    .await
    .unwrap();
    rotate(&admin, &db_secret, &full_secret(&role, "second-password")).await;
    let ended: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1) AS t",
    )
    .bind(&role)
    .fetch_one(&pg_admin)
    .await
    .unwrap();
    assert!(ended >= 1, "the function held no session to end");
    // As in production, where the environment sits idle (frozen) between deliveries: its idle
    // connections are pinged before use, so the ended ones are replaced by new connections
    // rather than failing the statement they would carry.
    tokio::time::sleep(shared::store::PING_IF_IDLE_FOR + Duration::from_millis(200)).await;

    let first = post(&ingestor, "whsec_rotating", "evt_after").await;
    assert!(
        first == StatusCode::OK || first == StatusCode::SERVICE_UNAVAILABLE,
        "after the rotation: {first}"
    );
    if first == StatusCode::SERVICE_UNAVAILABLE {
        assert_eq!(
            post(&ingestor, "whsec_rotating", "evt_after").await,
            StatusCode::OK,
            "the provider's retry after the rotation"
        );
    }
    let stored: Vec<String> = events(ingestor.pool())
        .await
        .into_iter()
        .map(|r| r.external_id)
        .collect();
    assert_eq!(stored, ["evt_after", "evt_before"]);
    assert_eq!(
        post(&ingestor, "whsec_rotating", "evt_later").await,
        StatusCode::OK
    );
}

/// The database secret is read at the start. Secrets Manager unreachable then (no NAT or VPC
/// endpoint yet, an outage) must not fail the start, which API Gateway would answer 500: the
/// function starts, answers 503 with a Retry-After, and reads the secret again later.
#[tokio::test]
async fn an_unreachable_secrets_manager_at_the_start_is_a_503() {
    let vars = pipeline_tests::lambda::vars(&[
        ("DATABASE_SECRET_ID", "rds/unreachable"),
        ("SECRETS_MANAGER_ENDPOINT", "http://127.0.0.1:1"),
        ("AWS_REGION", "us-east-1"),
        ("SECRETS_BACKEND", "aws"),
    ]);
    let settings = vars.vars.ingest().expect("valid settings");
    let ingestor = Ingestor::from_settings(&settings)
        .await
        .expect("the start does not fail while Secrets Manager is unreachable");
    let d = delivery(Scheme::Stripe, "whsec_any", "evt_1", now(), json!({}));
    let reply = post_to(&ingestor, "stripe", d.headers, &d.body).await;
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        reply.json
    );
    assert_eq!(reply.headers["retry-after"], "5");
}
