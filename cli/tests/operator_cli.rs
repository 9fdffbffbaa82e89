//! The operator's commands as a person on call runs them: `hookctl status`, `dead-letters`,
//! `outbox`, `tombstones`, `gaps`, `runs`, `checks`, spawned as the binary, against a real
//! database, read by their output and exit code; then the same commands through `--function`,
//! with a local HTTP server standing in for the Lambda Invoke API in front of the real operator
//! handler.

mod support;
mod test_database;

use std::process::Output;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use shared::ingest::{IngestLimits, Ingestor};
use shared::secrets::{SecretSet, SecretStore};
use shared::sources::SourceRegistry;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const SECRET: &str = "whsec_pay";

struct Db {
    pool: PgPool,
    url: String,
    ingestor: Ingestor,
}

async fn db(pool_options: PgPoolOptions, connect: PgConnectOptions) -> Db {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sources.toml");
    std::fs::write(
        &file,
        "[[source]]\nid = 'pay'\ntenant = 'acme'\nscheme = 'stripe'\nsecret_ref = 'local/pay'\n\
         [source.fields]\nentity_version = 'json:/data/object/version'\n",
    )
    .unwrap();
    let sources = shared::sources::read_sources_file(&file).unwrap();
    shared::sources::apply(&pool, &sources).await.unwrap();
    let url = test_database::url(&connect);
    let ingestor = Ingestor::new(
        pool.clone(),
        Arc::new(SourceRegistry::new(
            pool.clone(),
            std::time::Duration::from_secs(30),
        )),
        Arc::new(SecretStore::memory([(
            "local/pay".to_owned(),
            SecretSet::new(SECRET, None),
        )])),
        IngestLimits {
            max_body_bytes: 64 * 1024,
        },
    );
    Db {
        pool,
        url,
        ingestor,
    }
}

impl Db {
    /// The provider delivers event `id` (Stripe-signed, through the ingest path).
    async fn deliver(&self, id: &str) -> Vec<u8> {
        let body = serde_json::to_vec(&serde_json::json!({
            "id": id, "object": "event", "type": "charge.succeeded",
            "data": {"object": {"id": format!("ch_{id}"), "version": 1}}
        }))
        .unwrap();
        support::post_stripe(&self.ingestor, "pay", SECRET, id, &body)
            .await
            .unwrap();
        body
    }

    /// A delivery whose payload is gone before the drain reaches it: its handler rejects it
    /// for good, and it is dead-lettered. Returns the payload, to put back ("fix the data").
    async fn poison(&self, id: &str) -> Vec<u8> {
        let body = self.deliver(id).await;
        sqlx::query("UPDATE webhook_events SET payload = NULL WHERE external_id = $1")
            .bind(id)
            .execute(&self.pool)
            .await
            .unwrap();
        body
    }

    async fn fix(&self, id: &str, body: &[u8]) {
        sqlx::query("UPDATE webhook_events SET payload = $2 WHERE external_id = $1")
            .bind(id)
            .bind(body)
            .execute(&self.pool)
            .await
            .unwrap();
    }

    /// `hookctl` run by the OS user `oncall`.
    async fn hookctl(&self, args: &[&str]) -> Out {
        self.hookctl_by("oncall", args).await
    }

    /// `hookctl` run by the OS user `user`, with no `--actor`.
    async fn hookctl_by(&self, user: &str, args: &[&str]) -> Out {
        run(args, &[("DATABASE_URL", self.url.as_str()), ("USER", user)]).await
    }

    /// The open dead letters' ids by event id.
    async fn letter_ids(&self) -> std::collections::BTreeMap<String, i64> {
        sqlx::query_as(
            "SELECT external_id, dead_letter_id FROM dead_letters WHERE status IN ('new', 'investigating')",
        )
        .fetch_all(&self.pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
    }

    /// The audit trail, oldest first: (action, actor, reason, via, affected).
    async fn actions(&self) -> Vec<(String, String, String, String, Value)> {
        sqlx::query_as(
            "SELECT action, actor, reason, via, affected FROM operator_actions ORDER BY action_id",
        )
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }
}

#[derive(Debug)]
struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Out {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}{}", self.stdout, self.stderr))
    }
}

/// Spawns `hookctl` with only the given settings (nothing inherited that would choose a
/// database or a function), stdout and stderr piped as a script would.
async fn run(args: &[&str], env: &[(&str, &str)]) -> Out {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_hookctl"));
    command
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("HOOKCTL_FUNCTION")
        .env_remove("HOOKCTL_LAMBDA_ENDPOINT")
        .env_remove("RUST_LOG")
        .env_remove("USER")
        .env_remove("LOGNAME")
        .env_remove("HOOKCTL_ACTOR");
    for (k, v) in env {
        command.env(k, v);
    }
    let Output {
        status,
        stdout,
        stderr,
    } = command.output().await.expect("run hookctl");
    Out {
        code: status.code(),
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    }
}

fn ok(out: &Out) {
    assert_eq!(out.code, Some(0), "{}{}", out.stdout, out.stderr);
}

