//! `hookctl console`: the operator's page, served on loopback. One binary, its assets embedded
//! (`cli/console/`, plain HTML, CSS and JavaScript: no build step), and one JSON endpoint that
//! takes the operator's requests (`shared::operator::OperatorRequest`) and answers them through
//! the same [`Backend`] every other operator command uses: `DATABASE_URL`, or the deployed
//! operator function with `--function`. The page composes requests; the server decides what
//! it may ask.
//!
//! Who may ask:
//! - Only a page on loopback: a request whose `Host` is not `127.0.0.1`, `localhost` or `[::1]`
//!   at the console's port is refused (403), so a DNS name rebound to 127.0.0.1 reaches nothing.
//! - Only the person who started it: the URL printed at start carries a one-time token, which
//!   the page exchanges (`POST /session`) for a `SameSite=Strict`, `HttpOnly` cookie. The token
//!   works once; every API call needs the cookie (401 without).
//! - Writes only when started with `--write` (403 otherwise), only from the console's own
//!   origin (`Origin` checked, 403), and each with a reason (400 without). The actor is the
//!   console's (`--actor`, else the OS user), whatever the page sends: every write lands in
//!   `operator_actions` as the CLI's do.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use shared::operator::OperatorRequest;

use crate::backend::{Backend, CallError};

/// The session cookie's name.
pub const COOKIE: &str = "hookctl_console";

const INDEX_HTML: &str = include_str!("../console/index.html");
const CONSOLE_JS: &str = include_str!("../console/console.js");
const CONSOLE_CSS: &str = include_str!("../console/console.css");
/// The operating manual: the console shows its text on each anomaly check beside the check.
const OPERATING_MD: &str = include_str!("../../docs/operating.md");

/// The heading of the manual's table of checks ([`check_help`]).
pub const CHECKS_HEADING: &str = "### The checks: what each means and what to do";

/// What the operating manual says of each anomaly check: its table under [`CHECKS_HEADING`],
/// one row per check (`` | `name` | family | what it means | what to do | ``), as
/// `{name: {"family", "means", "do"}}`.
pub fn check_help() -> serde_json::Map<String, Value> {
    let mut help = serde_json::Map::new();
    let Some((_, section)) = OPERATING_MD.split_once(CHECKS_HEADING) else {
        return help;
    };
    let rows = section
        .lines()
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'));
    for row in rows {
        let cells: Vec<&str> = row.trim_matches('|').split(" | ").map(str::trim).collect();
        let [name, family, means, todo] = cells.as_slice() else {
            continue;
        };
        let Some(name) = name.strip_prefix('`').and_then(|n| n.strip_suffix('`')) else {
            continue;
        };
        help.insert(
            name.to_owned(),
            json!({ "family": family, "means": means, "do": todo }),
        );
    }
    help
}

/// How the console was started.
#[derive(Debug, Clone)]
pub struct ConsoleOptions {
    /// Whether state-changing requests are answered.
    pub write: bool,
    /// Who writes: recorded with every change.
    pub actor: String,
}

/// The console's state: where answers come from, the one-time token, the sessions it opened.
pub struct Console {
    backend: Backend,
    options: ConsoleOptions,
    port: u16,
    token: Mutex<Option<String>>,
    sessions: Mutex<HashSet<String>>,
}

/// A console bound to `listener`'s port, and the URL (with its one-time token) to open.
pub fn console(
    backend: Backend,
    options: ConsoleOptions,
    local: SocketAddr,
) -> (Arc<Console>, String) {
    let token = random_hex();
    let url = format!("http://127.0.0.1:{}/#token={token}", local.port());
    let console = Arc::new(Console {
        backend,
        options,
        port: local.port(),
        token: Mutex::new(Some(token)),
        sessions: Mutex::new(HashSet::new()),
    });
    (console, url)
}

/// The console's routes: the page and its assets, `POST /session`, `POST /api/operator`, and
/// `GET /api/whoami` and `GET /api/check-help`.
pub fn router(console: Arc<Console>) -> Router {
    Router::new()
        .route(
            "/",
            get(|| async { page(INDEX_HTML, "text/html; charset=utf-8") }),
        )
        .route(
            "/console.js",
            get(|| async { page(CONSOLE_JS, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/console.css",
            get(|| async { page(CONSOLE_CSS, "text/css; charset=utf-8") }),
        )
        .route("/session", post(open_session))
        .route("/api/operator", post(operate))
        .route("/api/whoami", get(whoami))
        .route("/api/check-help", get(check_help_page))
        .layer(middleware::from_fn_with_state(
            console.clone(),
            loopback_host,
        ))
        .with_state(console)
}

/// Serves the console on `listener` until the task is dropped.
pub async fn serve(
    listener: tokio::net::TcpListener,
    console: Arc<Console>,
) -> std::io::Result<()> {
    axum::serve(listener, router(console)).await
}

fn page(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(
                    "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
                ),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
        ],
        body,
    )
        .into_response()
}

/// 32 random bytes, hex.
fn random_hex() -> String {
    let bytes: [u8; 32] = rand::random();
    hex::encode(bytes)
}

fn refused(status: StatusCode, why: &str) -> Response {
    (status, axum::Json(json!({ "error": why }))).into_response()
}

/// Refuses any request whose `Host` is not loopback at the console's port (DNS rebinding).
async fn loopback_host(
    State(console): State<Arc<Console>>,
    request: Request,
    next: Next,
) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if !console.own_hosts().iter().any(|own| own == host) {
        return refused(
            StatusCode::FORBIDDEN,
            "this console answers only on loopback",
        );
    }
    next.run(request).await
}

