//! The test harness: build the ingest function over a fresh database, talk to it as a provider
//! would (signed requests through the Lambda handler, or HTTP to the local runner), and read
//! back what an operator would query.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use lambda_http::{Body, RequestExt};
use shared::domain::{Scheme, SourceId, TenantId};
use shared::extract::FieldMap;
use shared::ingest::{IngestLimits, Ingestor};
use shared::secrets::{SecretSet, SecretStore, SigningSecret};
use shared::sources::{self, Source, SourceRegistry};
use sqlx::PgPool;

pub const TENANT: &str = "acme";
pub const MAX_BODY: usize = 64 * 1024;

pub fn now() -> i64 {
    shared::ingest::unix_now()
}

/// A source with the scheme's default field map, verified with secret `secret_ref`.
pub fn source(id: &str, tenant: &str, scheme: Scheme, secret_ref: &str) -> Source {
    Source {
        source_id: SourceId::parse(id).unwrap(),
        tenant_id: TenantId::parse(tenant).unwrap(),
        scheme,
        secret_ref: secret_ref.to_owned(),
        tolerance: sources::DEFAULT_TOLERANCE,
        fields: FieldMap::defaults_for(scheme),
        enabled: true,
        signed_url: None,
        signature: None,
        layouts: None,
        json_form_field: scheme.provider().fields.json_form_field.clone(),
        address_check: None,
        partner: None,
        gaps: None,
    }
}

/// The schemes this suite builds deliveries for ([`delivery`]): the five written before the
/// provider catalogue. The catalogue's other entries are tested by their known-answer vectors.
pub const SCHEMES: [Scheme; 5] = [
    Scheme::Stripe,
    Scheme::StandardWebhooks,
    Scheme::Github,
    Scheme::Shopify,
    Scheme::Slack,
];

/// One source per scheme, ids `stripe`, `standard_webhooks`, `github`, `shopify`, `slack`,
/// each with a secret `secret/<id>` whose current value is [`secret_of`].
pub fn sources_for_every_scheme() -> Vec<Source> {
    SCHEMES
        .iter()
        .map(|s| source(s.as_str(), TENANT, *s, &format!("secret/{s}")))
        .collect()
}

pub fn secret_of(scheme: Scheme) -> String {
    match scheme {
        // Standard Webhooks secrets are whsec_ + base64.
        Scheme::StandardWebhooks => "whsec_dGVzdC1zZWNyZXQtZm9yLXN0YW5kYXJkLXdlYmhvb2tz".into(),
        other => format!("{other}-signing-secret"),
    }
}

pub fn secrets_for_every_scheme() -> SecretStore {
    SecretStore::memory(
        SCHEMES
            .iter()
            .map(|s| (format!("secret/{s}"), SecretSet::new(secret_of(*s), None))),
    )
}

/// The ingest function over `pool`, with the given sources stored and secrets held in memory.
pub struct TestApp {
    pub pool: PgPool,
    pub ingestor: Arc<Ingestor>,
}

impl TestApp {
    pub async fn new(pool: PgPool, sources: &[Source], secrets: SecretStore) -> Self {
        Self::with_limits(pool, sources, secrets, Duration::from_secs(30), MAX_BODY).await
    }

    pub async fn with_limits(
        pool: PgPool,
        list: &[Source],
        secrets: SecretStore,
        source_ttl: Duration,
        max_body_bytes: usize,
    ) -> Self {
        sources::apply(&pool, list).await.expect("store sources");
        let registry = Arc::new(SourceRegistry::new(pool.clone(), source_ttl));
        let ingestor = Ingestor::new(
            pool.clone(),
            registry,
            Arc::new(secrets),
            IngestLimits { max_body_bytes },
        );
        Self {
            pool,
            ingestor: Arc::new(ingestor),
        }
    }

    /// Every scheme's source, every scheme's secret.
    pub async fn spawn(pool: PgPool) -> Self {
        Self::new(
            pool,
            &sources_for_every_scheme(),
            secrets_for_every_scheme(),
        )
        .await
    }

    /// POSTs through the Lambda handler with a constructed API Gateway request.
    pub async fn post(&self, source_id: &str, headers: HeaderMap, body: &[u8]) -> Reply {
        post_to(&self.ingestor, source_id, headers, body).await
    }
}

/// What the provider sees.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub json: serde_json::Value,
}

