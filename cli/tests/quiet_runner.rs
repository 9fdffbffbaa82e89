//! `hookctl serve` as a developer runs it, its log read as they would read it: a pass that did
//! nothing says nothing at info, and a pass that did something says what in `key=value` fields.

mod test_database;

use std::time::{Duration, Instant};

use shared::domain::Scheme;
use shared::secrets::SigningSecret;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::io::AsyncReadExt as _;

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Polls the database until `sql` counts at least `n`: waiting for the runner's own schedule,
/// not compressing time.
async fn until(pool: &PgPool, sql: &'static str, n: i64) {
    let give_up = Instant::now() + Duration::from_secs(30);
    while count(pool, sql).await < n {
        assert!(Instant::now() < give_up, "timed out waiting for: {sql}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_idle_runner_is_quiet_and_work_is_logged_as_key_value_fields(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let url = test_database::url(&connect);
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let mut runner = tokio::process::Command::new(env!("CARGO_BIN_EXE_hookctl"))
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--sources",
            "local/sources.toml",
            "--secrets-file",
            "local/secrets.toml",
            "--pipeline-interval-ms",
            "20",
            "--maintenance-interval-seconds",
            "1",
        ])
        .current_dir(root)
        .env("DATABASE_URL", &url)
        .env_remove("RUST_LOG")
        .env_remove("LOG_FORMAT")
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();

    // Idle: dozens of drain and outbox passes, and two of each maintenance pass.
    until(
        &pool,
        "SELECT count(*) FROM maintenance_runs WHERE job = 'anomaly' AND status = 'completed'",
        2,
    )
    .await;

    // Work: one delivery, drained, its effect announced through the outbox.
    let body = br#"{"action":"opened","issue":{"number":1},"repository":{"full_name":"acme/api"}}"#;
    let mut headers: http::HeaderMap = shared::signature::sign(
        Scheme::Github,
        &SigningSecret::new("local-github-secret"),
        "d-1",
        shared::ingest::unix_now(),
        body,
    )
    .unwrap()
    .into_iter()
    .collect();
    headers.insert("x-github-event", "issues".parse().unwrap());
    headers.insert("x-github-delivery", "quiet-1".parse().unwrap());
    let give_up = Instant::now() + Duration::from_secs(30);
    let reply = loop {
        match reqwest::Client::new()
            .post(format!("http://127.0.0.1:{port}/webhooks/github-demo"))
            .headers(headers.clone())
            .body(&body[..])
            .send()
            .await
        {
            Ok(r) => break r,
            Err(e) => {
                assert!(Instant::now() < give_up, "runner not listening: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert_eq!(reply.status(), 200);
    until(
        &pool,
        "SELECT count(*) FROM webhook_events WHERE status = 'processed'",
        1,
    )
    .await;
    let runs_before: i64 = count(
        &pool,
        "SELECT count(*) FROM maintenance_runs WHERE job = 'anomaly' AND status = 'completed'",
    )
    .await;
    until(
        &pool,
        "SELECT count(*) FROM maintenance_runs WHERE job = 'anomaly' AND status = 'completed'",
        runs_before + 1,
    )
    .await;

    runner.start_kill().unwrap();
    let mut log = String::new();
    runner
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .await
        .unwrap();
    let _ = runner.wait().await;

    let info: Vec<&str> = log.lines().filter(|l| l.contains(" INFO ")).collect();
    // Only the work is told: the delivery stored, the one drain pass that claimed it, the one
    // outbox pass that delivered its announcement, the sink receiving it.
    for line in &info {
        assert!(
            [
                "stored",
                "drain pass finished",
                "outbox pass finished",
                "outbox-sink received"
            ]
            .iter()
            .any(|what| line.contains(what)),
            "an info line about nothing: {line}\n{log}"
        );
    }
    let drains: Vec<&&str> = info
        .iter()
        .filter(|l| l.contains("drain pass finished"))
        .collect();
    assert_eq!(drains.len(), 1, "{log}");
    assert!(
        drains[0].contains("claimed=1") && drains[0].contains("processed=1"),
        "{}",
        drains[0]
    );
    assert!(
        !log.contains("DrainOutcome") && !log.contains("Found {") && !log.contains('\u{1b}'),
        "counts as key=value, no Debug structs, no colour codes when piped:\n{log}"
    );
    assert!(
        count(
            &pool,
            "SELECT count(*) FROM maintenance_runs WHERE job = 'reconcile'"
        )
        .await
            >= 3,
        "reconcile ran (quietly)"
    );
}
