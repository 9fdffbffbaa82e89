//! A GitHub webhook, simulated: one hook (a repository's, an organisation's or a GitHub App's)
//! that signs and delivers events to a receiver, records every delivery attempt, never retries
//! a failed one, and serves GitHub's deliveries API:
//!
//! - `GET {hook}/deliveries?per_page=&cursor=`: newest first, paged by a `Link: rel="next"`
//!   header, each delivery with its numeric `id` and the event's `guid`;
//! - `POST {hook}/deliveries/{id}/attempts`: 202, then the event is delivered again, signed,
//!   under the same GUID (before answering here, so a test need not wait); 404 for a delivery
//!   GitHub no longer keeps.
//!
//! Repository and organisation hooks take a bearer token; an App's hook only an RS256 JSON Web
//! Token issued by the App (checked against the App's public key, its issuer and its expiry).
//! Every request must carry a User-Agent, as GitHub's API requires.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine as _;
use chrono::{DateTime, SecondsFormat, TimeDelta, Utc};
use serde_json::{Value, json};
use shared::domain::Scheme;
use shared::secrets::SigningSecret;

/// Who may call the hook's API.
#[derive(Debug, Clone)]
pub enum HookAuth {
    Token(String),
    /// A GitHub App: its id (the JWT's issuer) and public key (DER `RSAPublicKey`).
    App {
        app_id: String,
        public_key: Vec<u8>,
    },
}

#[derive(Debug, Clone)]
pub struct HookConfig {
    /// `/repos/{owner}/{repo}/hooks/{id}`, `/orgs/{org}/hooks/{id}` or `/app/hook`.
    pub path: String,
    pub signing_secret: String,
    pub auth: HookAuth,
    /// Events 1..=events, each an `issues` event with its own GUID.
    pub events: u64,
}

/// One delivery attempt, as GitHub records it.
#[derive(Debug, Clone)]
pub struct HookDelivery {
    pub id: i64,
    pub guid: String,
    pub delivered_at: DateTime<Utc>,
    pub redelivery: bool,
    pub status_code: u16,
}

struct HookEvent {
    guid: String,
    body: Vec<u8>,
}

#[derive(Default)]
struct HookState {
    /// Oldest first.
    deliveries: Vec<HookDelivery>,
    /// GUIDs whose deliveries GitHub no longer keeps.
    expired: HashSet<String>,
    /// (delivery id, GUID) of every redelivery asked for, answered or not.
    redeliveries: Vec<(i64, String)>,
    /// Every list request's `cursor` (None: the first page).
    cursors: Vec<Option<String>>,
    target: Option<String>,
}

pub struct GithubHook {
    config: HookConfig,
    events: Vec<HookEvent>,
    state: Mutex<HookState>,
    http: reqwest::Client,
}

/// The GUID of event `n` of a hook: GitHub's are UUIDs.
pub fn guid(n: u64) -> String {
    format!("58474f00-b361-11eb-8000-{n:012x}")
}

impl GithubHook {
    pub fn new(config: HookConfig) -> Arc<Self> {
        let events = (1..=config.events)
            .map(|n| HookEvent {
                guid: guid(n),
                body: serde_json::to_vec(&json!({
                    "action": "opened",
                    "issue": {"number": n, "title": format!("issue {n}")},
                    "repository": {"id": 1, "full_name": "acme/api"}
                }))
                .expect("JSON"),
            })
            .collect();
        Arc::new(Self {
            config,
            events,
            state: Mutex::default(),
            http: reqwest::Client::new(),
        })
    }

    /// Delivers every event once to `url`, oldest first, `age` ago; an event `fails` picks is
    /// recorded as a failed attempt (the receiver was down) and never retried.
    pub async fn deliver(&self, url: &str, age: TimeDelta, fails: impl Fn(u64) -> bool) {
        self.state.lock().unwrap().target = Some(url.to_owned());
        let at = Utc::now() - age;
        for (i, event) in self.events.iter().enumerate() {
            let n = i as u64 + 1;
            let status_code = if fails(n) {
                502
            } else {
                self.post(url, event).await
            };
            self.record(&event.guid, at, false, status_code);
        }
    }