impl Reply {
    /// `{"status": ...}` of a 200.
    pub fn outcome(&self) -> &str {
        self.json["status"].as_str().unwrap_or("")
    }
}

pub async fn post_to(
    ingestor: &Ingestor,
    source_id: &str,
    headers: HeaderMap,
    body: &[u8],
) -> Reply {
    post_from(ingestor, source_id, headers, body, None).await
}

/// [`post_to`], the request coming from `source_ip` as API Gateway's HTTP API reports it
/// (`requestContext.http.sourceIp`); `None`: a request context without one.
pub async fn post_from(
    ingestor: &Ingestor,
    source_id: &str,
    headers: HeaderMap,
    body: &[u8],
    source_ip: Option<&str>,
) -> Reply {
    let mut request = http::Request::builder()
        .method("POST")
        .uri(format!(
            "https://example.execute-api.us-east-1.amazonaws.com/webhooks/{source_id}"
        ))
        .body(Body::Binary(body.to_vec()))
        .unwrap();
    *request.headers_mut() = headers;
    let mut request = request.with_path_parameters(HashMap::from([(
        "source_id".to_owned(),
        source_id.to_owned(),
    )]));
    if let Some(ip) = source_ip {
        let mut context =
            lambda_http::aws_lambda_events::apigw::ApiGatewayV2httpRequestContext::default();
        context.http.method = http::Method::POST;
        context.http.source_ip = Some(ip.to_owned());
        request = request
            .with_request_context(lambda_http::request::RequestContext::ApiGatewayV2(context));
    }
    let response = ingest::handler(request, ingestor)
        .await
        .expect("the handler answers every request");
    let (parts, body) = response.into_parts();
    // Every answer is JSON but an empty one (Discord's 204).
    let json = if body.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&body).expect("JSON response body")
    };
    Reply {
        status: parts.status,
        headers: parts.headers,
        json,
    }
}

/// A Mailgun event webhook body: its signature (hex HMAC-SHA256 of timestamp and token, keyed
/// with `key`) travels in the body beside the event data, which it does not cover.
pub fn mailgun_body(key: &str, timestamp: i64, token: &str, id: &str, event: &str) -> Vec<u8> {
    use hmac::{KeyInit, Mac};
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(key.as_bytes()).expect("any key");
    mac.update(format!("{timestamp}{token}").as_bytes());
    let signature = hex::encode(mac.finalize().into_bytes());
    serde_json::to_vec(&serde_json::json!({
        "signature": {"timestamp": timestamp.to_string(), "token": token, "signature": signature},
        "event-data": {"id": id, "event": event, "recipient": "alice@example.com",
                       "message": {"headers": {"message-id": "m1@example.com"}}}
    }))
    .expect("JSON")
}

/// A provider's delivery: body and signed headers, plus the id/type headers the scheme uses.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

/// Builds a delivery of event `id` signed with `secret` at Unix time `at`, in the scheme's
/// real shape (ids in headers for GitHub/Shopify/Standard Webhooks, in the body otherwise).
pub fn delivery(
    scheme: Scheme,
    secret: &str,
    id: &str,
    at: i64,
    extra: serde_json::Value,
) -> Delivery {
    let mut headers = HeaderMap::new();
    let mut body = match scheme {
        Scheme::Stripe => {
            serde_json::json!({"id": id, "object": "event", "type": "payment_intent.succeeded", "data": {"object": {"id": "pi_1"}}})
        }
        Scheme::StandardWebhooks => {
            serde_json::json!({"type": "invoice.paid", "data": {"id": "inv_1"}})
        }
        Scheme::Github => {
            set(&mut headers, "x-github-delivery", id);
            set(&mut headers, "x-github-event", "issues");
            serde_json::json!({"action": "opened", "issue": {"number": 1}})
        }
        Scheme::Shopify => {
            set(&mut headers, "x-shopify-webhook-id", id);
            set(&mut headers, "x-shopify-topic", "orders/updated");
            serde_json::json!({"id": 1, "admin_graphql_api_id": "gid://shopify/Order/1", "updated_at": "2026-11-30T10:00:00Z"})
        }
        Scheme::Slack => {
            serde_json::json!({"type": "event_callback", "event_id": id, "event": {"type": "message"}})
        }
        // The catalogue's other providers are tested by their known-answer vectors.
        other => panic!("no test delivery shape for {other}: the suite builds the first five"),
    };
    if let (Some(target), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
        target.extend(extra.clone());
    }
    let body = serde_json::to_vec(&body).unwrap();
    set(&mut headers, "content-type", "application/json");
    for (name, value) in
        shared::signature::sign(scheme, &SigningSecret::new(secret), id, at, &body).unwrap()
    {
        headers.insert(name, value);
    }
    Delivery { headers, body }
}

