//! A webhook provider, simulated: it numbers its events, signs and delivers them (Stripe
//! scheme) with configurable duplicates, reorders and drops, and serves a Stripe-style API:
//! `GET /v1/events` (cursor-paged, filtered by creation time and `types[]`) and
//! `GET /v1/events/{id}`, which answers 404 for IDs that never existed. Tests and local runs use
//! it as "the provider".
//!
//! As Stripe's, the API's copy of an event is not the delivered bytes: the delivery is rendered
//! in the endpoint's API version with the webhooks pending when it was sent
//! (`"pending_webhooks": 1`, `"request": "req_…"`), the API's copy in the account's version with
//! none pending (`"pending_webhooks": 0`, `"request": {"id": "req_…", "idempotency_key": null}`).

pub mod github;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use shared::domain::Scheme;
use shared::secrets::SigningSecret;

#[derive(Debug, Clone)]
pub struct ProviderConfig {
    /// Events are numbered 1..=events; external IDs are `evt_<n>`.
    pub events: u64,
    /// Sequence numbers the provider skipped: those IDs never existed (fetch answers 404).
    pub never_existed: Vec<u64>,
    /// Distinct entities the events update (entity `item-<n % entities>`, version = sequence).
    pub entities: u64,
    /// Creation time of event 1 (Unix seconds); each next event is one second later.
    pub first_created: i64,
    pub signing_secret: String,
    pub api_key: String,
    /// Event n has type `event_types[n % len]`; empty: every event is `item.updated`.
    pub event_types: Vec<String>,
}

/// One event as the provider knows it.
#[derive(Debug, Clone)]
pub struct ProviderEvent {
    pub sequence: u64,
    pub id: String,
    pub created: i64,
    /// The event as delivered to the webhook endpoint.
    pub body: Value,
}

impl ProviderEvent {
    /// The event as the API serves it: the same event, other bytes (see the module docs).
    pub fn api_body(&self) -> Value {
        let mut body = self.body.clone();
        body["pending_webhooks"] = json!(0);
        body["request"] = json!({"id": format!("req_{}", self.sequence), "idempotency_key": null});
        body
    }
}

pub fn event_id(sequence: u64) -> String {
    format!("evt_{sequence}")
}

/// How deliveries go wrong.
#[derive(Debug, Clone, Copy)]
pub struct DeliveryPlan {
    pub duplicate_rate: f64,
    pub drop_rate: f64,
    /// Each delivery may move up to this many places from its position.
    pub reorder_window: usize,
    pub seed: u64,
    /// Unix time the signatures carry.
    pub signed_at: i64,
}

/// A signed delivery, ready to POST.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub id: String,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

/// What the plan did.
#[derive(Debug, Clone, Default)]
pub struct DeliveryReport {
    pub events: usize,
    pub sent: usize,
    pub duplicates: usize,
    pub reordered: usize,
    pub dropped: Vec<String>,
}

pub struct Provider {
    config: ProviderConfig,
    events: BTreeMap<String, ProviderEvent>,
    ordered: Vec<ProviderEvent>,
    /// Fetch-by-ID requests served, by ID (tests check what was fetched).
    fetched: std::sync::Mutex<Vec<String>>,
    /// The `types[]` of every list request served.
    listed_types: std::sync::Mutex<Vec<Vec<String>>>,
}

impl Provider {
    pub fn new(config: ProviderConfig) -> Arc<Self> {
        let missing: HashSet<u64> = config.never_existed.iter().copied().collect();
        let ordered: Vec<ProviderEvent> = (1..=config.events)
            .filter(|n| !missing.contains(n))
            .map(|n| {
                let created = config.first_created + n as i64;
                let entity = format!("item-{}", n % config.entities.max(1));
                let event_type = match config.event_types.len() {
                    0 => "item.updated".to_owned(),
                    len => config.event_types[(n % len as u64) as usize].clone(),
                };
                ProviderEvent {
                    sequence: n,
                    id: event_id(n),
                    created,
                    body: json!({
                        "id": event_id(n), "object": "event", "type": event_type, "created": created,
                        "sequence": n, "pending_webhooks": 1, "request": format!("req_{n}"),
                        "data": {"object": {"id": entity, "object": "item", "version": n, "label": format!("{entity} at {n}")}}
                    }),
                }
            })
            .collect();
        let events = ordered.iter().map(|e| (e.id.clone(), e.clone())).collect();
        Arc::new(Self {
            config,
            events,
            ordered,
            fetched: Default::default(),
            listed_types: Default::default(),
        })
    }

    pub fn events(&self) -> &[ProviderEvent] {
        &self.ordered
    }