    /// GitHub keeps deliveries for a few days: redelivering this event answers 404.
    pub fn expire(&self, guid: &str) {
        self.state.lock().unwrap().expired.insert(guid.to_owned());
    }

    /// Every delivery attempt, oldest first.
    pub fn deliveries(&self) -> Vec<HookDelivery> {
        self.state.lock().unwrap().deliveries.clone()
    }

    /// (delivery id, GUID) of every redelivery asked for.
    pub fn redeliveries(&self) -> Vec<(i64, String)> {
        self.state.lock().unwrap().redeliveries.clone()
    }

    /// The cursor of every list request (None: a first page).
    pub fn cursors(&self) -> Vec<Option<String>> {
        self.state.lock().unwrap().cursors.clone()
    }

    fn record(&self, guid: &str, at: DateTime<Utc>, redelivery: bool, status_code: u16) -> i64 {
        let mut state = self.state.lock().unwrap();
        let id = 1000 + state.deliveries.len() as i64;
        state.deliveries.push(HookDelivery {
            id,
            guid: guid.to_owned(),
            delivered_at: at,
            redelivery,
            status_code,
        });
        id
    }

    /// POSTs the event as GitHub does; the receiver's status (502 when unreachable).
    async fn post(&self, url: &str, event: &HookEvent) -> u16 {
        let secret = SigningSecret::new(self.config.signing_secret.clone());
        let signed = shared::signature::sign(Scheme::Github, &secret, "", 0, &event.body)
            .expect("GitHub signing takes any secret");
        let hook_id = self.config.path.rsplit('/').next().unwrap_or("0");
        let mut request = self
            .http
            .post(url)
            .header("content-type", "application/json")
            .header("user-agent", "GitHub-Hookshot/0f4a2c1")
            .header("x-github-delivery", &event.guid)
            .header("x-github-event", "issues")
            .header("x-github-hook-id", hook_id)
            .body(event.body.clone());
        for (name, value) in signed {
            request = request.header(name, value);
        }
        match request.send().await {
            Ok(r) => r.status().as_u16(),
            Err(_) => 502,
        }
    }

    /// The hook's deliveries API, at the hook's path.
    pub fn router(self: Arc<Self>) -> Router {
        let path = self.config.path.trim_end_matches('/').to_owned();
        Router::new()
            .route(&format!("{path}/deliveries"), get(list))
            .route(
                &format!("{path}/deliveries/{{delivery_id}}/attempts"),
                post(redeliver),
            )
            .with_state(self)
    }

    /// Serves the API on an ephemeral 127.0.0.1 port; returns its base URL.
    pub async fn serve(self: Arc<Self>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        tokio::spawn(async move { axum::serve(listener, self.router()).await });
        url
    }

    /// GitHub's answer to a request without the right credentials, or without a User-Agent.
    fn refused(&self, headers: &HeaderMap) -> Option<Response> {
        if !headers.contains_key("user-agent") {
            return Some(
                (
                    StatusCode::FORBIDDEN,
                    axum::Json(json!({"message": "Request forbidden by administrative rules. Please make sure your request has a User-Agent header"})),
                )
                    .into_response(),
            );
        }
        let bearer = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let ok = match (&self.config.auth, bearer) {
            (HookAuth::Token(token), Some(given)) => given == token,
            (HookAuth::App { app_id, public_key }, Some(jwt)) => {
                valid_app_jwt(jwt, app_id, public_key)
            }
            (_, None) => false,
        };
        (!ok).then(|| {
            (
                StatusCode::UNAUTHORIZED,
                axum::Json(json!({"message": "Bad credentials"})),
            )
                .into_response()
        })
    }
}

