//! Release binary size and cold start of every function, beside an empty lambda_http
//! hello-world built the same way, each run under a local Lambda Runtime API emulator (this
//! file): the process is spawned with AWS_LAMBDA_RUNTIME_API pointing here; "init" is spawn →
//! its first `GET /runtime/invocation/next`, "first invoke" is handing it the event → its
//! response (database connection included: pools connect lazily). Median of 5 cold starts.
//!
//! Run: `./scripts/bench coldstart` (builds the release binaries first; needs DATABASE_URL).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use shared::domain::Scheme;
use shared::secrets::SigningSecret;

#[derive(Default)]
struct Emulator {
    event: serde_json::Value,
    served_at: Option<Instant>,
    first_next: Option<Instant>,
    responded: Option<(Instant, String)>,
    error: Option<String>,
}

type Shared = Arc<Mutex<Emulator>>;

async fn next(State(s): State<Shared>) -> impl IntoResponse {
    let (event, first) = {
        let mut e = s.lock().unwrap();
        let first = e.first_next.is_none();
        if first {
            e.first_next = Some(Instant::now());
        }
        (e.event.clone(), first)
    };
    if !first {
        // The function came back for more: hold it until it is killed.
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
    s.lock().unwrap().served_at = Some(Instant::now());
    let mut headers = HeaderMap::new();
    let deadline = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        + 60_000;
    headers.insert(
        "lambda-runtime-aws-request-id",
        HeaderValue::from_static("coldstart-1"),
    );
    headers.insert(
        "lambda-runtime-deadline-ms",
        HeaderValue::from_str(&deadline.to_string()).unwrap(),
    );
    headers.insert(
        "lambda-runtime-invoked-function-arn",
        HeaderValue::from_static("arn:aws:lambda:us-east-1:123456789012:function:f"),
    );
    headers.insert(
        "lambda-runtime-trace-id",
        HeaderValue::from_static("Root=1-00000000-000000000000000000000000"),
    );
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    (headers, serde_json::to_vec(&event).unwrap())
}

async fn response(State(s): State<Shared>, Path(_id): Path<String>, body: String) -> StatusCode {
    s.lock().unwrap().responded = Some((Instant::now(), body));
    StatusCode::ACCEPTED
}

async fn error(State(s): State<Shared>, body: String) -> StatusCode {
    s.lock().unwrap().error = Some(body);
    StatusCode::ACCEPTED
}

fn scheduled() -> serde_json::Value {
    serde_json::json!({"version": "0", "id": "1", "detail-type": "Scheduled Event", "source": "aws.events",
        "account": "123456789012", "time": "2026-11-30T12:00:00Z", "region": "us-east-1", "resources": [], "detail": {}})
}

fn http_event(path: &str, headers: serde_json::Value, body: &str) -> serde_json::Value {
    serde_json::json!({
        "version": "2.0", "routeKey": "POST /webhooks/{source_id}", "rawPath": path, "rawQueryString": "",
        "headers": headers, "pathParameters": {"source_id": "bench"},
        "requestContext": {"accountId": "123456789012", "apiId": "api", "domainName": "example.com", "domainPrefix": "example",
            "http": {"method": "POST", "path": path, "protocol": "HTTP/1.1", "sourceIp": "127.0.0.1", "userAgent": "bench"},
            "requestId": "r", "routeKey": "POST /webhooks/{source_id}", "stage": "$default", "time": "30/Nov/2026:12:00:00 +0000", "timeEpoch": 0},
        "body": body, "isBase64Encoded": false
    })
}

/// One cold start: (init, first invocation), or why it failed.
async fn cold_start(
    binary: &PathBuf,
    event: serde_json::Value,
    env: &BTreeMap<&str, String>,
) -> Result<(Duration, Duration), String> {
    let state: Shared = Arc::new(Mutex::new(Emulator {
        event,
        ..Emulator::default()
    }));
    let app = axum::Router::new()
        .route("/2018-06-01/runtime/invocation/next", get(next))
        .route(
            "/2018-06-01/runtime/invocation/{id}/response",
            post(response),
        )
        .route("/2018-06-01/runtime/invocation/{id}/error", post(error))
        .route("/2018-06-01/runtime/init/error", post(error))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api = listener.local_addr().unwrap().to_string();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let spawned = Instant::now();
    let mut child = tokio::process::Command::new(binary)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env("AWS_LAMBDA_RUNTIME_API", &api)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| e.to_string())?;
    let give_up = Instant::now() + Duration::from_secs(30);
    let result = loop {
        tokio::time::sleep(Duration::from_millis(2)).await;
        let s = state.lock().unwrap();
        if let Some(e) = &s.error {
            break Err(e.clone());
        }
        if let (Some(first), Some(served), Some((done, _))) =
            (s.first_next, s.served_at, &s.responded)
        {
            break Ok((first - spawned, *done - served));
        }
        if Instant::now() > give_up {
            break Err("timed out".into());
        }
    };
    let _ = child.kill().await;
    server.abort();
    result
}