impl Console {
    /// The `Host` values a page on this machine sends.
    fn own_hosts(&self) -> [String; 3] {
        let port = self.port;
        [
            format!("127.0.0.1:{port}"),
            format!("localhost:{port}"),
            format!("[::1]:{port}"),
        ]
    }

    /// Whether the request carries a session this console opened.
    fn has_session(&self, headers: &HeaderMap) -> bool {
        let Some(session) = cookie(headers, COOKIE) else {
            return false;
        };
        self.sessions
            .lock()
            .map(|sessions| sessions.contains(session))
            .unwrap_or(false)
    }
}

/// A cookie's value from the `Cookie` headers.
fn cookie<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value)
}

/// `POST /session {"token": ...}`: the one-time token for a session cookie. The token works
/// once.
async fn open_session(State(console): State<Arc<Console>>, body: Bytes) -> Response {
    let offered = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("token")?.as_str().map(str::to_owned))
        .unwrap_or_default();
    let taken = {
        let Ok(mut token) = console.token.lock() else {
            return refused(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the console's state is broken",
            );
        };
        let matches = token.as_deref().is_some_and(|expected| {
            bool::from(subtle::ConstantTimeEq::ct_eq(
                expected.as_bytes(),
                offered.as_bytes(),
            ))
        });
        if matches { token.take() } else { None }
    };
    if taken.is_none() {
        return refused(
            StatusCode::UNAUTHORIZED,
            "this link was used already or is not this console's: start `hookctl console` again",
        );
    }
    let session = random_hex();
    if let Ok(mut sessions) = console.sessions.lock() {
        sessions.insert(session.clone());
    }
    let cookie = format!("{COOKIE}={session}; Path=/; HttpOnly; SameSite=Strict");
    (
        StatusCode::NO_CONTENT,
        [(
            header::SET_COOKIE,
            HeaderValue::from_str(&cookie).unwrap_or(HeaderValue::from_static("")),
        )],
    )
        .into_response()
}

/// `GET /api/whoami`: whether writes are allowed and who they are recorded as.
async fn whoami(State(console): State<Arc<Console>>, headers: HeaderMap) -> Response {
    if !console.has_session(&headers) {
        return refused(
            StatusCode::UNAUTHORIZED,
            "no session: open the URL hookctl printed",
        );
    }
    axum::Json(json!({
        "write": console.options.write,
        "actor": console.options.actor,
        "backend": console.backend.describe(),
    }))
    .into_response()
}

/// `GET /api/check-help`: the manual's text on every anomaly check ([`check_help`]).
async fn check_help_page(State(console): State<Arc<Console>>, headers: HeaderMap) -> Response {
    if !console.has_session(&headers) {
        return refused(
            StatusCode::UNAUTHORIZED,
            "no session: open the URL hookctl printed",
        );
    }
    axum::Json(Value::Object(check_help())).into_response()
}

/// `POST /api/operator`: one operator request, answered as `hookctl operator` answers it.
async fn operate(State(console): State<Arc<Console>>, headers: HeaderMap, body: Bytes) -> Response {
    if !console.has_session(&headers) {
        return refused(
            StatusCode::UNAUTHORIZED,
            "no session: open the URL hookctl printed",
        );
    }
    let mut value: Value = match serde_json::from_slice(&body) {
        Ok(value) => value,
        Err(e) => return refused(StatusCode::BAD_REQUEST, &format!("not JSON: {e}")),
    };
    let request: OperatorRequest = match serde_json::from_value(value.clone()) {
        Ok(request) => request,
        Err(e) => return refused(StatusCode::BAD_REQUEST, &format!("not a request: {e}")),
    };
    if request.changes_state() {
        if !console.options.write {
            return refused(
                StatusCode::FORBIDDEN,
                "this console is read-only: start it with --write to change anything",
            );
        }
        let origin = headers
            .get(header::ORIGIN)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        if !console
            .own_hosts()
            .iter()
            .any(|host| origin == format!("http://{host}"))
        {
            return refused(
                StatusCode::FORBIDDEN,
                "a change is answered only from the console's own page",
            );
        }
        let reason = value
            .get("reason")
            .and_then(Value::as_str)
            .map(str::trim)
            .unwrap_or_default();
        if reason.is_empty() {
            return refused(StatusCode::BAD_REQUEST, "a change needs a reason");
        }
        if let Some(fields) = value.as_object_mut() {
            // `operator` is the tombstone's older name for the actor: one name, the console's.
            fields.remove("operator");
            fields.insert("actor".into(), Value::String(console.options.actor.clone()));
        }
    }
    let request: OperatorRequest = match serde_json::from_value(value) {
        Ok(request) => request,
        Err(e) => return refused(StatusCode::BAD_REQUEST, &format!("not a request: {e}")),
    };
    let starts_a_job = matches!(request, OperatorRequest::StartJob { .. });
    match console.backend.call_json(&request).await {
        Ok(answer) => {
            if starts_a_job && let Some(job_id) = answer["job"]["job_id"].as_i64() {
                tokio::spawn(run_job(console.clone(), job_id));
            }
            axum::Json(answer).into_response()
        }
        Err(CallError::BadRequest(why)) => refused(StatusCode::BAD_REQUEST, &why),
        Err(e) => refused(StatusCode::BAD_GATEWAY, &e.to_string()),
    }
}

/// Runs a job the page started, through the backend, until it finishes or is aborted
/// ([`Backend::run_job`]); the page reads its progress with `show_job`. A step that fails is
/// logged, and the job stays running where it stopped.
async fn run_job(console: Arc<Console>, job_id: i64) {
    if let Err(error) = console.backend.run_job(job_id, |_| {}).await {
        tracing::warn!(job_id, %error, "a job's step failed: the job stops here; run_job resumes it");
    }
}
