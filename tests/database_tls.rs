//! TLS to PostgreSQL, as RDS demands it (`rds.force_ssl=1`). The test command starts a
//! TLS-only server with its own private CA (`hostssl` only: plaintext is refused) and exports
//! `TLS_DATABASE_URL` (verify-full against that CA) and `TLS_TEST_DIR` (`ca.pem`, and
//! `untrusted-ca.pem`, a CA that signed nothing the server presents).
//!
//! Migrate, ingest and the drain connect with `verify-full` through the same settings code the
//! functions use; a server whose certificate is not trusted is refused with an error that says
//! so; a connection located by a Secrets Manager secret verifies by default and never falls
//! back to plaintext or to an unverified server.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use pipeline_tests::lambda::{TestVars, invocation, vars};
use pipeline_tests::*;
use serde_json::json;
use shared::domain::Scheme;
use shared::effects::EffectRegistry;
use shared::store::StoreError;
use sqlx::postgres::{PgConnectOptions, PgSslMode};
use sqlx::{Connection, PgPool};

fn tls_url() -> String {
    std::env::var("TLS_DATABASE_URL").expect(
        "TLS_DATABASE_URL is not set: run the tests with scripts/test, which starts a TLS-only PostgreSQL",
    )
}

fn cert(name: &str) -> String {
    let dir = std::env::var("TLS_TEST_DIR").expect("TLS_TEST_DIR is not set: run scripts/test");
    PathBuf::from(dir).join(name).display().to_string()
}

/// `TLS_DATABASE_URL` with its query replaced by `query`, on database `database`.
fn url_with(database: &str, query: &str) -> String {
    let mut url = url::Url::parse(&tls_url()).unwrap();
    url.set_path(database);
    url.set_query(Some(query));
    url.to_string()
}

fn verified(database: &str) -> String {
    url_with(
        database,
        &format!("sslmode=verify-full&sslrootcert={}", cert("ca.pem")),
    )
}

/// A fresh database on the TLS server, so tests run in parallel.
async fn fresh_database() -> String {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let name = format!(
        "tls_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    );
    let mut admin = sqlx::PgConnection::connect(&tls_url()).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .unwrap();
    name
}

/// The pool a function builds from these settings.
async fn pool_from(vars: &TestVars) -> PgPool {
    vars.vars.pool().await.expect("settings are valid")
}

async fn on_tls(pool: &PgPool) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn the_test_server_refuses_plaintext() {
    let plaintext = url_with("postgres", "sslmode=disable");
    let error = sqlx::PgConnection::connect(&plaintext).await.unwrap_err();
    assert!(error.to_string().contains("no encryption"), "{error}");
}

#[tokio::test]
async fn migrate_ingest_and_the_drain_work_over_verify_full() {
    let database = fresh_database().await;
    let settings = vars(&[("DATABASE_URL", &verified(&database))]);

    // Migrate, by hand, as an operator invokes it.
    let migrated = migrate::handler(
        invocation(json!({}), Duration::from_secs(60)),
        &settings.vars,
    )
    .await
    .unwrap();
    assert_eq!(
        migrated["schema_version"],
        shared::store::schema::newest_version().to_string()
    );

    // Ingest a signed delivery through the function's handler.
    let pool = pool_from(&settings).await;
    assert!(on_tls(&pool).await, "the pool's connection is TLS");
    let app = TestApp::spawn(pool.clone()).await;
    let d = delivery(
        Scheme::Stripe,
        &secret_of(Scheme::Stripe),
        "evt_tls_1",
        now(),
        json!({}),
    );
    let reply = app.post("stripe", d.headers, &d.body).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json);
    assert_eq!(reply.outcome(), "accepted");

    // Drain it.
    let drainer = shared::drain::Drainer::new(
        pool.clone(),
        Arc::new(EffectRegistry::standard()),
        drain::fast_settings(),
    );
    let outcome = drainer
        .drain_until(std::time::Instant::now() + Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(outcome.processed, 1, "{outcome:?}");
    assert_eq!(
        event(&pool, TENANT, "evt_tls_1").await.unwrap().status,
        "processed"
    );

    // The verdict over the same connection: its per-source activity is one simple query
    // (`SET LOCAL jit = off` and the statement) under the functions' session settings.
    let report = shared::status::report(&pool, &Default::default())
        .await
        .unwrap();
    let stripe = report
        .sources
        .iter()
        .find(|s| s.activity.source_id == "stripe")
        .unwrap();
    assert_eq!(stripe.activity.events_last_day, 1);
}

/// Whether the TCP socket of this process bound to local `port` has TCP_NODELAY set; `None`
/// when no socket of this process has that port.
fn nodelay_of_local_port(port: u16) -> Option<bool> {
    use std::os::fd::{BorrowedFd, RawFd};
    for entry in std::fs::read_dir("/proc/self/fd").ok()?.flatten() {
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<RawFd>().ok())
        else {
            continue;
        };
        let is_socket = std::fs::read_link(entry.path())
            .is_ok_and(|target| target.to_string_lossy().starts_with("socket:"));
        if !is_socket {
            continue;
        }
        // SAFETY: only read through while this loop runs; a descriptor closed meanwhile makes
        // the calls below fail, it is never written to.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let socket = socket2::SockRef::from(&fd);
        let local = socket.local_addr().ok().and_then(|a| a.as_socket());
        if local.map(|a| a.port()) == Some(port) {
            return socket.tcp_nodelay().ok();
        }
    }
    None
}