/// The same delivery re-signed over other body bytes (a changed payload under the same id).
pub fn resign(
    scheme: Scheme,
    secret: &str,
    id: &str,
    at: i64,
    mut headers: HeaderMap,
    body: Vec<u8>,
) -> Delivery {
    for (name, value) in
        shared::signature::sign(scheme, &SigningSecret::new(secret), id, at, &body).unwrap()
    {
        headers.insert(name, value);
    }
    Delivery { headers, body }
}

pub fn set(headers: &mut HeaderMap, name: &'static str, value: &str) {
    headers.insert(
        HeaderName::from_static(name),
        HeaderValue::from_str(value).unwrap(),
    );
}

/// A `webhook_events` row, as an operator would select it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct EventRow {
    pub tenant_id: String,
    pub external_id: String,
    pub source_id: String,
    pub event_type: String,
    pub entity_id: Option<String>,
    pub entity_version: Option<i64>,
    pub payload: Option<Vec<u8>>,
    pub payload_sha256: Vec<u8>,
    pub headers: serde_json::Value,
    pub verified_with: String,
    pub delivery_count: i32,
    pub last_delivery_outcome: String,
    pub conflict_count: i32,
    pub superseded_sha256: Option<Vec<u8>>,
    pub status: String,
    pub first_received_at: Timestamp,
    pub last_seen_at: Timestamp,
}

pub type Timestamp = sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>;

pub async fn events(pool: &PgPool) -> Vec<EventRow> {
    sqlx::query_as("SELECT * FROM webhook_events ORDER BY tenant_id, external_id")
        .fetch_all(pool)
        .await
        .unwrap()
}

pub async fn event(pool: &PgPool, tenant: &str, external_id: &str) -> Option<EventRow> {
    sqlx::query_as("SELECT * FROM webhook_events WHERE tenant_id = $1 AND external_id = $2")
        .bind(tenant)
        .bind(external_id)
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// An `ingest_anomalies` row.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct AnomalyRow {
    pub tenant_id: String,
    pub source_id: String,
    pub kind: String,
    pub external_id: Option<String>,
    pub payload_sha256: Vec<u8>,
    pub stored_sha256: Option<Vec<u8>>,
    pub superseded_sha256: Option<Vec<u8>>,
    pub payload_replaced: Option<bool>,
    pub payload: Option<Vec<u8>>,
    pub detail: String,
}