/// Every scheduled pass once, as their schedules would run them.
async fn passes(db: &Db) {
    for pass in ["drain", "reconcile", "retention", "anomaly"] {
        ok(&db.hookctl(&[pass]).await);
    }
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn status_says_accounted_for_then_names_what_needs_a_human(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let db = db(pool_options, connect).await;
    for id in ["evt_1", "evt_2", "evt_3"] {
        db.deliver(id).await;
    }
    db.deliver("evt_1").await; // a provider retry
    passes(&db).await;

    let status = db.hookctl(&["status"]).await;
    ok(&status);
    assert!(
        status
            .stdout
            .starts_with("VERDICT: every event accounted for\n"),
        "{}",
        status.stdout
    );
    let pay_row = status
        .stdout
        .lines()
        .find(|l| l.trim_start().starts_with("pay "))
        .unwrap_or_else(|| panic!("no row for source pay: {}", status.stdout));
    let cells: Vec<&str> = pay_row.split_whitespace().collect();
    assert_eq!(cells[1], "acme", "{pay_row}");
    assert!(
        status
            .stdout
            .contains("QUEUE         depth 0, oldest pending 0 s, past the 15 min SLA 0"),
        "{}",
        status.stdout
    );
    let json = db.hookctl(&["status", "--json"]).await;
    ok(&json);
    let report = json.json();
    assert_eq!(report["verdict"], "accounted_for");
    assert_eq!(report["findings"], serde_json::json!([]));
    assert_eq!(report["sources"][0]["source_id"], "pay");
    assert_eq!(report["sources"][0]["events_last_day"], 3);
    assert_eq!(report["sources"][0]["duplicates_last_day"], 1);
    let reconcile = report["passes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["job"] == "reconcile")
        .unwrap();
    assert_eq!(reconcile["status"], "completed");
    assert_eq!(reconcile["stopped"], false);

    // A poison event: the drain dead-letters it, and status names it and the next command.
    let body = db.poison("evt_4").await;
    ok(&db.hookctl(&["drain"]).await);
    let status = db.hookctl(&["status"]).await;
    assert_eq!(status.code, Some(1), "{}", status.stdout);
    assert!(
        status
            .stdout
            .starts_with("VERDICT: NOT accounted for: 1 finding(s) need a human\n"),
        "{}",
        status.stdout
    );
    assert!(
        status
            .stdout
            .contains("  - 1 open dead letter(s): replay or discard each\n      next: hookctl dead-letters list"),
        "{}",
        status.stdout
    );
    let report = db.hookctl(&["status", "--json"]).await.json();
    assert_eq!(report["verdict"], "needs_attention");
    assert_eq!(report["findings"][0]["kind"], "open_dead_letters");
    assert_eq!(report["open_dead_letters"], 1);

    // The letter, listed, filtered and shown.
    let list = db.hookctl(&["dead-letters", "list"]).await;
    ok(&list);
    assert!(list.stdout.contains("evt_4"), "{}", list.stdout);
    let letters = db.hookctl(&["dead-letters", "list", "--json"]).await.json();
    let id = letters["dead_letters"][0]["dead_letter_id"]
        .as_i64()
        .unwrap();
    let none = db
        .hookctl(&["dead-letters", "list", "--event-type", "invoice.paid"])
        .await;
    assert_eq!(none.stdout, "no open dead letters\n");
    let filtered = db
        .hookctl(&[
            "dead-letters",
            "list",
            "--tenant",
            "acme",
            "--error-contains",
            "PURGED",
            "--json",
        ])
        .await
        .json();
    assert_eq!(filtered["dead_letters"].as_array().unwrap().len(), 1);
    let show = db.hookctl(&["dead-letters", "show", &id.to_string()]).await;
    ok(&show);
    assert!(
        show.stdout.contains("reason       fatal"),
        "{}",
        show.stdout
    );
    assert!(
        show.stdout.contains("payload was purged by retention"),
        "{}",
        show.stdout
    );
    let missing = db.hookctl(&["dead-letters", "show", "999999"]).await;
    assert_eq!(missing.code, Some(2));
    assert!(
        missing.stderr.contains("no dead letter 999999"),
        "{}",
        missing.stderr
    );

    // Replaying before the data is fixed fails again (exit 1); after, it lands (exit 0).
    let again = db
        .hookctl(&[
            "dead-letters",
            "replay",
            "--id",
            &id.to_string(),
            "--reason",
            "try it",
        ])
        .await;
    assert_eq!(again.code, Some(1), "{}{}", again.stdout, again.stderr);
    assert_eq!(
        again.stdout,
        "selected 1, replayed 0, failed again 1, skipped 0\n"
    );
    db.fix("evt_4", &body).await;
    let replayed = db
        .hookctl(&["dead-letters", "replay", "--all", "--reason", "data fixed"])
        .await;
    ok(&replayed);
    assert_eq!(
        replayed.stdout,
        "selected 1, replayed 1, failed again 0, skipped 0\n"
    );
    assert!(
        !replayed.stderr.contains("replaying"),
        "no progress bar when piped: {}",
        replayed.stderr
    );
    ok(&db.hookctl(&["status"]).await);

    // A letter nobody wants: discarded.
    db.poison("evt_5").await;
    ok(&db.hookctl(&["drain"]).await);
    let letters = db.hookctl(&["dead-letters", "list", "--json"]).await.json();
    let id = letters["dead_letters"][0]["dead_letter_id"]
        .as_i64()
        .unwrap();
    let discard = db
        .hookctl(&[
            "dead-letters",
            "discard",
            &id.to_string(),
            "--reason",
            "not wanted",
        ])
        .await;
    ok(&discard);
    assert_eq!(discard.stdout, format!("dead letter {id} discarded\n"));

    // The anomaly checks saw dead letters in the last hour: status says so until they age out.
    ok(&db.hookctl(&["anomaly"]).await);
    let status = db.hookctl(&["status"]).await;
    assert_eq!(status.code, Some(1));
    assert!(
        status
            .stdout
            .contains("anomaly check(s) outside their range: dead_letters_last_hour"),
        "{}",
        status.stdout
    );
    let checks = db.hookctl(&["checks", "list"]).await;
    ok(&checks);
    let first_row = checks.stdout.lines().nth(2).unwrap_or_default();
    assert!(
        first_row.trim_start().starts_with("dead_letters_last_hour")
            && first_row.contains("BREACH"),
        "breaching first: {}",
        checks.stdout
    );
    let breached = db
        .hookctl(&["checks", "list", "--breached", "--json"])
        .await
        .json();
    let breached = breached["checks"].as_array().unwrap();
    assert!(
        breached.iter().all(|c| c["breached"] == true),
        "{breached:?}"
    );
    // The replayed letter counts as a retried event too (retry_rate_last_day).
    assert!(
        breached
            .iter()
            .any(|c| c["check_name"] == "dead_letters_last_hour"),
        "{breached:?}"
    );

    // Runs, tombstones, gaps.
    let runs = db.hookctl(&["runs", "list", "--job", "reconcile"]).await;
    ok(&runs);
    assert!(
        runs.stdout.lines().skip(1).all(|l| l.contains("reconcile"))
            && runs.stdout.contains("completed"),
        "{}",
        runs.stdout
    );
    let bad_job = db.hookctl(&["runs", "list", "--job", "vacuum"]).await;
    assert_eq!(bad_job.code, Some(2));
    assert!(
        bad_job.stderr.contains("job \"vacuum\""),
        "{}",
        bad_job.stderr
    );
    let add = [
        "tombstones",
        "add",
        "--tenant",
        "acme",
        "--source",
        "pay",
        "--id",
        "evt_gone",
        "--reason",
        "deleted in the dashboard",
        "--operator",
        "alice",
    ];
    let added = db.hookctl(&add).await;
    ok(&added);
    assert_eq!(added.stdout, "tombstoned evt_gone\n");
    assert_eq!(
        db.hookctl(&add).await.stdout,
        "evt_gone was already tombstoned\n"
    );
    let listed = db.hookctl(&["tombstones", "list", "--source", "pay"]).await;
    ok(&listed);
    assert!(
        listed.stdout.contains("evt_gone") && listed.stdout.contains("operator:alice"),
        "{}",
        listed.stdout
    );
    let gaps = db.hookctl(&["gaps", "list"]).await;
    ok(&gaps);
    assert_eq!(gaps.stdout, "no open gaps\n");
}

/// A change nobody can be named for is refused before anything is sent.
#[tokio::test]
async fn a_change_without_anyone_to_name_is_refused() {
    let nobody = run(
        &["dead-letters", "discard", "7", "--reason", "not wanted"],
        &[("DATABASE_URL", "postgres://postgres@127.0.0.1:1/nowhere")],
    )
    .await;
    assert_eq!(nobody.code, Some(2), "{nobody:?}");
    assert!(nobody.stderr.contains("--actor"), "{}", nobody.stderr);
}

#[tokio::test]
async fn status_exits_2_when_it_cannot_tell() {
    let down = run(
        &["status"],
        &[("DATABASE_URL", "postgres://postgres@127.0.0.1:1/nowhere")],
    )
    .await;
    assert_eq!(down.code, Some(2), "{down:?}");
    assert!(
        down.stderr.contains("database unavailable"),
        "{}",
        down.stderr
    );
    let unset = run(&["status"], &[]).await;
    assert_eq!(unset.code, Some(2));
    assert!(unset.stderr.contains("DATABASE_URL"), "{}", unset.stderr);
    let bad = run(&["dead-letters", "list", "--since", "yesterday"], &[]).await;
    assert_eq!(bad.code, Some(2));
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_replay_of_many_goes_in_chunks_and_counts_them_all(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let db = db(pool_options, connect).await;
    let mut bodies = Vec::new();
    for n in 0..60 {
        let id = format!("evt_{n}");
        bodies.push((id.clone(), db.poison(&id).await));
    }
    ok(&db.hookctl(&["drain"]).await);
    for (id, body) in &bodies {
        db.fix(id, body).await;
    }
    let replayed = db
        .hookctl(&[
            "dead-letters",
            "replay",
            "--all",
            "--reason",
            "data fixed",
            "--json",
        ])
        .await;
    ok(&replayed);
    assert_eq!(
        replayed.json(),
        serde_json::json!({"selected": 60, "replayed": 60, "failed": 0, "skipped": 0})
    );
    let left = db.hookctl(&["dead-letters", "list"]).await;
    assert_eq!(left.stdout, "no open dead letters\n");
}

// ---- Through the operator function -----------------------------------------------------------

#[derive(Clone)]
struct StandIn {
    pool: PgPool,
    registry: Arc<shared::effects::EffectRegistry>,
    invoked: Arc<Mutex<Vec<String>>>,
}

/// `POST /2015-03-31/functions/{name}/invocations`: the Lambda Invoke API, answered by the real
/// operator handler. A handler error is answered as Lambda does: 200, `X-Amz-Function-Error`,
/// and the error's type and message as the payload.
async fn invoke(State(s): State<StandIn>, Path(name): Path<String>, body: Bytes) -> Response {
    let request_id = {
        let mut invoked = s.invoked.lock().unwrap();
        invoked.push(name.clone());
        format!("stand-in-request-{}", invoked.len())
    };
    let payload: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    // What Lambda tells the function about an invocation: its request id and the function.
    let mut context = lambda_runtime::Context::default();
    context.request_id = request_id;
    context.invoked_function_arn = format!("arn:aws:lambda:eu-west-1:123456789012:function:{name}");
    let event = lambda_runtime::LambdaEvent::new(payload, context);
    match operator::handler(event, &s.pool, &s.registry, None).await {
        Ok(response) => (StatusCode::OK, axum::Json(response)).into_response(),
        Err(diagnostic) => (
            StatusCode::OK,
            [("X-Amz-Function-Error", "Unhandled")],
            axum::Json(serde_json::json!({
                "errorType": diagnostic.error_type,
                "errorMessage": diagnostic.error_message,
            })),
        )
            .into_response(),
    }
}

async fn stand_in(pool: PgPool) -> (String, Arc<Mutex<Vec<String>>>) {
    let invoked = Arc::new(Mutex::new(Vec::new()));
    let state = StandIn {
        pool,
        registry: Arc::new(shared::effects::EffectRegistry::standard()),
        invoked: invoked.clone(),
    };
    let app = axum::Router::new()
        .route(
            "/2015-03-31/functions/{name}/invocations",
            axum::routing::post(invoke),
        )
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, invoked)
}

/// `hookctl --function`, with credentials and region as the AWS CLI would find them and no
/// database at all.
async fn through(endpoint: &str, args: &[&str]) -> Out {
    let mut all = vec!["--function", "webhooks-operator"];
    all.extend_from_slice(args);
    run(
        &all,
        &[
            ("HOOKCTL_LAMBDA_ENDPOINT", endpoint),
            ("AWS_REGION", "eu-west-1"),
            ("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE"),
            (
                "AWS_SECRET_ACCESS_KEY",
                "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
            ),
            ("AWS_EC2_METADATA_DISABLED", "true"),
            ("USER", "oncall"),
        ],
    )
    .await
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn every_command_answers_through_the_operator_function(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let db = db(pool_options, connect).await;
    db.deliver("evt_1").await;
    passes(&db).await;
    let (endpoint, invoked) = stand_in(db.pool.clone()).await;

    // The same verdict, the same report, whichever way it is read.
    let remote = through(&endpoint, &["status"]).await;
    ok(&remote);
    assert!(
        remote
            .stdout
            .starts_with("VERDICT: every event accounted for\n")
    );
    let direct = db.hookctl(&["status", "--json"]).await.json();
    let remote = through(&endpoint, &["status", "--json"]).await.json();
    assert_eq!(remote["verdict"], direct["verdict"]);
    assert_eq!(remote["sources"], direct["sources"]);
    assert_eq!(remote["findings"], direct["findings"]);

    db.poison("evt_2").await;
    ok(&db.hookctl(&["drain"]).await);
    let status = through(&endpoint, &["status"]).await;
    assert_eq!(status.code, Some(1), "{}", status.stdout);
    assert!(status.stdout.contains("1 open dead letter(s)"));

    let letters = through(&endpoint, &["dead-letters", "list", "--json"])
        .await
        .json();
    let id = letters["dead_letters"][0]["dead_letter_id"]
        .as_i64()
        .unwrap();
    assert_eq!(letters["dead_letters"][0]["external_id"], "evt_2");
    let show = through(&endpoint, &["dead-letters", "show", &id.to_string()]).await;
    ok(&show);
    assert!(
        show.stdout.contains("payload was purged"),
        "{}",
        show.stdout
    );
    let replay = through(
        &endpoint,
        &[
            "dead-letters",
            "replay",
            "--all",
            "--reason",
            "try it",
            "--actor",
            "bob",
        ],
    )
    .await;
    assert_eq!(replay.code, Some(1));
    assert_eq!(
        replay.stdout,
        "selected 1, replayed 0, failed again 1, skipped 0\n"
    );
    ok(&through(
        &endpoint,
        &[
            "dead-letters",
            "discard",
            &id.to_string(),
            "--reason",
            "not wanted",
            "--actor",
            "bob",
        ],
    )
    .await);
    ok(&through(&endpoint, &["status"]).await);

    ok(&through(&endpoint, &["runs", "list", "--job", "anomaly"]).await);
    let checks = through(&endpoint, &["checks", "list", "--json"])
        .await
        .json();
    assert!(checks["checks"].as_array().unwrap().len() >= 30);
    assert_eq!(
        through(&endpoint, &["gaps", "list"]).await.stdout,
        "no open gaps\n"
    );
    let added = through(
        &endpoint,
        &[
            "tombstones",
            "add",
            "--tenant",
            "acme",
            "--source",
            "pay",
            "--id",
            "evt_x",
            "--reason",
            "test event",
            "--operator",
            "bob",
        ],
    )
    .await;
    ok(&added);
    let listed = through(&endpoint, &["tombstones", "list", "--json"])
        .await
        .json();
    assert_eq!(listed["tombstones"][0]["created_by"], "operator:bob");
    let raw = through(&endpoint, &["operator", r#"{"action":"list_gaps"}"#]).await;
    ok(&raw);
    assert_eq!(raw.json(), serde_json::json!({"gaps": []}));

    // Refused by the function: exit 2 with its reason.
    let refused = through(&endpoint, &["dead-letters", "show", "424242"]).await;
    assert_eq!(refused.code, Some(2));
    assert!(
        refused.stderr.contains("no dead letter 424242"),
        "{}",
        refused.stderr
    );
    assert!(
        invoked
            .lock()
            .unwrap()
            .iter()
            .all(|name| name == "webhooks-operator")
    );

    // No function there: could not tell.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let gone = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let unreachable = through(&gone, &["status"]).await;
    assert_eq!(unreachable.code, Some(2), "{unreachable:?}");
    assert!(
        unreachable.stderr.contains("invoking webhooks-operator"),
        "{}",
        unreachable.stderr
    );
}

/// A replay or resend with no filter at all would act on every open letter or failed message:
/// refused unless `--all` says so, by the command and by the operator function.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_empty_filter_is_refused_unless_all_is_given(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let db = db(pool_options, connect).await;
    let mut bodies = Vec::new();
    for id in ["evt_1", "evt_2"] {
        bodies.push((id, db.poison(id).await));
    }
    ok(&db.hookctl(&["drain"]).await);
    for (id, body) in &bodies {
        db.fix(id, body).await;
    }
    let (endpoint, _) = stand_in(db.pool.clone()).await;

    let everything = db
        .hookctl(&["dead-letters", "replay", "--reason", "fixed upstream"])
        .await;
    assert_eq!(everything.code, Some(2), "{everything:?}");
    assert!(
        everything.stderr.contains("no filter") && everything.stderr.contains("--all"),
        "{}",
        everything.stderr
    );
    let remote = through(
        &endpoint,
        &["dead-letters", "replay", "--reason", "fixed upstream"],
    )
    .await;
    assert_eq!(remote.code, Some(2), "{remote:?}");
    let resend = db
        .hookctl(&["outbox", "resend", "--reason", "target is back"])
        .await;
    assert_eq!(resend.code, Some(2), "{resend:?}");
    assert!(resend.stderr.contains("--all"), "{}", resend.stderr);
    // The operator function refuses it too, whoever calls it.
    let raw = through(
        &endpoint,
        &[
            "operator",
            r#"{"action":"replay","filter":{"limit":5},"actor":"eve","reason":"all of them"}"#,
        ],
    )
    .await;
    assert_eq!(raw.code, Some(2), "{raw:?}");
    assert!(raw.stderr.contains(r#""all": true"#), "{}", raw.stderr);
    assert_eq!(db.letter_ids().await.len(), 2, "nothing was replayed");

    let all = db
        .hookctl(&[
            "dead-letters",
            "replay",
            "--all",
            "--reason",
            "fixed upstream",
            "--json",
        ])
        .await;
    ok(&all);
    assert_eq!(
        all.json(),
        serde_json::json!({"selected": 2, "replayed": 2, "failed": 0, "skipped": 0})
    );
    assert!(db.letter_ids().await.is_empty());
}

/// Each state change says who asked for it and why, in `operator_actions`: the `--actor`, else
/// the OS user; through the function, also what Lambda said about the invocation. A change
/// without a reason is refused.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn every_state_change_records_who_asked_and_why(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let db = db(pool_options, connect).await;
    let body = db.poison("evt_1").await;
    db.poison("evt_2").await;
    db.poison("evt_3").await;
    ok(&db.hookctl(&["drain"]).await);
    let letters = db.letter_ids().await;
    let (one, two, three) = (letters["evt_1"], letters["evt_2"], letters["evt_3"]);
    let (endpoint, _) = stand_in(db.pool.clone()).await;

    let unexplained = db
        .hookctl(&["dead-letters", "replay", "--id", &one.to_string()])
        .await;
    assert_eq!(unexplained.code, Some(2), "{unexplained:?}");
    assert!(
        unexplained.stderr.contains("--reason"),
        "{}",
        unexplained.stderr
    );
    let unexplained = db
        .hookctl(&["dead-letters", "discard", &two.to_string()])
        .await;
    assert_eq!(unexplained.code, Some(2), "{unexplained:?}");
    assert_eq!(db.letter_ids().await.len(), 3, "nothing changed");

    db.fix("evt_1", &body).await;
    let replayed = db
        .hookctl_by(
            "root",
            &[
                "dead-letters",
                "replay",
                "--id",
                &one.to_string(),
                "--reason",
                "payload restored",
                "--actor",
                "alice",
            ],
        )
        .await;
    ok(&replayed);
    let discarded = db
        .hookctl_by(
            "carol",
            &[
                "dead-letters",
                "discard",
                &two.to_string(),
                "--reason",
                "a test event",
            ],
        )
        .await;
    ok(&discarded);
    let remote = through(
        &endpoint,
        &[
            "dead-letters",
            "replay",
            "--id",
            &three.to_string(),
            "--reason",
            "try once more",
            "--actor",
            "bob",
        ],
    )
    .await;
    assert_eq!(remote.code, Some(1), "failed again: {remote:?}");
    let tombstoned = db
        .hookctl_by(
            "dave",
            &[
                "tombstones",
                "add",
                "--tenant",
                "acme",
                "--source",
                "pay",
                "--id",
                "evt_gone",
                "--reason",
                "deleted in the dashboard",
            ],
        )
        .await;
    ok(&tombstoned);

    let s = |v: &str| v.to_owned();
    assert_eq!(
        db.actions().await,
        vec![
            (
                s("replay"),
                s("alice"),
                s("payload restored"),
                s("hookctl"),
                serde_json::json!([one])
            ),
            (
                s("set_dead_letter_status"),
                s("carol"),
                s("a test event"),
                s("hookctl"),
                serde_json::json!([two])
            ),
            (
                s("replay"),
                s("bob"),
                s("try once more"),
                s("function"),
                serde_json::json!([three])
            ),
            (
                s("tombstone"),
                s("dave"),
                s("deleted in the dashboard"),
                s("hookctl"),
                serde_json::json!(["evt_gone"])
            ),
        ]
    );
    let (outcome, invocation): (Value, Value) =
        sqlx::query_as("SELECT outcome, invocation FROM operator_actions WHERE actor = 'alice'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    // A replay runs as a job: its record holds the job's counts.
    assert_eq!(
        outcome,
        serde_json::json!({"selected": 1, "replayed": 1, "failed": 0, "skipped": 0,
                           "job_id": 1, "status": "finished", "estimate": 1})
    );
    assert_eq!(invocation, serde_json::json!({}));
    let (outcome, invocation): (Value, Value) =
        sqlx::query_as("SELECT outcome, invocation FROM operator_actions WHERE actor = 'bob'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(outcome["failed"], 1);
    assert!(
        invocation["request_id"]
            .as_str()
            .is_some_and(|id| id.starts_with("stand-in-request-")),
        "{invocation}"
    );
    assert_eq!(
        invocation["invoked_function_arn"],
        "arn:aws:lambda:eu-west-1:123456789012:function:webhooks-operator"
    );
    let created_by: String =
        sqlx::query_scalar("SELECT created_by FROM tombstones WHERE external_id = 'evt_gone'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(created_by, "operator:dave");
}

/// A dead letter's signature headers, with its payload, are a delivery anyone could post again:
/// `show` withholds them (and says which), directly and through the function.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn show_withholds_the_signature_headers(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let db = db(pool_options, connect).await;
    let body = db.poison("evt_1").await;
    ok(&db.hookctl(&["drain"]).await);
    db.fix("evt_1", &body).await;
    let stored: Value = sqlx::query_scalar("SELECT headers FROM dead_letters")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let signature = stored["stripe-signature"]
        .as_str()
        .expect("the letter keeps the signature it arrived with")
        .to_owned();
    let id = db.letter_ids().await["evt_1"].to_string();
    let (endpoint, _) = stand_in(db.pool.clone()).await;

    for shown in [
        db.hookctl(&["dead-letters", "show", &id, "--json"]).await,
        through(&endpoint, &["dead-letters", "show", &id, "--json"]).await,
        through(
            &endpoint,
            &[
                "operator",
                &format!(r#"{{"action":"show_dead_letter","dead_letter_id":{id}}}"#),
            ],
        )
        .await,
    ] {
        ok(&shown);
        assert!(!shown.stdout.contains(&signature), "{}", shown.stdout);
        let letter = &shown.json()["dead_letter"];
        assert_eq!(letter["headers"], serde_json::json!({}), "{letter}");
        assert_eq!(
            letter["withheld_headers"],
            serde_json::json!(["stripe-signature"])
        );
    }
    let table = db.hookctl(&["dead-letters", "show", &id]).await;
    ok(&table);
    assert!(!table.stdout.contains(&signature), "{}", table.stdout);
    assert!(
        table.stdout.contains("withheld     stripe-signature"),
        "{}",
        table.stdout
    );
}

/// A target that was down past the outbox's attempt budget: the on-call reads the finding, lists
/// the failed messages, resends one once the target is back and discards another, through the
/// operator function as against a deployed stack.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn failed_outbox_messages_are_listed_resent_and_discarded(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let db = db(pool_options, connect).await;
    for id in ["evt_1", "evt_2", "evt_3"] {
        db.deliver(id).await;
    }
    ok(&db.hookctl(&["drain"]).await);
    // Nothing listens there: each message's one try fails, and the budget is one try.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let down = format!("http://{}/hook", listener.local_addr().unwrap());
    drop(listener);
    let sender = shared::outbox::OutboxSender::new(
        db.pool.clone(),
        shared::outbox::OutboxSettings {
            max_attempts: 1,
            ..shared::outbox::OutboxSettings::new(down)
        },
    )
    .unwrap();
    let sent = sender
        .send_until(std::time::Instant::now() + std::time::Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(sent.failed, 3, "{sent:?}");
    let (endpoint, _) = stand_in(db.pool.clone()).await;

    let status = through(&endpoint, &["status"]).await;
    assert_eq!(status.code, Some(1), "{}", status.stdout);
    assert!(
        status.stdout.contains(
            "3 outbox message(s) failed for good: their side effect never reached the target\n      next: hookctl outbox list"
        ),
        "{}",
        status.stdout
    );

    let table = through(&endpoint, &["outbox", "list"]).await;
    ok(&table);
    for id in ["evt_1", "evt_2", "evt_3"] {
        assert!(table.stdout.contains(id), "{}", table.stdout);
    }
    assert!(table.stdout.contains("request failed"), "{}", table.stdout);
    let listed = through(&endpoint, &["outbox", "list", "--json"])
        .await
        .json();
    let failed = listed["failed_outbox"].as_array().unwrap();
    let id_of = |event: &str| {
        failed
            .iter()
            .find(|m| m["external_id"] == event)
            .and_then(|m| m["outbox_id"].as_i64())
            .unwrap()
    };
    let (first, second, third) = (id_of("evt_1"), id_of("evt_2"), id_of("evt_3"));

    let resent = through(
        &endpoint,
        &[
            "outbox",
            "resend",
            "--id",
            &first.to_string(),
            "--reason",
            "target is back",
            "--actor",
            "bob",
        ],
    )
    .await;
    ok(&resent);
    assert_eq!(
        resent.stdout,
        format!("resent 1 message(s): {first}: the next outbox run sends them\n")
    );
    let discarded = through(
        &endpoint,
        &[
            "outbox",
            "discard",
            &second.to_string(),
            &first.to_string(),
            "--reason",
            "order cancelled",
            "--actor",
            "bob",
        ],
    )
    .await;
    assert_eq!(discarded.code, Some(1), "{discarded:?}");
    assert_eq!(
        discarded.stdout,
        format!("discarded 1 message(s): {second}\nnot failed, left as they were: {first}\n")
    );
    let left = db.hookctl(&["outbox", "list", "--json"]).await.json();
    assert_eq!(left["failed_outbox"].as_array().unwrap().len(), 1);
    assert_eq!(left["failed_outbox"][0]["outbox_id"], third);

    ok(&db
        .hookctl_by(
            "carol",
            &[
                "outbox",
                "discard",
                &third.to_string(),
                "--reason",
                "duplicate",
            ],
        )
        .await);
    let s = |v: &str| v.to_owned();
    assert_eq!(
        db.actions().await,
        vec![
            (
                s("resend_outbox"),
                s("bob"),
                s("target is back"),
                s("function"),
                serde_json::json!([first])
            ),
            (
                s("discard_outbox"),
                s("bob"),
                s("order cancelled"),
                s("function"),
                serde_json::json!([second])
            ),
            (
                s("discard_outbox"),
                s("carol"),
                s("duplicate"),
                s("hookctl"),
                serde_json::json!([third])
            ),
        ]
    );
    let listed = db.hookctl(&["actions", "list", "--json"]).await;
    ok(&listed);
    let newest = &listed.json()["actions"][0];
    assert_eq!(newest["actor"], "carol");
    assert_eq!(newest["request"]["outbox_ids"], serde_json::json!([third]));
    let table = through(&endpoint, &["actions", "list"]).await;
    ok(&table);
    assert!(
        table
            .stdout
            .lines()
            .nth(1)
            .is_some_and(|l| l.contains("discard_outbox") && l.contains("carol")),
        "{}",
        table.stdout
    );
    let statuses: Vec<(i64, String)> =
        sqlx::query_as("SELECT outbox_id, status FROM outbox ORDER BY outbox_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let mut expected = vec![
        (first, "pending".to_owned()),
        (second, "discarded".to_owned()),
        (third, "discarded".to_owned()),
    ];
    expected.sort();
    assert_eq!(statuses, expected);
    let status = through(&endpoint, &["status"]).await;
    assert!(
        !status.stdout.contains("outbox message(s) failed"),
        "{}",
        status.stdout
    );
    assert_eq!(
        db.hookctl(&["outbox", "list"]).await.stdout,
        "no failed outbox messages\n"
    );
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_buffers_dead_letters_are_not_accounted_for_until_redriven(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let db = db(pool_options, connect).await;
    let (buffer, queue, dead_letters) = support::buffer_queues().await;
    // A delivery the consumer failed on five times: SQS moved it to the dead-letter queue.
    let delivery = support::pay_delivery("d-failed-five-times", br#"{"secret-looking":"body"}"#);
    buffer.send_to(&dead_letters, delivery).await.unwrap();
    let endpoint = std::env::var("MOTO_ENDPOINT").unwrap();
    let env = [
        ("DATABASE_URL", db.url.as_str()),
        ("USER", "oncall"),
        ("BUFFER_QUEUE_URL", queue.as_str()),
        ("BUFFER_DEAD_LETTER_QUEUE_URL", dead_letters.as_str()),
        ("SQS_ENDPOINT", endpoint.as_str()),
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_REGION", "us-east-1"),
    ];
    passes(&db).await;

    let status = run(&["status", "--json"], &env).await;
    assert_eq!(status.code, Some(1), "{}{}", status.stdout, status.stderr);
    let report = status.json();
    assert_eq!(report["buffer"]["dead_letters"], 1);
    let finding = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["kind"] == "buffer_dead_letters")
        .unwrap_or_else(|| panic!("no buffer finding: {report}"));
    assert!(
        finding["next"]
            .as_str()
            .unwrap()
            .contains("hookctl buffer redrive")
    );
    let human = run(&["status"], &env).await;
    assert!(human.stdout.contains("NOT accounted"), "{}", human.stdout);

    let listed = run(&["buffer", "list", "--json"], &env).await;
    ok(&listed);
    let letters = listed.json()["buffer_dead_letters"].clone();
    assert_eq!(letters.as_array().unwrap().len(), 1);
    assert_eq!(letters[0]["source_id"], "pay");
    assert_eq!(letters[0]["delivery_id"], "d-failed-five-times");
    assert!(!listed.stdout.contains("secret-looking"), "never the body");

    let refused = run(&["buffer", "redrive"], &env).await;
    assert_eq!(refused.code, Some(2), "a redrive needs a reason");
    let redriven = run(
        &["buffer", "redrive", "--reason", "consumer fixed", "--json"],
        &env,
    )
    .await;
    ok(&redriven);
    assert_eq!(redriven.json()["redriven"]["moved"], 1);
    let action = db.actions().await.pop().unwrap();
    assert_eq!(
        (action.0.as_str(), action.1.as_str(), action.2.as_str()),
        ("redrive_buffer", "oncall", "consumer fixed")
    );

    let status = run(&["status", "--json"], &env).await;
    let report = status.json();
    assert_eq!(report["buffer"]["dead_letters"], 0, "{report}");
    assert_eq!(
        report["buffer"]["waiting"], 1,
        "back in the buffer, for the consumer"
    );
    assert_eq!(status.code, Some(0), "{}", status.stdout);
}

/// Puts a datapoint of SQS's `ApproximateAgeOfOldestMessage` for a queue into moto's
/// CloudWatch, as SQS publishes it in AWS every minute.
async fn oldest_age_datapoint(queue_url: &str, seconds_ago: u64, age: f64) {
    use aws_sdk_cloudwatch::types::{Dimension, MetricDatum};
    let endpoint = shared::aws::AwsEndpoint {
        endpoint_url: Some(std::env::var("MOTO_ENDPOINT").unwrap()),
        region: Some("us-east-1".into()),
    };
    let cloudwatch = aws_sdk_cloudwatch::Client::new(&shared::aws::sdk_config(&endpoint).await);
    let at = std::time::SystemTime::now() - std::time::Duration::from_secs(seconds_ago);
    cloudwatch
        .put_metric_data()
        .namespace("AWS/SQS")
        .metric_data(
            MetricDatum::builder()
                .metric_name("ApproximateAgeOfOldestMessage")
                .dimensions(
                    Dimension::builder()
                        .name("QueueName")
                        .value(queue_url.rsplit('/').next().unwrap())
                        .build(),
                )
                .timestamp(aws_sdk_cloudwatch::primitives::DateTime::from(at))
                .value(age)
                .build(),
        )
        .send()
        .await
        .unwrap();
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn status_shows_how_long_the_oldest_buffered_delivery_has_waited(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let db = db(pool_options, connect).await;
    let (buffer, queue, dead_letters) = support::buffer_queues().await;
    let delivery = support::pay_delivery("d-waiting", br#"{"id":"evt_1"}"#);
    buffer.send(delivery).await.unwrap();
    let endpoint = std::env::var("MOTO_ENDPOINT").unwrap();
    let env = |cloudwatch: &str| {
        [
            ("DATABASE_URL", db.url.clone()),
            ("BUFFER_QUEUE_URL", queue.clone()),
            ("BUFFER_DEAD_LETTER_QUEUE_URL", dead_letters.clone()),
            ("SQS_ENDPOINT", endpoint.clone()),
            ("CLOUDWATCH_ENDPOINT", cloudwatch.to_owned()),
            ("AWS_ACCESS_KEY_ID", "testing".into()),
            ("AWS_SECRET_ACCESS_KEY", "testing".into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    };
    let status = |cloudwatch: String| {
        let env = env(&cloudwatch);
        async move {
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
            (
                run(&["status", "--json"], &env).await,
                run(&["status"], &env).await,
            )
        }
    };
    passes(&db).await;

    // No datapoint yet (a queue that just became active): counted, no age, accounted for.
    let (json, human) = status(endpoint.clone()).await;
    let report = json.json();
    assert_eq!(report["buffer"]["waiting"], 1, "{report}");
    assert!(report["buffer"]["oldest_age_seconds"].is_null(), "{report}");
    assert!(report["buffer"]["oldest_age_unknown"].is_null(), "{report}");
    assert_eq!(json.code, Some(0), "{}", json.stdout);
    assert!(
        human.stdout.contains("no CloudWatch datapoint"),
        "{}",
        human.stdout
    );

    // SQS says the oldest has waited 7 minutes, past the 300 s the alarm pages at.
    oldest_age_datapoint(&queue, 120, 420.0).await;
    let (json, human) = status(endpoint.clone()).await;
    let report = json.json();
    assert_eq!(report["buffer"]["oldest_age_seconds"], 420.0, "{report}");
    assert!(report["buffer"]["oldest_measured_at"].is_string());
    assert_eq!(json.code, Some(1), "{}", json.stdout);
    let finding = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["kind"] == "buffer_not_draining")
        .unwrap_or_else(|| panic!("no finding: {report}"));
    assert_eq!(finding["count"], 1);
    assert!(
        human.stdout.contains("oldest 7 min (CloudWatch"),
        "{}",
        human.stdout
    );

    // A newer datapoint: the consumer caught up, 12 s. The newest one counts.
    oldest_age_datapoint(&queue, 5, 12.0).await;
    let (json, _) = status(endpoint.clone()).await;
    let report = json.json();
    assert_eq!(report["buffer"]["oldest_age_seconds"], 12.0, "{report}");
    assert_eq!(json.code, Some(0), "{}", json.stdout);

    // CloudWatch unreachable (no NAT, no endpoint): the age is unknown and says why; the counts
    // still stand, and so does the verdict.
    let (json, human) = status("http://127.0.0.1:9".into()).await;
    let report = json.json();
    assert_eq!(report["buffer"]["waiting"], 1, "{report}");
    assert!(
        report["buffer"]["oldest_age_unknown"]
            .as_str()
            .is_some_and(|why| why.contains("CloudWatch GetMetricData")),
        "{report}"
    );
    assert_eq!(json.code, Some(0), "{}", json.stdout);
    assert!(human.stdout.contains("oldest unknown"), "{}", human.stdout);
}

/// A buffered event is not missing: while the buffer holds deliveries, a gap young enough for
/// the buffer's hold is in grace (as backfill treats it), and an older one still needs a human.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn status_counts_young_gaps_in_grace_while_the_buffer_holds_deliveries(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let db = db(pool_options, connect).await;
    let (buffer, queue, dead_letters) = support::buffer_queues().await;
    passes(&db).await;
    // Source grace 600 s + allowance 900 s: both are past it; only the first is within the
    // buffer's hold (3600 s + 900 s).
    for (id, minutes) in [("evt_gap_young", 30), ("evt_gap_old", 120)] {
        sqlx::query(
            "INSERT INTO gap_candidates (tenant_id, external_id, source_id, first_seen_at) \
             VALUES ('acme', $1, 'pay', now() - make_interval(mins => $2))",
        )
        .bind(id)
        .bind(minutes)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let endpoint = std::env::var("MOTO_ENDPOINT").unwrap();
    let env = [
        ("DATABASE_URL", db.url.as_str()),
        ("BUFFER_QUEUE_URL", queue.as_str()),
        ("BUFFER_DEAD_LETTER_QUEUE_URL", dead_letters.as_str()),
        ("SQS_ENDPOINT", endpoint.as_str()),
        ("CLOUDWATCH_ENDPOINT", endpoint.as_str()),
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_REGION", "us-east-1"),
    ];
    let gaps = |report: &serde_json::Value| {
        (
            report["open_gaps"].as_i64().unwrap(),
            report["gaps_in_grace"].as_i64().unwrap(),
            report["findings"]
                .as_array()
                .unwrap()
                .iter()
                .find(|f| f["kind"] == "open_gaps")
                .map(|f| f["count"].as_i64().unwrap()),
        )
    };

    // The buffer empty: both gaps are missing events.
    let status = run(&["status", "--json"], &env).await;
    assert_eq!(gaps(&status.json()), (2, 0, Some(2)), "{}", status.stdout);
    assert_eq!(status.code, Some(1));

    // A delivery waits in the buffer: the young gap may be it.
    let waiting = support::pay_delivery("d-gap", br#"{"id":"evt_gap_young"}"#);
    buffer.send(waiting).await.unwrap();
    let status = run(&["status", "--json"], &env).await;
    assert_eq!(gaps(&status.json()), (1, 1, Some(1)), "{}", status.stdout);
    assert_eq!(status.code, Some(1), "the old gap still needs a human");

    // The old one resolved: accounted for while the buffer holds the young one's chance.
    sqlx::query(
        "UPDATE gap_candidates SET status = 'tombstoned' WHERE external_id = 'evt_gap_old'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let status = run(&["status", "--json"], &env).await;
    assert_eq!(gaps(&status.json()), (0, 1, None), "{}", status.stdout);
    assert_eq!(status.code, Some(0), "{}", status.stdout);
}

/// `hookctl serve --sources` applies the file as `sources apply` does, guard included: a source
/// with stored events whose event id would be read another way is refused. The refusal names a
/// command that takes the change (`serve` has no flag of its own for it), and once that command
/// ran, `serve` starts with the same file.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn serve_refusing_a_changed_event_id_names_the_command_that_takes_it(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let db = db(pool_options, connect).await;
    db.deliver("evt_stored").await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sources.toml");
    std::fs::write(
        &file,
        "[[source]]\nid = 'pay'\ntenant = 'acme'\nscheme = 'stripe'\nsecret_ref = 'local/pay'\n\
         [source.fields]\nexternal_id = 'json:/data/object/id'\nentity_version = 'json:/data/object/version'\n",
    )
    .unwrap();
    let file = file.to_str().unwrap();
    let secrets = dir.path().join("secrets.toml");
    std::fs::write(
        &secrets,
        format!("[secrets.\"local/pay\"]\ncurrent = \"{SECRET}\"\n"),
    )
    .unwrap();
    let secrets = secrets.to_str().unwrap();
    let port = || {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let serve = |port: u16| {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_hookctl"));
        command
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--sources",
                file,
                "--secrets-file",
                secrets,
            ])
            .env("DATABASE_URL", &db.url)
            .env_remove("RUST_LOG")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        command
    };

    let refused = tokio::time::timeout(std::time::Duration::from_secs(60), serve(port()).output())
        .await
        .expect("serve stops at the refusal")
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{stderr}");
    assert!(
        stderr.contains("would store every redelivery of those events again")
            && stderr.contains("hookctl sources apply --change-event-ids"),
        "{stderr}"
    );

    let taken = db
        .hookctl(&["sources", "apply", "--change-event-ids", file])
        .await;
    assert_eq!(taken.code, Some(0), "{taken:?}");

    let port = port();
    let mut running = serve(port).spawn().unwrap();
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        if let Some(status) = running.try_wait().unwrap() {
            let mut stderr = String::new();
            tokio::io::AsyncReadExt::read_to_string(running.stderr.as_mut().unwrap(), &mut stderr)
                .await
                .unwrap();
            panic!("serve exited ({status}) after the change was taken: {stderr}");
        }
        assert!(std::time::Instant::now() < give_up, "serve did not listen");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    running.kill().await.unwrap();
}

/// `hookctl buffer file-kept` files a delivery an anomaly kept (here as a release before it
/// existed kept one: source disabled meanwhile, no headers), directly and through the operator
/// function, attributed; filing it twice is refused (exit 2), and what it filed is an event.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_kept_delivery_is_filed_by_hookctl_directly_and_through_the_function(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let db = db(pool_options, connect).await;
    let kept = |id: &'static str| {
        let pool = db.pool.clone();
        async move {
            let body = format!(
                r#"{{"id":"{id}","type":"payment_intent.succeeded","data":{{"object":{{"version":1}}}}}}"#
            );
            sqlx::query_scalar::<_, i64>(
                "INSERT INTO ingest_anomalies (tenant_id, source_id, kind, payload_sha256, payload, detail) \
                 VALUES ('acme', 'pay', 'buffered_source_unavailable', sha256($1), $1, 'disabled meanwhile') \
                 RETURNING anomaly_id",
            )
            .bind(body.into_bytes())
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let (direct, remote) = (kept("evt_kept_1").await, kept("evt_kept_2").await);
    let filed = db
        .hookctl(&[
            "buffer",
            "file-kept",
            &direct.to_string(),
            "--reason",
            "source re-enabled",
            "--actor",
            "alice",
        ])
        .await;
    ok(&filed);
    assert_eq!(
        filed.stdout,
        format!("filed anomaly {direct} as event evt_kept_1 of source pay (accepted)\n")
    );
    let (endpoint, _) = stand_in(db.pool.clone()).await;
    let args = [
        "buffer",
        "file-kept",
        &remote.to_string(),
        "--reason",
        "source re-enabled",
        "--actor",
        "bob",
    ];
    ok(&through(&endpoint, &args).await);
    let again = through(&endpoint, &args).await;
    assert_eq!(again.code, Some(2), "{again:?}");
    assert!(again.stderr.contains("filed already"), "{}", again.stderr);

    let stored: Vec<(String, String)> =
        sqlx::query_as("SELECT external_id, status FROM webhook_events ORDER BY external_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        stored,
        vec![
            ("evt_kept_1".to_owned(), "pending".to_owned()),
            ("evt_kept_2".to_owned(), "pending".to_owned())
        ]
    );
    let actors: Vec<String> = sqlx::query_scalar(
        "SELECT actor FROM operator_actions WHERE action = 'file_kept' ORDER BY actor",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(actors, ["alice", "bob"]);
}

/// `hookctl refused` after the provider rotated its secret and nothing landed since: the last
/// day's refusals of the source, read as a secret that is not the provider's; `--json` for a
/// script.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn refused_deliveries_read_as_a_secret_that_is_not_the_providers(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let db = db(pool_options, connect).await;
    let body = br#"{"id":"evt_rotated","object":"event","type":"charge.succeeded"}"#;
    let refused = support::post_stripe(
        &db.ingestor,
        "pay",
        "whsec_rotated_at_the_provider",
        "evt_rotated",
        body,
    )
    .await;
    assert!(refused.is_err());

    let out = db.hookctl(&["refused"]).await;
    ok(&out);
    assert!(out.stdout.contains("no_match"), "{}", out.stdout);
    assert!(
        out.stdout
            .contains("is the source's secret the provider's?"),
        "{}",
        out.stdout
    );
    let json = db.hookctl(&["--json", "refused", "--source", "pay"]).await;
    ok(&json);
    let answer = json.json();
    assert_eq!(answer["refused"][0]["status"], 401);
    assert_eq!(answer["last_day"][0]["refused_last_day"], 1);
}

/// `hookctl providers ranges refresh` reads the list a source uses (here Stripe's, from a local
/// stand-in named with `--url`) in one recorded pass; `hookctl providers ranges` lists what is
/// kept, when it was read and who checks it; a stand-in answering 500 keeps the list and exits 1.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn providers_ranges_refresh_reads_the_list_and_ranges_lists_it(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let db = db(pool_options, connect).await;
    let status = Arc::new(std::sync::atomic::AtomicU16::new(200));
    let answering = status.clone();
    let app = axum::Router::new().route(
        "/ips_webhooks.json",
        axum::routing::get(move || {
            let status = answering.load(std::sync::atomic::Ordering::SeqCst);
            async move {
                (
                    StatusCode::from_u16(status).unwrap(),
                    r#"{"WEBHOOKS":["3.18.12.63","3.130.192.231"]}"#,
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "stripe=http://{}/ips_webhooks.json",
        listener.local_addr().unwrap()
    );
    tokio::spawn(async move { axum::serve(listener, app).await });

    let never = db.hookctl(&["providers", "ranges"]).await;
    ok(&never);
    assert!(
        never
            .stdout
            .contains("stripe\tnever read\t0 range(s)\tread never")
            && never.stdout.contains("checked by: pay (observe)"),
        "{}",
        never.stdout
    );

    let refreshed = db
        .hookctl(&["providers", "ranges", "refresh", "--url", &url])
        .await;
    ok(&refreshed);
    let run = refreshed.json();
    assert_eq!(run["result"], "completed", "{run}");
    assert_eq!(run["outcome"]["fetched"], 1, "{run}");
    let listed = db.hookctl(&["providers", "ranges"]).await;
    ok(&listed);
    assert!(
        listed.stdout.contains("stripe\tfresh\t2 range(s)\tread 20"),
        "{}",
        listed.stdout
    );
    let json = db.hookctl(&["--json", "providers", "ranges"]).await;
    let stripe = json.json()["providers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["provider"] == "stripe")
        .cloned()
        .unwrap();
    assert_eq!(stripe["ranges"], 2, "{stripe}");
    assert!(stripe["fetched_at"].is_string(), "{stripe}");

    status.store(500, std::sync::atomic::Ordering::SeqCst);
    let failed = db
        .hookctl(&["providers", "ranges", "refresh", "--url", &url])
        .await;
    assert_eq!(failed.code, Some(1), "{}{}", failed.stdout, failed.stderr);
    assert_eq!(failed.json()["outcome"]["failed"][0], "stripe");
    let kept = db.hookctl(&["providers", "ranges"]).await;
    assert!(
        kept.stdout.contains("stripe\tfresh\t2 range(s)")
            && kept.stdout.contains("1 failed tries, last: answered 500"),
        "{}",
        kept.stdout
    );
}