/// sqlx 0.9 stopped setting TCP_NODELAY on its sockets (transact-rs/sqlx#4335), and without it
/// a message the driver writes in two pieces waits out the server's 40 ms delayed ACK: every
/// TLS handshake stalled twice and every drain batch once (1,450 events/s against 6,600). The
/// workspace patches sqlx-core (`vendor/`); this fails if the patch is dropped before sqlx
/// releases the fix, or a pool is built some other way.
#[tokio::test]
async fn the_functions_connections_set_tcp_nodelay() {
    let database = fresh_database().await;
    let settings = vars(&[("DATABASE_URL", &verified(&database))]);
    let pool = pool_from(&settings).await;
    assert!(on_tls(&pool).await, "the pool's connection is TLS");
    let mut conn = pool.acquire().await.unwrap();
    let port: i32 =
        sqlx::query_scalar("SELECT client_port FROM pg_stat_activity WHERE pid = pg_backend_pid()")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    let port = u16::try_from(port).unwrap();
    assert_eq!(
        nodelay_of_local_port(port),
        Some(true),
        "the connection on local port {port} sets TCP_NODELAY"
    );
}

#[tokio::test]
async fn a_server_whose_certificate_is_not_trusted_is_refused_saying_so() {
    let database = fresh_database().await;
    let untrusted = url_with(
        &database,
        &format!(
            "sslmode=verify-full&sslrootcert={}",
            cert("untrusted-ca.pem")
        ),
    );
    let settings = vars(&[("DATABASE_URL", &untrusted)]);

    let pool = pool_from(&settings).await;
    let error = StoreError::from(pool.acquire().await.unwrap_err());
    assert!(
        matches!(error, StoreError::UntrustedServer { .. }),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("certificate is not trusted"),
        "{error}"
    );

    // The migrate function says the same to CloudFormation.
    let failed = migrate::handler(
        invocation(json!({}), Duration::from_secs(60)),
        &settings.vars,
    )
    .await
    .unwrap_err();
    assert_eq!(failed.error_type, "DatabaseCertificateNotTrusted");
    assert!(
        failed.error_message.contains("certificate is not trusted"),
        "{}",
        failed.error_message
    );

    // Ingest answers 503 (the provider retries: never a 2xx without a commit).
    let pool = pool_from(&settings).await;
    let ingestor = shared::ingest::Ingestor::new(
        pool.clone(),
        Arc::new(shared::sources::SourceRegistry::new(
            pool,
            Duration::from_secs(30),
        )),
        Arc::new(secrets_for_every_scheme()),
        shared::ingest::IngestLimits {
            max_body_bytes: MAX_BODY,
        },
    );
    let d = delivery(
        Scheme::Stripe,
        &secret_of(Scheme::Stripe),
        "evt_untrusted",
        now(),
        json!({}),
    );
    let reply = post_to(&ingestor, "stripe", d.headers, &d.body).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn verify_full_checks_the_host_name_and_verify_ca_does_not() {
    let database = fresh_database().await;
    // The server also listens on 127.0.0.2, a name its certificate does not hold.
    let options: PgConnectOptions = verified(&database).parse().unwrap();
    let other_name = options.clone().host("127.0.0.2");

    let error = StoreError::from(
        sqlx::PgConnection::connect_with(&other_name)
            .await
            .unwrap_err(),
    );
    assert!(
        matches!(error, StoreError::UntrustedServer { .. }),
        "{error:?}"
    );

    let any_name = other_name.ssl_mode(PgSslMode::VerifyCa);
    assert!(sqlx::PgConnection::connect_with(&any_name).await.is_ok());
    assert!(sqlx::PgConnection::connect_with(&options).await.is_ok());
}

/// RDS credentials in Secrets Manager, in the JSON RDS writes, pointing at the TLS server.
async fn rds_secret() -> String {
    let url = url::Url::parse(&tls_url()).unwrap();
    let database = fresh_database().await;
    let value = json!({
        "engine": "postgres", "host": url.host_str().unwrap(), "port": url.port().unwrap(),
        "username": "postgres", "password": "unused-with-trust-auth", "dbname": database
    });
    let admin = admin_client(&moto_endpoint()).await;
    new_secret(&admin, "rds/webhooks", &value.to_string()).await
}

#[tokio::test]
async fn a_secret_located_database_is_verified_by_default_and_never_falls_back() {
    let secret = rds_secret().await;
    let endpoint = moto_endpoint();
    let base = [
        ("DATABASE_SECRET_ID", secret.as_str()),
        ("SECRETS_MANAGER_ENDPOINT", endpoint.as_str()),
        ("AWS_REGION", "us-east-1"),
    ];

    // No CA configured: the private CA is not a public root, so the server is refused (not
    // reached in plaintext, not accepted unverified).
    let default = pool_from(&vars(&base)).await;
    assert!(matches!(
        default.connect_options().get_ssl_mode(),
        PgSslMode::VerifyFull
    ));
    let error = StoreError::from(default.acquire().await.unwrap_err());
    assert!(
        matches!(error, StoreError::UntrustedServer { .. }),
        "{error:?}"
    );

    // With the CA bundle configured, as a direct RDS connection is deployed.
    let ca = cert("ca.pem");
    let mut with_ca = base.to_vec();
    with_ca.push(("DATABASE_SSLROOTCERT", &ca));
    let pool = pool_from(&vars(&with_ca)).await;
    assert!(on_tls(&pool).await);
}

#[tokio::test]
async fn a_root_certificate_that_does_not_exist_is_a_settings_error_naming_it() {
    let settings = vars(&[
        ("DATABASE_URL", "postgres://db.example.com/webhooks"),
        ("DATABASE_SSLROOTCERT", "/opt/missing-bundle.pem"),
    ]);
    let error = settings.vars.pool().await.unwrap_err().to_string();
    assert!(error.starts_with("DATABASE_SSLROOTCERT"), "{error}");
    assert!(error.contains("/opt/missing-bundle.pem"), "{error}");
}
