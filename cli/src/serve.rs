//! The local runner: the ingest Lambda's handler served over plain HTTP, so `curl` with a signed
//! body lands a row in the local database. Requests go through the same `ingest::handler` API
//! Gateway calls in AWS, with the route's `{source_id}` passed as a path parameter. Beside it,
//! [`spawn_pipeline`] runs the drain and the outbox on a timer, as EventBridge would, and
//! `POST /operator` takes the operator Lambda's JSON.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use lambda_http::RequestExt;
use shared::drain::Drainer;
use shared::effects::EffectRegistry;
use shared::ingest::Ingestor;
use shared::operator;
use shared::outbox::OutboxSender;

#[derive(Clone)]
pub struct Runner {
    pub ingestor: Arc<Ingestor>,
    pub registry: Arc<EffectRegistry>,
    /// The buffer's queues, when the runner buffers (`POST /operator` reads them).
    pub buffer: Option<shared::buffer::BufferQueue>,
}

/// `POST /webhooks/{source_id}`, `POST /operator`, `POST /outbox-sink` (a stand-in target that
/// logs what the outbox delivers), `POST /subscriber-sink?secret=<ref>` (a stand-in subscriber
/// that verifies each delivery's Standard Webhooks signature with that secret and logs it) and
/// `GET /health`. `max_body_bytes` is the ingest limit: the
/// router lets one byte more through so the handler, not the router, answers 413.
pub fn router(runner: Runner, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/webhooks/{source_id}", post(receive))
        .route("/operator", post(operate))
        .route("/outbox-sink", post(sink))
        .route("/subscriber-sink", post(subscriber_sink))
        .route("/health", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(max_body_bytes.saturating_add(1)))
        .with_state(runner)
}

/// Runs the drain and the outbox as the scheduled functions do, each staying for new work and
/// looking again every poll of its settings (`idle_poll`), until the task is dropped: an event
/// reaches the outbox and its subscribers within a poll or two, not at the next minute.
pub fn spawn_pipeline(
    drainer: Arc<Drainer>,
    sender: Option<Arc<OutboxSender>>,
    every: std::time::Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        // The drain in passes of a second: each one with work says what it did (`drain pass
        // finished`), an idle one says nothing, and the log follows the work by a second. The
        // outbox in passes of a minute, as deployed: the end of a pass cuts the calls then in
        // flight short, and each of those is sent again (its key kept).
        let (stint, send_stint) = (
            std::time::Duration::from_secs(1),
            std::time::Duration::from_secs(60),
        );
        let drain = async {
            loop {
                if let Err(error) = drainer.stay_until(std::time::Instant::now() + stint).await {
                    tracing::warn!(%error, "drain pass failed");
                    tokio::time::sleep(every).await;
                }
            }
        };
        let send = async {
            let Some(sender) = &sender else {
                return std::future::pending::<()>().await;
            };
            loop {
                if let Err(error) = sender
                    .stay_until(std::time::Instant::now() + send_stint)
                    .await
                {
                    tracing::warn!(%error, "outbox pass failed");
                    tokio::time::sleep(every).await;
                }
            }
        };
        tokio::join!(drain, send);
    })
}

/// Files what the buffer holds, as the event source mapping would: receives up to ten
/// messages (waiting up to a second), consumes them, and deletes all but those to keep; a
/// database failure keeps them all (they are handed out again after the visibility timeout, and
/// after the redrive policy's receive count land in the dead-letter queue).
pub fn spawn_buffer_consumer(
    pool: shared::store::PgPool,
    queue: shared::buffer::BufferQueue,
    idle: std::time::Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            match consume_once(&pool, &queue, LOCAL_VISIBILITY_SECONDS).await {
                Ok(consumed) if consumed.received() == 0 => tokio::time::sleep(idle).await,
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%error, "buffer consumer pass failed");
                    tokio::time::sleep(idle).await;
                }
            }
        }
    })
}