/// Makes the first event of each cold start.
type EventMaker = Box<dyn FnMut() -> serde_json::Value>;

#[tokio::main]
async fn main() {
    let target = PathBuf::from(
        std::env::var("CARGO_TARGET_DIR")
            .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../target").into()),
    )
    .join("release");
    let db = benchmarks::BenchDatabase::create("bench_coldstart").await;
    let pool = db.pool.clone();
    let source = benchmarks::source(Scheme::Github, Duration::from_secs(300));
    shared::sources::apply(&pool, &[source]).await.unwrap();
    let secrets =
        std::env::temp_dir().join(format!("coldstart-secrets-{}.toml", std::process::id()));
    std::fs::write(&secrets, "[secrets.bench]\ncurrent = \"bench-secret\"\n").unwrap();
    let database_url = db.url();
    let env: BTreeMap<&str, String> = [
        ("AWS_LAMBDA_FUNCTION_NAME", "bench".to_owned()),
        ("AWS_LAMBDA_FUNCTION_VERSION", "$LATEST".into()),
        ("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "256".into()),
        ("AWS_LAMBDA_LOG_GROUP_NAME", "/aws/lambda/bench".into()),
        ("AWS_LAMBDA_LOG_STREAM_NAME", "bench".into()),
        ("AWS_REGION", "us-east-1".into()),
        ("AWS_ACCESS_KEY_ID", "bench".into()),
        ("AWS_SECRET_ACCESS_KEY", "bench".into()),
        ("AWS_EC2_METADATA_DISABLED", "true".into()),
        ("DATABASE_URL", database_url),
        ("SECRETS_BACKEND", "file".into()),
        ("SECRETS_FILE", secrets.display().to_string()),
        ("OUTBOX_TARGET_URL", "http://127.0.0.1:9/".into()),
        ("RUST_LOG", "warn".into()),
    ]
    .into_iter()
    .collect();

    println!(
        "release binaries (x86_64 here; arm64 builds are similar), cold start under a local Runtime API emulator, median of 5"
    );
    println!(
        "{:<14} {:>10} {:>10} {:>16}   first event",
        "binary", "size MiB", "init ms", "first invoke ms"
    );
    let mut n = 0;
    let mut runs: Vec<(&str, EventMaker)> = vec![
        (
            "hello-lambda",
            Box::new(|| http_event("/hello", serde_json::json!({}), "")),
        ),
        (
            "ingest",
            Box::new(move || {
                n += 1;
                let body = format!("{{\"action\":\"opened\",\"n\":{n}}}");
                let sig: Vec<_> = shared::signature::sign(
                    Scheme::Github,
                    &SigningSecret::new("bench-secret"),
                    "",
                    0,
                    body.as_bytes(),
                )
                .unwrap();
                let headers = serde_json::json!({
                    "content-type": "application/json", "x-github-event": "issues",
                    "x-github-delivery": format!("coldstart-{}-{n}", std::process::id()),
                    "x-hub-signature-256": sig[0].1.to_str().unwrap(),
                });
                http_event("/webhooks/bench", headers, &body)
            }),
        ),
        ("drain", Box::new(scheduled)),
        ("outbox", Box::new(scheduled)),
        ("reconcile", Box::new(scheduled)),
        ("backfill", Box::new(scheduled)),
        ("retention", Box::new(scheduled)),
        ("anomaly", Box::new(scheduled)),
        (
            "operator",
            Box::new(|| serde_json::json!({"action": "list_dead_letters"})),
        ),
        ("migrate", Box::new(|| serde_json::json!({}))),
    ];
    for (name, event) in runs.iter_mut() {
        let name: &str = name;
        let binary = target.join(name);
        let size = std::fs::metadata(&binary)
            .map(|m| m.len() as f64 / 1048576.0)
            .unwrap_or_else(|_| panic!("{} is not built", binary.display()));
        let mut inits = Vec::new();
        let mut invokes = Vec::new();
        let mut outcome = String::new();
        for _ in 0..5 {
            match cold_start(&binary, event(), &env).await {
                Ok((init, invoke)) => {
                    inits.push(init.as_secs_f64() * 1e3);
                    invokes.push(invoke.as_secs_f64() * 1e3);
                }
                Err(e) => outcome = format!("FAILED: {e}"),
            }
        }
        if inits.is_empty() {
            println!("{name:<14} {size:>10.1} {outcome}");
            continue;
        }
        println!(
            "{name:<14} {size:>10.1} {:>10.1} {:>16.1}   {outcome}",
            benchmarks::median(&mut inits),
            benchmarks::median(&mut invokes)
        );
    }
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_events")
        .fetch_one(&pool)
        .await
        .unwrap();
    println!(
        "ingest cold starts stored {stored} events (each first invocation was a real accepted delivery)"
    );
    let _ = std::fs::remove_file(&secrets);
    db.drop().await;
}