    /// The state a receiver should converge to: entity id → (highest version, its event id).
    pub fn final_state(&self) -> BTreeMap<String, (i64, String)> {
        let mut state = BTreeMap::new();
        for e in &self.ordered {
            let entity = e.body["data"]["object"]["id"].as_str().unwrap().to_owned();
            state.insert(entity, (e.sequence as i64, e.id.clone()));
        }
        state
    }

    pub fn fetched(&self) -> Vec<String> {
        self.fetched.lock().unwrap().clone()
    }

    /// The `types[]` each list request asked for (empty: every type), in order.
    pub fn listed_types(&self) -> Vec<Vec<String>> {
        self.listed_types.lock().unwrap().clone()
    }

    /// Signs every event, then duplicates, reorders and drops them according to `plan`.
    pub fn deliveries(&self, plan: DeliveryPlan) -> (Vec<Delivery>, DeliveryReport) {
        let mut rng = StdRng::seed_from_u64(plan.seed);
        let secret = SigningSecret::new(self.config.signing_secret.clone());
        let mut report = DeliveryReport {
            events: self.ordered.len(),
            ..DeliveryReport::default()
        };
        let mut out = Vec::new();
        for e in &self.ordered {
            if rng.random_bool(plan.drop_rate.clamp(0.0, 1.0)) {
                report.dropped.push(e.id.clone());
                continue;
            }
            let body = serde_json::to_vec(&e.body).expect("JSON");
            let headers: HeaderMap =
                shared::signature::sign(Scheme::Stripe, &secret, &e.id, plan.signed_at, &body)
                    .expect("Stripe signing takes any secret")
                    .into_iter()
                    .chain([(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/json"),
                    )])
                    .collect();
            let copies = if rng.random_bool(plan.duplicate_rate.clamp(0.0, 1.0)) {
                2
            } else {
                1
            };
            report.duplicates += copies - 1;
            for _ in 0..copies {
                out.push(Delivery {
                    id: e.id.clone(),
                    headers: headers.clone(),
                    body: body.clone(),
                });
            }
        }
        if plan.reorder_window > 1 {
            for chunk in out.chunks_mut(plan.reorder_window) {
                let before: Vec<String> = chunk.iter().map(|d| d.id.clone()).collect();
                chunk.shuffle(&mut rng);
                report.reordered += chunk
                    .iter()
                    .zip(&before)
                    .filter(|(d, id)| &d.id != *id)
                    .count();
            }
        }
        report.sent = out.len();
        (out, report)
    }

    /// `GET /v1/events`, `GET /v1/events/{id}`.
    pub fn router(self: Arc<Self>) -> Router {
        Router::new()
            .route("/v1/events", get(list))
            .route("/v1/events/{id}", get(fetch))
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

    fn authorized(&self, headers: &HeaderMap) -> bool {
        headers.get("authorization").and_then(|v| v.to_str().ok())
            == Some(&format!("Bearer {}", self.config.api_key))
    }
}

/// POSTs deliveries to `url` with `concurrency` requests in flight; returns how many got each
/// status code.
pub async fn send(
    url: &str,
    deliveries: Vec<Delivery>,
    concurrency: usize,
) -> BTreeMap<u16, usize> {
    let client = reqwest::Client::new();
    let queue = Arc::new(std::sync::Mutex::new(
        deliveries
            .into_iter()
            .collect::<std::collections::VecDeque<_>>(),
    ));
    let tasks: Vec<_> = (0..concurrency.max(1))
        .map(|_| {
            let (client, queue, url) = (client.clone(), queue.clone(), url.to_owned());
            tokio::spawn(async move {
                let mut statuses = BTreeMap::new();
                loop {
                    let Some(d) = queue.lock().unwrap().pop_front() else {
                        break;
                    };
                    let status = match client
                        .post(&url)
                        .headers(d.headers)
                        .body(d.body)
                        .send()
                        .await
                    {
                        Ok(r) => r.status().as_u16(),
                        Err(_) => 0,
                    };
                    *statuses.entry(status).or_insert(0) += 1;
                }
                statuses
            })
        })
        .collect();
    let mut total = BTreeMap::new();
    for t in tasks {
        for (status, n) in t.await.expect("sender task") {
            *total.entry(status).or_insert(0) += n;
        }
    }
    total
}

fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        axum::Json(
            json!({"error": {"type": "invalid_request_error", "message": "Invalid API Key"}}),
        ),
    )
        .into_response()
}