/// One receive-consume-delete round; returns what became of the messages it received (none:
/// the queue was empty). What it received stays hidden from other receivers for
/// `visibility_seconds`.
pub async fn consume_once(
    pool: &shared::store::PgPool,
    queue: &shared::buffer::BufferQueue,
    visibility_seconds: i32,
) -> Result<shared::buffer::consumer::Consumed, String> {
    let url = queue.queue_url().to_owned();
    let received = queue
        .receive_from(&url, 10, visibility_seconds, 1)
        .await
        .map_err(|e| e.to_string())?;
    if received.is_empty() {
        return Ok(Default::default());
    }
    let handles: Vec<(String, String)> = received
        .iter()
        .map(|m| (m.message_id.clone(), m.receipt_handle.clone()))
        .collect();
    let messages: Vec<shared::buffer::filing::Message> = received
        .into_iter()
        .map(|m| shared::buffer::filing::Message {
            message_id: m.message_id,
            delivery: m.delivery,
        })
        .collect();
    let consumed = shared::buffer::consumer::consume(pool, &messages)
        .await
        .map_err(|e| e.to_string())?;
    for (id, handle) in handles {
        if !consumed.retry.contains(&id) {
            queue
                .delete_from(&url, &handle)
                .await
                .map_err(|e| e.to_string())?;
        }
    }
    Ok(consumed)
}

/// How long a message the local consumer received stays hidden: a pass that died leaves it to
/// reappear this soon.
pub const LOCAL_VISIBILITY_SECONDS: i32 = 5;

/// Creates (or finds) a buffer queue named `name` and its dead-letter queue `<name>-dlq` at the
/// SQS `endpoint` (moto, for the local runner, the drill, the tests and the benchmarks), with
/// the stack's redrive policy: after `max_receives` receives a message moves to the dead-letter
/// queue. Returns the two, connected.
pub async fn create_buffer_queue(
    endpoint: &shared::aws::AwsEndpoint,
    name: &str,
    max_receives: u32,
    visibility_seconds: u32,
) -> Result<shared::buffer::BufferQueue, String> {
    let client = aws_sdk_sqs::Client::new(&shared::aws::sdk_config(endpoint).await);
    let client = &client;
    use aws_sdk_sqs::types::QueueAttributeName;
    let sqs = |e: &dyn std::fmt::Display| format!("creating the buffer queues: {e}");
    let dead_letters = client
        .create_queue()
        .queue_name(format!("{name}-dlq"))
        .send()
        .await
        .map_err(|e| sqs(&aws_sdk_sqs::error::DisplayErrorContext(e)))?
        .queue_url
        .unwrap_or_default();
    let arn = client
        .get_queue_attributes()
        .queue_url(&dead_letters)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .map_err(|e| sqs(&aws_sdk_sqs::error::DisplayErrorContext(e)))?
        .attributes
        .and_then(|mut a| a.remove(&QueueAttributeName::QueueArn))
        .ok_or_else(|| sqs(&"the dead-letter queue has no ARN"))?;
    let queue = client
        .create_queue()
        .queue_name(name)
        .attributes(
            QueueAttributeName::RedrivePolicy,
            serde_json::json!({"deadLetterTargetArn": arn, "maxReceiveCount": max_receives})
                .to_string(),
        )
        .attributes(
            QueueAttributeName::VisibilityTimeout,
            visibility_seconds.to_string(),
        )
        .send()
        .await
        .map_err(|e| sqs(&aws_sdk_sqs::error::DisplayErrorContext(e)))?
        .queue_url
        .unwrap_or_default();
    Ok(
        shared::buffer::BufferQueue::connect(&shared::buffer::QueueSettings {
            queue_url: queue,
            dead_letter_queue_url: Some(dead_letters),
            endpoint: endpoint.clone(),
            metrics_endpoint_url: endpoint.endpoint_url.clone(),
        })
        .await,
    )
}

/// The scheduled passes' settings, as the stack's functions read them.
pub struct MaintenanceSettings {
    pub reconcile: shared::reconcile::ReconcileSettings,
    pub retention: shared::retention::RetentionSettings,
    pub anomaly: shared::anomaly::AnomalySettings,
}