pub async fn anomalies(pool: &PgPool) -> Vec<AnomalyRow> {
    sqlx::query_as("SELECT * FROM ingest_anomalies ORDER BY anomaly_id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// moto's endpoint, a local Secrets Manager the test command starts.
pub fn moto_endpoint() -> String {
    std::env::var("MOTO_ENDPOINT")
        .expect("MOTO_ENDPOINT is not set: run the tests with scripts/test, which starts moto")
}

/// A Secrets Manager client on moto.
pub async fn admin_client(endpoint: &str) -> aws_sdk_secretsmanager::Client {
    let config = shared::aws::sdk_config(&shared::aws::AwsEndpoint {
        endpoint_url: Some(endpoint.to_owned()),
        region: Some("us-east-1".into()),
    })
    .await;
    aws_sdk_secretsmanager::Client::new(&config)
}

/// A secret named `prefix/<unique>` (moto keeps state across tests) holding `value`.
pub async fn new_secret(
    admin: &aws_sdk_secretsmanager::Client,
    prefix: &str,
    value: &str,
) -> String {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let name = format!(
        "{prefix}/{}-{}-{}",
        std::process::id(),
        now(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    );
    admin
        .create_secret()
        .name(&name)
        .secret_string(value)
        .send()
        .await
        .unwrap();
    name
}

pub fn sha256(bytes: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).to_vec()
}

// ---- The drain ----------------------------------------------------------------------------

pub mod buffer;
pub mod scale;

pub mod drain {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    use serde_json::json;
    use shared::domain::{FieldLocator, Scheme};
    use shared::drain::{DrainOutcome, DrainSettings, Drainer};
    use shared::effects::{Effect, EffectError, EffectFuture, EffectHandler, EffectRegistry};
    use shared::secrets::SecretSet;
    use shared::store::event_queue::ClaimedEvent;
    use sqlx::PgPool;
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

    use super::*;

    /// A Standard Webhooks source whose events carry an entity id and version in `data`.
    pub const ENTITIES: &str = "entities";
    pub const ENTITIES_SECRET: &str = "whsec_ZW50aXRpZXMtc291cmNlLXNpZ25pbmcta2V5";

    pub fn entity_source() -> shared::sources::Source {
        let mut s = source(
            ENTITIES,
            TENANT,
            Scheme::StandardWebhooks,
            "secret/entities",
        );
        s.fields.entity_id = Some(FieldLocator::json("/data/id"));
        s.fields.entity_version = Some(FieldLocator::json("/data/version"));
        s
    }

    /// Every scheme's source plus the entity source, with their secrets.
    pub async fn app(pool: PgPool) -> TestApp {
        let mut sources = sources_for_every_scheme();
        sources.push(entity_source());
        let mut secrets: Vec<(String, SecretSet)> = SCHEMES
            .iter()
            .map(|s| (format!("secret/{s}"), SecretSet::new(secret_of(*s), None)))
            .collect();
        secrets.push((
            "secret/entities".into(),
            SecretSet::new(ENTITIES_SECRET, None),
        ));
        TestApp::new(
            pool,
            &sources,
            shared::secrets::SecretStore::memory(secrets),
        )
        .await
    }

    /// An entity event: `{"type": <event_type>, "data": {"id": <entity>, "version": <v>, ...}}`.
    pub fn entity_event(id: &str, entity: &str, version: i64, event_type: &str) -> Delivery {
        let body = json!({"type": event_type, "data": {"id": entity, "version": version, "name": format!("{entity} v{version}")}});
        resign(
            Scheme::StandardWebhooks,
            ENTITIES_SECRET,
            id,
            now(),
            http::HeaderMap::new(),
            serde_json::to_vec(&body).unwrap(),
        )
    }

    pub fn fast_settings() -> DrainSettings {
        DrainSettings {
            batch_size: 50,
            max_attempts: 3,
            backoff_base: Duration::from_millis(5),
            backoff_cap: Duration::from_millis(40),
            ..DrainSettings::default()
        }
    }

    pub fn drainer(pool: &PgPool, registry: Arc<EffectRegistry>) -> Drainer {
        Drainer::new(pool.clone(), registry, fast_settings())
    }

    /// A drainer over the standard effect registry, with [`fast_settings`].
    pub fn standard_drainer(pool: &PgPool) -> Drainer {
        drainer(pool, Arc::new(EffectRegistry::standard()))
    }

    pub async fn queue_len(pool: &PgPool) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM event_queue")
            .fetch_one(pool)
            .await
            .unwrap()
    }

    /// Drains until the queue is empty (retries included), failing after `limit`.
    pub async fn drain_all(drainer: &Drainer, pool: &PgPool, limit: Duration) -> DrainOutcome {
        let give_up = Instant::now() + limit;
        let mut total = DrainOutcome::default();
        while queue_len(pool).await > 0 {
            assert!(Instant::now() < give_up, "queue not empty after {limit:?}");
            let pass = drainer
                .drain_until(Instant::now() + Duration::from_secs(5))
                .await
                .expect("drain pass");
            total.add(&pass);
            if pass.claimed == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        total
    }

    /// Records every committed application of an effect: a row in `test_applications`,
    /// written inside the handler's savepoint, so rolled-back attempts leave no trace. Each row
    /// keeps the id of the (top-level) transaction that wrote it; its `xmin` is that of the
    /// subtransaction it was written in.
    pub async fn create_application_log(pool: &PgPool) {
        sqlx::query("CREATE TABLE test_applications (tenant_id text, external_id text, applied_at timestamptz DEFAULT clock_timestamp(), \
                     written_by xid8 DEFAULT pg_current_xact_id())")
            .execute(pool)
            .await
            .unwrap();
    }

    /// How many times each event's effect was committed, at most and at least.
    pub async fn application_counts(pool: &PgPool) -> (i64, i64, i64) {
        sqlx::query_as(
            "SELECT COALESCE(min(n), 0), COALESCE(max(n), 0), count(*) FROM \
             (SELECT count(*) AS n FROM test_applications GROUP BY tenant_id, external_id) AS per_event",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    }

    /// Wraps a handler: logs each application (rolled back with the savepoint when it fails),
    /// and can be made to fail on chosen entities.
    pub struct Instrumented {
        pub inner: Arc<dyn EffectHandler>,
        /// Entity ids that fail while `broken` is set.
        pub poison: Vec<String>,
        pub fatal: bool,
        pub broken: AtomicBool,
    }

    impl Instrumented {
        pub fn new(inner: Arc<dyn EffectHandler>) -> Self {
            Self {
                inner,
                poison: Vec::new(),
                fatal: false,
                broken: AtomicBool::new(true),
            }
        }
    }

    impl EffectHandler for Instrumented {
        fn name(&self) -> &'static str {
            "instrumented"
        }

        fn expects(&self, event: &ClaimedEvent) -> shared::effects::Expectation {
            self.inner.expects(event)
        }

        fn apply<'a>(
            &'a self,
            conn: &'a mut sqlx::PgConnection,
            event: &'a ClaimedEvent,
        ) -> EffectFuture<'a> {
            Box::pin(async move {
                // Write first, fail after: a failing event's partial writes must roll back.
                sqlx::query(
                    "INSERT INTO test_applications (tenant_id, external_id) VALUES ($1, $2)",
                )
                .bind(&event.tenant_id)
                .bind(&event.external_id)
                .execute(&mut *conn)
                .await
                .map_err(|e| EffectError::from(shared::store::StoreError::from(e)))?;
                let poisoned = event
                    .entity_id
                    .as_ref()
                    .is_some_and(|e| self.poison.contains(e));
                if poisoned && self.broken.load(Ordering::SeqCst) {
                    let why = format!("poison entity {:?} rejected", event.entity_id);
                    return Err(if self.fatal {
                        EffectError::Fatal(why)
                    } else {
                        EffectError::Retryable(why)
                    });
                }
                let effect: Effect = self.inner.apply(conn, event).await?;
                Ok(effect)
            })
        }
    }

    /// The entity projection, instrumented, failing for good on `poisoned`'s events until its
    /// `broken` flag is cleared; the registry around it, and a drainer with [`fast_settings`].
    pub fn poisoned_drain(
        pool: &PgPool,
        poisoned: &str,
    ) -> (Arc<Instrumented>, Arc<EffectRegistry>, Drainer) {
        let mut handler = Instrumented::new(Arc::new(shared::effects::entity::EntityProjection));
        handler.poison = vec![poisoned.into()];
        let handler = Arc::new(handler);
        let registry = registry_with(handler.clone());
        let drainer = drainer(pool, registry.clone());
        (handler, registry, drainer)
    }

    /// The standard registry with its fallback wrapped in `instrumented`.
    pub fn registry_with(instrumented: Arc<Instrumented>) -> Arc<EffectRegistry> {
        let mut registry = EffectRegistry::new(instrumented);
        registry.register(
            Scheme::Stripe,
            "payment_intent.succeeded",
            Arc::new(shared::effects::payments::Payments::stripe()),
        );
        Arc::new(registry)
    }

    /// An admin pool (two connections) over a database holding the entity source, the
    /// application log and `n` pending [`bulk_events`].
    pub async fn admin_with_bulk_events(
        pool_options: PgPoolOptions,
        connect: &PgConnectOptions,
        n: i64,
    ) -> PgPool {
        let admin = pool_options
            .max_connections(2)
            .connect_with(connect.clone())
            .await
            .unwrap();
        shared::sources::apply(&admin, &[entity_source()])
            .await
            .unwrap();
        create_application_log(&admin).await;
        bulk_events(&admin, n).await;
        admin
    }

    /// Inserts `n` pending entity events straight into the queue (a fixture for volume tests;
    /// the ingest statement itself is exercised elsewhere).
    pub async fn bulk_events(pool: &PgPool, n: i64) {
        sqlx::query(
            "WITH e AS ( \
                 INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, entity_id, entity_version, \
                     payload, payload_sha256, verified_with, received_at, first_received_at, last_seen_at) \
                 SELECT $1, 'bulk-' || g, $2, 'item.updated', 'item-' || g, 1, \
                     convert_to(json_build_object('type', 'item.updated', 'data', json_build_object('id', 'item-' || g, 'version', 1))::text, 'UTF8'), \
                     sha256(convert_to('bulk-' || g, 'UTF8')), 'current', now(), now(), now() \
                 FROM generate_series(1, $3) AS g \
                 RETURNING tenant_id, external_id) \
             INSERT INTO event_queue (tenant_id, external_id) SELECT tenant_id, external_id FROM e",
        )
        .bind(TENANT)
        .bind(ENTITIES)
        .bind(n)
        .execute(pool)
        .await
        .unwrap();
    }

    pub async fn create_order(
        pool: &PgPool,
        order_id: &str,
        reference: &str,
        amount: i64,
        currency: &str,
    ) {
        sqlx::query("INSERT INTO orders (tenant_id, order_id, merchant_reference, amount_minor, currency) VALUES ($1, $2, $3, $4, $5)")
            .bind(TENANT)
            .bind(order_id)
            .bind(reference)
            .bind(amount)
            .bind(currency)
            .execute(pool)
            .await
            .unwrap();
    }

    /// A Stripe `payment_intent.succeeded` for `order_id`.
    pub fn payment(
        id: &str,
        order_id: &str,
        reference: &str,
        amount: i64,
        currency: &str,
    ) -> Delivery {
        let body = json!({
            "id": id, "object": "event", "type": "payment_intent.succeeded",
            "data": {"object": {"id": format!("pi_{order_id}"), "object": "payment_intent", "amount": amount,
                "amount_received": amount, "currency": currency,
                "metadata": {"order_id": order_id, "merchant_reference": reference}}}
        });
        resign(
            Scheme::Stripe,
            &secret_of(Scheme::Stripe),
            id,
            now(),
            http::HeaderMap::new(),
            serde_json::to_vec(&body).unwrap(),
        )
    }

    pub async fn scalar(pool: &PgPool, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
    }
}