/// An RS256 JWT signed by the App's key, issued by the App, not expired, valid for at most ten
/// minutes (as GitHub checks).
fn valid_app_jwt(jwt: &str, app_id: &str, public_key: &[u8]) -> bool {
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let mut parts = jwt.split('.');
    let (Some(header), Some(claims), Some(signature), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let Ok(signature) = b64.decode(signature) else {
        return false;
    };
    let key = ring::signature::UnparsedPublicKey::new(
        &ring::signature::RSA_PKCS1_2048_8192_SHA256,
        public_key,
    );
    if key
        .verify(format!("{header}.{claims}").as_bytes(), &signature)
        .is_err()
    {
        return false;
    }
    let decode = |part: &str| {
        b64.decode(part)
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
    };
    let (Some(header), Some(claims)) = (decode(header), decode(claims)) else {
        return false;
    };
    let now = Utc::now().timestamp();
    let (iat, exp) = (
        claims["iat"].as_i64().unwrap_or(i64::MAX),
        claims["exp"].as_i64().unwrap_or(0),
    );
    header["alg"] == "RS256"
        && claims["iss"].as_str() == Some(app_id)
        && iat <= now + 60
        && exp > now
        && exp - iat <= 600
}

async fn list(
    State(hook): State<Arc<GithubHook>>,
    headers: HeaderMap,
    Query(q): Query<Vec<(String, String)>>,
) -> Response {
    if let Some(refused) = hook.refused(&headers) {
        return refused;
    }
    let param = |name: &str| q.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let per_page = param("per_page")
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(30)
        .clamp(1, 100);
    let cursor = param("cursor");
    let state = &mut *hook.state.lock().unwrap();
    state.cursors.push(cursor.clone());
    // The cursor names the first delivery of its page: `v1_<id>`.
    let start = match cursor
        .as_deref()
        .map(|c| c.strip_prefix("v1_").and_then(|i| i.parse::<i64>().ok()))
    {
        None => i64::MAX,
        Some(Some(id)) => id,
        Some(None) => return (StatusCode::BAD_REQUEST, "bad cursor").into_response(),
    };
    let newest_first: Vec<&HookDelivery> = state
        .deliveries
        .iter()
        .rev()
        .filter(|d| d.id <= start)
        .collect();
    let page: Vec<Value> = newest_first
        .iter()
        .take(per_page)
        .map(|d| {
            json!({
                "id": d.id, "guid": d.guid,
                "delivered_at": d.delivered_at.to_rfc3339_opts(SecondsFormat::Secs, true),
                "redelivery": d.redelivery, "duration": 0.03,
                "status": if d.status_code < 300 { "OK" } else { "failed to connect" },
                "status_code": d.status_code, "event": "issues", "action": "opened",
                "installation_id": null, "repository_id": 1, "throttled_at": null
            })
        })
        .collect();
    let mut response = axum::Json(page).into_response();
    if let Some(next) = newest_first.get(per_page) {
        let host = headers
            .get("host")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("127.0.0.1");
        let link = format!(
            "<http://{host}{}/deliveries?per_page={per_page}&cursor=v1_{}>; rel=\"next\"",
            hook.config.path, next.id
        );
        if let Ok(value) = link.parse() {
            response.headers_mut().insert("link", value);
        }
    }
    response
}

async fn redeliver(
    State(hook): State<Arc<GithubHook>>,
    headers: HeaderMap,
    Path(delivery_id): Path<i64>,
) -> Response {
    if let Some(refused) = hook.refused(&headers) {
        return refused;
    }
    let (guid, target) = {
        let state = &mut *hook.state.lock().unwrap();
        let Some(guid) = state
            .deliveries
            .iter()
            .find(|d| d.id == delivery_id)
            .map(|d| d.guid.clone())
        else {
            return not_found();
        };
        state.redeliveries.push((delivery_id, guid.clone()));
        if state.expired.contains(&guid) {
            return not_found();
        }
        (guid, state.target.clone())
    };
    let Some(event) = hook.events.iter().find(|e| e.guid == guid) else {
        return (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"message": "Not Found"})),
        )
            .into_response();
    };
    let status_code = match &target {
        Some(url) => hook.post(url, event).await,
        None => 502,
    };
    hook.record(&guid, Utc::now(), true, status_code);
    (StatusCode::ACCEPTED, axum::Json(json!({}))).into_response()
}

fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        axum::Json(json!({"message": "Not Found"})),
    )
        .into_response()
}