/// Runs a backfill pass, a reconcile pass, a retention pass and the anomaly checks (beside the
/// buffer, when there is one) every `every`, as their EventBridge schedules would, until the
/// task is dropped.
pub fn spawn_maintenance(
    pool: shared::store::PgPool,
    drainer: Arc<Drainer>,
    backfiller: Arc<shared::backfill::Backfiller>,
    settings: MaintenanceSettings,
    buffer: Option<shared::buffer::BufferQueue>,
    every: std::time::Duration,
) -> tokio::task::JoinHandle<()> {
    let MaintenanceSettings {
        reconcile,
        retention,
        anomaly,
    } = settings;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(error) = backfiller.run_once("local-schedule").await {
                tracing::warn!(%error, "backfill pass failed");
            }
            if let Err(error) =
                shared::reconcile::run_once(&pool, &drainer, &reconcile, "local-schedule").await
            {
                tracing::warn!(%error, "reconcile pass failed");
            }
            if let Err(error) =
                shared::retention::run_once(&pool, &retention, "local-schedule").await
            {
                tracing::warn!(%error, "retention pass failed");
            }
            if let Err(error) = shared::anomaly::run_once_with_buffer(
                &pool,
                &anomaly,
                "local-schedule",
                buffer.as_ref(),
            )
            .await
            {
                tracing::warn!(%error, "anomaly checks failed");
            }
        }
    })
}

async fn operate(State(runner): State<Runner>, body: Bytes) -> Response {
    let request = serde_json::from_slice(&body)
        .map_err(|e| operator::OperatorError::BadRequest(e.to_string()))
        .and_then(operator::parse);
    let result = match request {
        Ok(request) => {
            let invocation = operator::Invocation::via(operator::Via::LocalRunner);
            operator::handle_invoked(
                runner.ingestor.pool(),
                &runner.registry,
                runner.buffer.as_ref(),
                request,
                &invocation,
            )
            .await
        }
        Err(e) => Err(e),
    };
    match result {
        Ok(response) => (StatusCode::OK, axum::Json(response)).into_response(),
        Err(error @ operator::OperatorError::BadRequest(_)) => {
            (StatusCode::BAD_REQUEST, error.to_string()).into_response()
        }
        Err(error) => (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response(),
    }
}

async fn sink(headers: HeaderMap, body: Bytes) -> StatusCode {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let action = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["action"].as_str().map(str::to_owned));
    tracing::info!(
        idempotency_key = key,
        action = action.as_deref().unwrap_or("?"),
        "outbox-sink received"
    );
    StatusCode::NO_CONTENT
}

#[derive(serde::Deserialize)]
struct SinkQuery {
    secret: String,
}

/// A subscriber as a team would write one: verifies the signature (401 when it does not hold),
/// then logs what arrived.
async fn subscriber_sink(
    State(runner): State<Runner>,
    axum::extract::Query(query): axum::extract::Query<SinkQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    let id = headers
        .get("webhook-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let secrets = match runner.ingestor.secrets().secrets(&query.secret).await {
        Ok(secrets) => secrets,
        Err(error) => {
            tracing::warn!(secret_ref = %query.secret, %error, "subscriber-sink has no secret to verify with");
            return StatusCode::INTERNAL_SERVER_ERROR;
        }
    };
    let verified = shared::signature::verify(
        shared::domain::Scheme::StandardWebhooks,
        &headers,
        &body,
        &secrets,
        std::time::Duration::from_secs(300),
        chrono::Utc::now().timestamp(),
    );
    let envelope = serde_json::from_slice::<serde_json::Value>(&body).unwrap_or_default();
    match verified {
        Ok(_) => {
            tracing::info!(
                webhook_id = %id,
                event_type = envelope["type"].as_str().unwrap_or("?"),
                source = envelope["source"].as_str().unwrap_or("?"),
                provider_event_id = envelope["providerid"].as_str().unwrap_or("?"),
                "subscriber-sink received a delivery: signature verified"
            );
            StatusCode::NO_CONTENT
        }
        Err(error) => {
            tracing::warn!(webhook_id = %id, %error, "subscriber-sink refused a delivery: signature not verified");
            StatusCode::UNAUTHORIZED
        }
    }
}