// ---- Reconciliation, gaps, backfill --------------------------------------------------------

pub mod gaps {
    use std::sync::Arc;
    use std::time::Duration;

    use shared::backfill::{BackfillSettings, Backfiller};
    use shared::domain::{FieldLocator, Scheme};
    use shared::secrets::{SecretSet, SecretStore};
    use shared::sources::{GapConfig, GapStrategy, Source};
    use simulator::{Provider, ProviderConfig};
    use sqlx::PgPool;

    use super::*;

    pub const SIGNING: &str = "whsec_simulated_provider";
    pub const API_KEY: &str = "sk_test_simulated";

    pub fn provider(events: u64, never_existed: Vec<u64>) -> Arc<Provider> {
        typed_provider_of(events, never_existed, &[])
    }

    /// A provider whose events cycle through `event_types`.
    pub fn typed_provider(events: u64, event_types: &[&str]) -> Arc<Provider> {
        typed_provider_of(events, vec![], event_types)
    }

    fn typed_provider_of(
        events: u64,
        never_existed: Vec<u64>,
        event_types: &[&str],
    ) -> Arc<Provider> {
        Provider::new(ProviderConfig {
            events,
            never_existed,
            entities: 200,
            first_created: now() - events as i64 - 10,
            signing_secret: SIGNING.into(),
            api_key: API_KEY.into(),
            event_types: event_types.iter().map(|t| t.to_string()).collect(),
        })
    }