async fn fetch(
    State(p): State<Arc<Provider>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if !p.authorized(&headers) {
        return unauthorized();
    }
    p.fetched.lock().unwrap().push(id.clone());
    match p.events.get(&id) {
        Some(e) => axum::Json(e.api_body()).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"error": {"type": "invalid_request_error", "code": "resource_missing", "message": format!("No such event: '{id}'")}})),
        )
            .into_response(),
    }
}

async fn list(
    State(p): State<Arc<Provider>>,
    headers: HeaderMap,
    Query(q): Query<Vec<(String, String)>>,
) -> Response {
    if !p.authorized(&headers) {
        return unauthorized();
    }
    let param = |name: &str| q.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let gte = param("created[gte]")
        .and_then(|v| v.parse::<i64>().ok())
        .unwrap_or(i64::MIN);
    let lt = param("created[lt]")
        .and_then(|v| v.parse::<i64>().ok())
        .unwrap_or(i64::MAX);
    let limit = param("limit")
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(10)
        .clamp(1, 100);
    // Stripe's `types[]`: up to 20 event types; only events of those types are listed.
    let types: Vec<String> = q
        .iter()
        .filter(|(k, _)| k == "types[]")
        .map(|(_, v)| v.clone())
        .collect();
    if types.len() > 20 {
        return (
            StatusCode::BAD_REQUEST,
            "types[] takes up to 20 event types",
        )
            .into_response();
    }
    p.listed_types.lock().unwrap().push(types.clone());
    // Newest first, as Stripe lists.
    let mut window: Vec<&ProviderEvent> = p
        .ordered
        .iter()
        .rev()
        .filter(|e| e.created >= gte && e.created < lt)
        .filter(|e| types.is_empty() || types.iter().any(|t| e.body["type"] == t.as_str()))
        .collect();
    if let Some(after) = param("starting_after") {
        match window.iter().position(|e| e.id == after) {
            Some(i) => window.drain(..=i).for_each(drop),
            None => return (StatusCode::BAD_REQUEST, "unknown starting_after").into_response(),
        }
    }
    let has_more = window.len() > limit;
    let data: Vec<Value> = window
        .into_iter()
        .take(limit)
        .map(ProviderEvent::api_body)
        .collect();
    axum::Json(json!({"object": "list", "data": data, "has_more": has_more, "url": "/v1/events"}))
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provider() -> Arc<Provider> {
        Provider::new(ProviderConfig {
            events: 100,
            never_existed: vec![7],
            entities: 10,
            first_created: 1_700_000_000,
            signing_secret: "whsec_sim".into(),
            api_key: "sk_test".into(),
            event_types: vec![],
        })
    }

    #[test]
    fn plans_drop_duplicate_and_reorder_as_configured() {
        let p = provider();
        assert_eq!(p.events().len(), 99);
        let plan = DeliveryPlan {
            duplicate_rate: 0.2,
            drop_rate: 0.1,
            reorder_window: 8,
            seed: 7,
            signed_at: 1_700_000_000,
        };
        let (deliveries, report) = p.deliveries(plan);
        assert_eq!(report.sent, deliveries.len());
        assert_eq!(report.sent, 99 - report.dropped.len() + report.duplicates);
        assert!(
            !report.dropped.is_empty() && report.duplicates > 0 && report.reordered > 0,
            "{report:?}"
        );
        let (again, _) = p.deliveries(plan);
        assert_eq!(
            again.iter().map(|d| &d.id).collect::<Vec<_>>(),
            deliveries.iter().map(|d| &d.id).collect::<Vec<_>>(),
            "seeded"
        );
    }

    #[tokio::test]
    async fn the_api_lists_pages_and_fetches_and_knows_what_never_existed() {
        let base = provider().serve().await;
        let client = reqwest::Client::new();
        let get = |path: String| {
            client
                .get(format!("{base}{path}"))
                .bearer_auth("sk_test")
                .send()
        };
        let page: Value = get("/v1/events?limit=30&created[gte]=1700000050".into())
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(page["data"].as_array().unwrap().len(), 30);
        assert_eq!(page["data"][0]["id"], "evt_100");
        assert_eq!(page["has_more"], true);
        let next: Value =
            get("/v1/events?limit=30&created[gte]=1700000050&starting_after=evt_71".into())
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
        assert_eq!(
            (
                next["data"].as_array().unwrap().len(),
                next["has_more"].as_bool()
            ),
            (21, Some(false))
        );
        assert_eq!(get("/v1/events/evt_8".into()).await.unwrap().status(), 200);
        assert_eq!(get("/v1/events/evt_7".into()).await.unwrap().status(), 404);
        assert_eq!(
            client
                .get(format!("{base}/v1/events/evt_8"))
                .send()
                .await
                .unwrap()
                .status(),
            401
        );
    }
}