/// Serves until the listener fails or the task is dropped, each request knowing its TCP peer
/// (the address ingest checks against a provider's published ranges).
pub async fn serve(listener: tokio::net::TcpListener, router: Router) -> std::io::Result<()> {
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
}

/// As API Gateway does, hands the handler the request's own URI and the route's `{source_id}`
/// percent-decoded, whatever it decodes to (a NUL byte, a space, a slash): the handler answers
/// an id no source can have 404. The URI is the one the client sent, never rebuilt from the
/// decoded id (which need not be a valid URI). The TCP peer is the request context's
/// `http.sourceIp`, as API Gateway's edge fills it; served without [`serve`] (no peer known),
/// the context has none.
async fn receive(
    State(runner): State<Runner>,
    peer: Option<axum::Extension<ConnectInfo<SocketAddr>>>,
    Path(source_id): Path<String>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut context =
        lambda_http::aws_lambda_events::apigw::ApiGatewayV2httpRequestContext::default();
    context.http.source_ip = peer.map(|axum::Extension(ConnectInfo(peer))| peer.ip().to_string());
    to_ingest(&runner, source_id, uri, headers, body, context).await
}

/// A POST to the ingest handler, as API Gateway hands it one: the request's URI and headers,
/// the route's `{source_id}`, and `context` (the caller's `http.sourceIp`, a client
/// certificate); its answer as the client gets it.
pub async fn to_ingest(
    runner: &Runner,
    source_id: String,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
    mut context: lambda_http::aws_lambda_events::apigw::ApiGatewayV2httpRequestContext,
) -> Response {
    let mut request = lambda_http::http::Request::new(lambda_http::Body::Binary(body.to_vec()));
    *request.method_mut() = lambda_http::http::Method::POST;
    *request.uri_mut() = uri;
    *request.headers_mut() = headers;
    context.http.method = lambda_http::http::Method::POST;
    let request = request
        .with_path_parameters(HashMap::from([("source_id".to_owned(), source_id)]))
        .with_request_context(lambda_http::request::RequestContext::ApiGatewayV2(context));
    match ingest::handler(request, &runner.ingestor).await {
        Ok(response) => {
            let (parts, body) = response.into_parts();
            (parts.status, parts.headers, body.to_vec()).into_response()
        }
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

// Issue 24: the outbox's destinations on a local AWS stand-in.

/// Creates on `endpoint` (moto) every queue, bus and topic the routes name, when missing, and
/// a tap queue `<bus>-tap` / `<topic>-tap` behind each bus (a rule matching every event) and
/// topic (a raw subscription), so what arrived can be read back. Returns one line per
/// destination, saying where to read it.
pub async fn create_local_destinations(
    endpoints: &shared::outbox::destinations::AwsDestinationEndpoints,
    routes: &[shared::outbox::routes::Route],
) -> Result<Vec<String>, String> {
    use aws_sdk_sqs::types::QueueAttributeName;
    use shared::outbox::destinations::Destination;
    let sqs = aws_sdk_sqs::Client::new(&shared::aws::sdk_config(&endpoints.sqs).await);
    let eventbridge =
        aws_sdk_eventbridge::Client::new(&shared::aws::sdk_config(&endpoints.eventbridge).await);
    let sns = aws_sdk_sns::Client::new(&shared::aws::sdk_config(&endpoints.sns).await);
    let context = |what: &str, e: &dyn std::fmt::Display| format!("creating {what}: {e}");
    let queue = |name: String| {
        let sqs = sqs.clone();
        async move {
            let mut create = sqs.create_queue().queue_name(&name);
            if name.ends_with(".fifo") {
                create = create
                    .attributes(QueueAttributeName::FifoQueue, "true")
                    .attributes(QueueAttributeName::ContentBasedDeduplication, "false");
            }
            let url = create
                .send()
                .await
                .map_err(|e| {
                    format!(
                        "creating queue {name}: {}",
                        aws_sdk_sqs::error::DisplayErrorContext(e)
                    )
                })?
                .queue_url
                .unwrap_or_default();
            let arn = sqs
                .get_queue_attributes()
                .queue_url(&url)
                .attribute_names(QueueAttributeName::QueueArn)
                .send()
                .await
                .map_err(|e| {
                    format!(
                        "reading queue {name}: {}",
                        aws_sdk_sqs::error::DisplayErrorContext(e)
                    )
                })?
                .attributes
                .and_then(|mut a| a.remove(&QueueAttributeName::QueueArn))
                .unwrap_or_default();
            Ok::<_, String>((url, arn))
        }
    };
    let mut seen = std::collections::HashSet::new();
    let mut lines = Vec::new();
    for route in routes {
        if !seen.insert(route.destination.clone()) {
            continue;
        }
        match &route.destination {
            Destination::Http { .. } => {}
            Destination::Sqs { queue_url } => {
                let name = queue_url.rsplit('/').next().unwrap_or_default().to_owned();
                let (url, _) = queue(name).await?;
                lines.push(format!("sqs queue {url}"));
            }
            Destination::EventBridge { bus, .. } => {
                let name = bus.rsplit('/').next().unwrap_or(bus).to_owned();
                if name != "default" {
                    // An existing bus answers ResourceAlreadyExistsException: kept as it is.
                    let _ = eventbridge.create_event_bus().name(&name).send().await;
                }
                let (tap_url, tap_arn) = queue(format!("{name}-tap")).await?;
                let rule = format!("{name}-tap");
                eventbridge
                    .put_rule()
                    .name(&rule)
                    .event_bus_name(&name)
                    .event_pattern(r#"{"detail-type": [{"exists": true}]}"#)
                    .send()
                    .await
                    .map_err(|e| {
                        context(
                            "a tap rule",
                            &aws_sdk_eventbridge::error::DisplayErrorContext(e),
                        )
                    })?;
                eventbridge
                    .put_targets()
                    .rule(&rule)
                    .event_bus_name(&name)
                    .targets(
                        aws_sdk_eventbridge::types::Target::builder()
                            .id("tap")
                            .arn(&tap_arn)
                            .build()
                            .map_err(|e| context("a tap target", &e))?,
                    )
                    .send()
                    .await
                    .map_err(|e| {
                        context(
                            "a tap target",
                            &aws_sdk_eventbridge::error::DisplayErrorContext(e),
                        )
                    })?;
                lines.push(format!(
                    "eventbridge bus {name}: every event also to {tap_url}"
                ));
            }
            Destination::Sns { topic_arn } => {
                let name = topic_arn.rsplit(':').next().unwrap_or_default().to_owned();
                let mut create = sns.create_topic().name(&name);
                if name.ends_with(".fifo") {
                    create = create.attributes("FifoTopic", "true");
                }
                let arn = create
                    .send()
                    .await
                    .map_err(|e| context("a topic", &aws_sdk_sns::error::DisplayErrorContext(e)))?
                    .topic_arn
                    .unwrap_or_default();
                let tap = if name.ends_with(".fifo") {
                    format!("{}-tap.fifo", name.trim_end_matches(".fifo"))
                } else {
                    format!("{name}-tap")
                };
                let (tap_url, tap_arn) = queue(tap).await?;
                sns.subscribe()
                    .topic_arn(&arn)
                    .protocol("sqs")
                    .endpoint(&tap_arn)
                    .attributes("RawMessageDelivery", "true")
                    .send()
                    .await
                    .map_err(|e| {
                        context(
                            "a tap subscription",
                            &aws_sdk_sns::error::DisplayErrorContext(e),
                        )
                    })?;
                if arn != *topic_arn {
                    lines.push(format!(
                        "sns topic {arn} (the route says {topic_arn}: check its region and account)"
                    ));
                } else {
                    lines.push(format!("sns topic {arn}: every message also to {tap_url}"));
                }
            }
        }
    }
    Ok(lines)
}