    /// A Stripe-signed source for the simulated provider, with gap detection by `strategy`.
    pub fn provider_source(
        id: &str,
        strategy: GapStrategy,
        api_base_url: &str,
        grace: Duration,
    ) -> Source {
        let mut s = source(id, TENANT, Scheme::Stripe, "secret/provider-signing");
        s.fields.entity_version = Some(FieldLocator::json("/data/object/version"));
        s.fields.sequence = Some(FieldLocator::json("/sequence"));
        s.gaps = Some(GapConfig {
            strategy,
            api_base_url: Some(api_base_url.to_owned()),
            api_secret_ref: Some("secret/provider-api".into()),
            grace,
            window: 100_000,
            event_types: None,
        });
        s
    }

    pub fn sequence_strategy() -> GapStrategy {
        GapStrategy::Sequence {
            id_template: "evt_{seq}".into(),
        }
    }

    fn secrets() -> SecretStore {
        SecretStore::memory([
            (
                "secret/provider-signing".to_owned(),
                SecretSet::new(SIGNING, None),
            ),
            (
                "secret/provider-api".to_owned(),
                SecretSet::new(API_KEY, None),
            ),
        ])
    }

    pub async fn app(pool: PgPool, sources: &[Source]) -> TestApp {
        TestApp::new(pool, sources, secrets()).await
    }

    pub fn backfiller(pool: &PgPool) -> Backfiller {
        backfiller_with(pool, BackfillSettings::default())
    }

    pub fn backfiller_with(pool: &PgPool, settings: BackfillSettings) -> Backfiller {
        Backfiller::new(pool.clone(), Arc::new(secrets()), settings)
    }

    /// Delivers through the ingest handler, several at a time; every reply must be a 200.
    pub async fn deliver_all(app: &TestApp, source_id: &str, deliveries: Vec<simulator::Delivery>) {
        let queue = Arc::new(std::sync::Mutex::new(deliveries));
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let (queue, ingestor, source_id) =
                    (queue.clone(), app.ingestor.clone(), source_id.to_owned());
                tokio::spawn(async move {
                    loop {
                        let Some(d) = queue.lock().unwrap().pop() else {
                            break;
                        };
                        let reply = post_to(&ingestor, &source_id, d.headers, &d.body).await;
                        assert_eq!(reply.status, 200, "{:?}", reply.json);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    }
}

// ---- Lambda invocations and CloudFormation ------------------------------------------------

pub mod lambda {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use lambda_runtime::{Context, LambdaEvent};
    use shared::config::Vars;

    /// An invocation context whose deadline is `deadline_in` from now.
    pub fn context(deadline_in: Duration) -> Context {
        let mut context = Context::default();
        context.deadline = (SystemTime::now() + deadline_in)
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        context
    }

    pub fn invocation<T>(payload: T, deadline_in: Duration) -> LambdaEvent<T> {
        LambdaEvent::new(payload, context(deadline_in))
    }

    pub type Lookup = Box<dyn Fn(&str) -> Option<String> + Send + Sync>;

    /// Settings from the given variables only (never the process environment), recording
    /// every variable the code asked for.
    pub struct TestVars {
        pub read: Arc<Mutex<Vec<String>>>,
        pub vars: Vars<Lookup>,
    }

    pub fn vars(pairs: &[(&str, &str)]) -> TestVars {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let read = Arc::new(Mutex::new(Vec::new()));
        let log = read.clone();
        TestVars {
            read,
            vars: Vars(Box::new(move |k: &str| {
                log.lock().unwrap().push(k.to_owned());
                map.get(k).cloned()
            })),
        }
    }

    /// What CloudFormation's pre-signed response URL received: (content type, JSON body).
    pub type Answers = Arc<Mutex<Vec<(String, serde_json::Value)>>>;

    /// A local HTTP server standing in for the pre-signed S3 URL a custom resource answers.
    pub async fn cloudformation_response_url() -> (String, Answers) {
        let answers: Answers = Arc::new(Mutex::new(Vec::new()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "http://{}/cfn-response?X-Amz-Signature=abc",
            listener.local_addr().unwrap()
        );
        let app = axum::Router::new().route(
            "/cfn-response",
            axum::routing::put({
                let answers = answers.clone();
                move |headers: axum::http::HeaderMap, body: axum::body::Bytes| async move {
                    let content_type = headers
                        .get("content-type")
                        .map(|v| v.to_str().unwrap().to_owned())
                        .unwrap_or_default();
                    answers
                        .lock()
                        .unwrap()
                        .push((content_type, serde_json::from_slice(&body).unwrap()));
                    axum::http::StatusCode::OK
                }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        (url, answers)
    }

    /// A custom resource request of `request_type` (Create, Update, Delete) answered at `url`.
    pub fn custom_resource_request(request_type: &str, url: &str) -> serde_json::Value {
        serde_json::json!({
            "RequestType": request_type, "RequestId": format!("req-{request_type}"), "ResponseURL": url,
            "ResourceType": "Custom::SchemaMigrations", "LogicalResourceId": "SchemaMigrations",
            "StackId": "arn:aws:cloudformation:us-east-1:123456789012:stack/webhooks/1",
            "ServiceToken": "arn:aws:lambda:us-east-1:123456789012:function:webhooks-migrate",
            "PhysicalResourceId": "schema-migrations",
            "ResourceProperties": {"ServiceToken": "x", "SchemaVersion": "20261130000004"},
            "OldResourceProperties": {"ServiceToken": "x", "SchemaVersion": "20261130000003"}
        })
    }

    /// The database URL of a test's pool (for code that reads `DATABASE_URL`).
    pub fn url_of(pool: &sqlx::PgPool) -> String {
        use sqlx::ConnectOptions;
        pool.connect_options().to_url_lossy().to_string()
    }
}

/// A delivery to `source` as ingest would buffer it for the consumer: verified (which secret,
/// which headers it signs), its kept headers, its received time.
pub fn buffered(
    source: &Source,
    headers: &HeaderMap,
    body: &[u8],
    delivery_id: &str,
    received_at_micros: i64,
) -> shared::buffer::BufferedDelivery {
    let verified = shared::signature::verify(
        source.scheme,
        headers,
        body,
        &SecretSet::new(secret_of(source.scheme), None),
        source.tolerance,
        now(),
    )
    .expect("a signed test delivery");
    let kept: BTreeMap<String, String> = shared::ingest::kept_headers(source, headers)
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
        .collect();
    let signed_headers = kept
        .keys()
        .filter(|h| verified.signs_header(h))
        .cloned()
        .collect();
    shared::buffer::BufferedDelivery {
        envelope: shared::buffer::Envelope {
            v: shared::buffer::ENVELOPE_VERSION,
            delivery_id: delivery_id.to_owned(),
            verified_layout: None,
            source_id: source.source_id.as_str().to_owned(),
            received_at_micros,
            verified_with: verified.secret.as_str().to_owned(),
            headers: kept,
            signed_headers,
            signed_digest: verified.signed_digest.map(hex::encode),
            element_digests: Vec::new(),
        },
        body: body.to_vec(),
    }
}

/// Every timestamp of the events, of their sources and of what the anomaly pass keeps
/// (`delivery_hours`, `recent_changes`, the drain's completions, the consistency sweep) moves `interval` into the past, as if that much time had
/// gone by.
pub async fn age(pool: &PgPool, interval: &str) {
    for sql in [
        "UPDATE webhook_events SET received_at = received_at - $1::interval, \
             first_received_at = first_received_at - $1::interval, last_seen_at = last_seen_at - $1::interval, \
             processed_at = processed_at - $1::interval",
        "UPDATE sources SET created_at = created_at - $1::interval",
        "UPDATE delivery_hours SET hour = hour - $1::interval",
        "UPDATE delivery_hours_computed SET hour = hour - $1::interval, computed_at = computed_at - $1::interval",
        "UPDATE delivery_hours_state SET rolled_at = rolled_at - $1::interval",
        "UPDATE view_refreshes SET refreshed_at = refreshed_at - $1::interval",
        "UPDATE recent_changes SET first_received_at = first_received_at - $1::interval, \
             previous_at = previous_at - $1::interval, before_previous_at = before_previous_at - $1::interval",
        "UPDATE recent_changes_state SET read_at = read_at - $1::interval",
        "UPDATE processing_completions SET completed_at = completed_at - $1::interval",
        "UPDATE consistency_sweep SET through_at = through_at - $1::interval, \
             cycle_started_at = cycle_started_at - $1::interval, swept_at = swept_at - $1::interval, \
             window_from = window_from - $1::interval",
        "UPDATE consistency_findings SET first_received_at = first_received_at - $1::interval, \
             found_at = found_at - $1::interval, checked_at = checked_at - $1::interval",
    ] {
        sqlx::query(sql).bind(interval).execute(pool).await.unwrap();
    }
}

/// One backfill pass as the schedule runs it (trigger `test`); it must complete.
pub async fn backfill_pass(
    backfiller: &shared::backfill::Backfiller,
) -> shared::backfill::BackfillOutcome {
    match backfiller.run_once("test").await.unwrap() {
        shared::backfill::BackfillRun::Completed { outcome, .. } => outcome,
        other => panic!("expected a completed pass, got {other:?}"),
    }
}

/// Forty days go by ([`age`]; the default identity horizon is 30) and one retention pass runs
/// with the default settings: the identities it purged.
pub async fn retention_past_the_horizon(pool: &PgPool) -> u64 {
    age(pool, "40 days").await;
    shared::retention::run_once(pool, &Default::default(), "test")
        .await
        .unwrap()
        .identities_purged
}
