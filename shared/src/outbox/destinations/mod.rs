//! Where outbox messages go: an HTTP target (one POST per message, the `Idempotency-Key`
//! header), an EventBridge bus (`PutEvents`), an SQS queue (`SendMessageBatch`) or an SNS topic
//! (`PublishBatch`), each in batches of at most ten. Every message comes back with its own
//! [`Delivery`]: an entry that failed inside a call that succeeded is that entry's failure only,
//! and an entry the answer does not name is never taken for delivered.

mod eventbridge;
mod http;
mod sns;
mod sqs;

use std::time::Duration;

use aws_sdk_sqs::config::http::HttpResponse;
use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use sha2::Digest as _;
use tokio::sync::OnceCell;

use crate::aws::AwsEndpoint;
use crate::store::outbox::OutboxMessage;

/// The entries' `Source` of an EventBridge route that names none.
pub const DEFAULT_EVENT_SOURCE: &str = "webhook-receiver";

pub use eventbridge::put_events_outcomes;
pub use sns::publish_batch_outcomes;
pub use sqs::send_batch_outcomes;

/// At most this many entries in one `PutEvents`, `SendMessageBatch` or `PublishBatch`.
pub const BATCH_ENTRIES: usize = 10;

/// One destination: what a route names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Destination {
    Http {
        url: String,
    },
    EventBridge {
        /// A bus name or ARN.
        bus: String,
        /// The entries' `Source`.
        event_source: String,
    },
    Sqs {
        queue_url: String,
    },
    Sns {
        topic_arn: String,
    },
}

/// The kinds of destination, as metrics and the route file name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Http,
    EventBridge,
    Sqs,
    Sns,
}

impl Kind {
    pub const ALL: [Kind; 4] = [Kind::Http, Kind::EventBridge, Kind::Sqs, Kind::Sns];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Http => "http",
            Kind::EventBridge => "eventbridge",
            Kind::Sqs => "sqs",
            Kind::Sns => "sns",
        }
    }
}

fn is_http_url(url: &str) -> bool {
    url.starts_with("https://") || url.starts_with("http://")
}

impl Destination {
    pub fn http(url: String) -> Result<Self, String> {
        if !is_http_url(&url) {
            return Err(format!("url {url:?} is not an http(s) URL"));
        }
        Ok(Destination::Http { url })
    }

    pub fn eventbridge(bus: String, event_source: String) -> Result<Self, String> {
        let name = bus
            .rsplit_once(":event-bus/")
            .map_or(bus.as_str(), |(_, n)| n);
        if bus.starts_with("arn:") && !bus.contains(":events:") {
            return Err(format!("bus {bus:?} is not an EventBridge bus ARN"));
        }
        if name.is_empty()
            || name.len() > 256
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-/".contains(c))
        {
            return Err(format!(
                "bus {bus:?} is not a bus name (letters, digits, . _ - /) or ARN"
            ));
        }
        if event_source.is_empty() || event_source.len() > 256 {
            return Err("event_source must be 1 to 256 characters".into());
        }
        if event_source.starts_with("aws.") {
            return Err(format!(
                "event_source {event_source:?} starts with \"aws.\", which EventBridge keeps for AWS's own events"
            ));
        }
        Ok(Destination::EventBridge { bus, event_source })
    }

    pub fn sqs(queue_url: String) -> Result<Self, String> {
        let path = queue_url
            .strip_prefix("https://")
            .or_else(|| queue_url.strip_prefix("http://"))
            .and_then(|rest| rest.split_once('/'))
            .map(|(_, path)| path);
        let well_formed = path.is_some_and(|p| {
            let mut parts = p.split('/');
            let account = parts.next().unwrap_or_default();
            let name = parts.next().unwrap_or_default();
            account.len() == 12
                && account.chars().all(|c| c.is_ascii_digit())
                && !name.is_empty()
                && parts.next().is_none()
        });
        if !well_formed {
            return Err(format!(
                "queue_url {queue_url:?} is not an SQS queue URL (https://sqs.<region>.amazonaws.com/<account>/<name>)"
            ));
        }
        Ok(Destination::Sqs { queue_url })
    }

    pub fn sns(topic_arn: String) -> Result<Self, String> {
        let parts: Vec<&str> = topic_arn.split(':').collect();
        let well_formed = parts.len() == 6
            && parts[0] == "arn"
            && parts[2] == "sns"
            && parts[4].len() == 12
            && !parts[5].is_empty();
        if !well_formed {
            return Err(format!(
                "topic_arn {topic_arn:?} is not an SNS topic ARN (arn:aws:sns:<region>:<account>:<name>)"
            ));
        }
        Ok(Destination::Sns { topic_arn })
    }

    pub fn kind(&self) -> Kind {
        match self {
            Destination::Http { .. } => Kind::Http,
            Destination::EventBridge { .. } => Kind::EventBridge,
            Destination::Sqs { .. } => Kind::Sqs,
            Destination::Sns { .. } => Kind::Sns,
        }
    }

    /// A FIFO queue or topic: each entry carries `MessageGroupId` (the entity) and
    /// `MessageDeduplicationId` (the idempotency key).
    pub fn is_fifo(&self) -> bool {
        match self {
            Destination::Sqs { queue_url } => queue_url.ends_with(".fifo"),
            Destination::Sns { topic_arn } => topic_arn.ends_with(".fifo"),
            _ => false,
        }
    }

    /// Where a message went, as `outbox.destination` and `hookctl outbox list` show it.
    pub fn describe(&self) -> String {
        match self {
            Destination::Http { url } => format!("http {url}"),
            Destination::EventBridge { bus, .. } => format!("eventbridge {bus}"),
            Destination::Sqs { queue_url } => format!("sqs {queue_url}"),
            Destination::Sns { topic_arn } => format!("sns {topic_arn}"),
        }
    }

    /// The largest body one message may carry here, with room for its attributes: EventBridge
    /// and SNS take 256 KiB an entry, SQS 1 MiB a message, HTTP what the target takes.
    pub fn max_body_bytes(&self) -> usize {
        match self {
            Destination::Http { .. } => usize::MAX,
            Destination::EventBridge { .. } | Destination::Sns { .. } => 256 * 1024 - 2048,
            Destination::Sqs { .. } => 1024 * 1024 - 2048,
        }
    }

    /// How many messages one call carries.
    fn entries_per_call(&self) -> usize {
        match self {
            Destination::Http { .. } => 1,
            _ => BATCH_ENTRIES,
        }
    }

    /// The most bytes one call may carry, all entries together (the services' request limits).
    fn bytes_per_call(&self) -> usize {
        match self {
            Destination::Http { .. } => usize::MAX,
            // PutEvents and PublishBatch: 256 KiB for the whole request.
            Destination::EventBridge { .. } | Destination::Sns { .. } => 256 * 1024,
            // SendMessageBatch: 1 MiB for the whole batch.
            Destination::Sqs { .. } => 1024 * 1024,
        }
    }

    /// (kind, target, event_source), the `outbox_routes` columns.
    pub fn to_columns(&self) -> (&'static str, String, Option<String>) {
        match self {
            Destination::Http { url } => ("http", url.clone(), None),
            Destination::EventBridge { bus, event_source } => {
                ("eventbridge", bus.clone(), Some(event_source.clone()))
            }
            Destination::Sqs { queue_url } => ("sqs", queue_url.clone(), None),
            Destination::Sns { topic_arn } => ("sns", topic_arn.clone(), None),
        }
    }

    pub fn from_columns(
        kind: &str,
        target: &str,
        event_source: Option<String>,
    ) -> Result<Self, String> {
        match kind {
            "http" => Self::http(target.to_owned()),
            "eventbridge" => Self::eventbridge(
                target.to_owned(),
                event_source.unwrap_or_else(|| DEFAULT_EVENT_SOURCE.to_owned()),
            ),
            "sqs" => Self::sqs(target.to_owned()),
            "sns" => Self::sns(target.to_owned()),
            other => Err(format!("unknown destination kind {other:?}")),
        }
    }
}

/// What one try of one message came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    Delivered,
    /// Worth trying again: timeouts, throttling, 5xx, connection errors, a service's own fault.
    Transient(String),
    /// Refused for good: a missing queue, a denied permission, a message the service rejects.
    Refused(String),
    /// The subscriber answered 410 Gone: it wants no more. A subscription is paused (its
    /// messages wait); any other message is refused.
    Gone(String),
}

/// A message as it goes out: its row and the body it carries.
pub struct Outgoing<'a> {
    pub message: &'a OutboxMessage,
    /// What the call carries: an effect's [`envelope`] (over HTTP, its action, event and
    /// payload), a subscription's CloudEvents envelope (`subscriptions::envelope`), without its
    /// data when over the destination's limit. Serialised once, here.
    pub body: String,
    /// A subscription's message (action `event:<name>`).
    pub forwarded: bool,
    /// Sent without its data: the envelope was over the destination's limit.
    pub data_omitted: bool,
    /// HTTP: the secrets its Standard Webhooks signature is made with.
    pub signing: Option<std::sync::Arc<crate::secrets::SecretSet>>,
}

impl<'a> Outgoing<'a> {
    /// An effect's message, or a subscription's with its data whatever its size.
    pub fn new(message: &'a OutboxMessage) -> Self {
        let forwarded = crate::subscriptions::name_of(&message.action).is_some();
        Self {
            message,
            body: if forwarded {
                message.payload.to_string()
            } else {
                envelope(message).to_string()
            },
            forwarded,
            data_omitted: false,
            signing: None,
        }
    }

    /// The message as `destination` takes it: an effect's over HTTP as its action, event and
    /// payload (the body HTTP targets have always had); a subscription's envelope over the
    /// destination's limit without its data, marked so, with the request that fetches it.
    pub fn to(message: &'a OutboxMessage, destination: &Destination) -> Self {
        let forwarded = crate::subscriptions::name_of(&message.action).is_some();
        if !forwarded && destination.kind() == Kind::Http {
            return Self {
                message,
                body: http::body_of(message),
                forwarded,
                data_omitted: false,
                signing: None,
            };
        }
        let mut o = Self::new(message);
        if o.forwarded
            && o.body.len() > destination.max_body_bytes()
            && let Some(slim) = crate::subscriptions::envelope::without_data(&message.payload)
        {
            o.body = slim.to_string();
            o.data_omitted = true;
        }
        o
    }

    /// EventBridge's `DetailType`: a subscription's event type, an effect's action.
    pub fn detail_type(&self) -> &str {
        if self.forwarded {
            self.message
                .payload
                .get("type")
                .and_then(|t| t.as_str())
                .unwrap_or(&self.message.action)
        } else {
            &self.message.action
        }
    }

    /// A subscription's (type, source, tenant), as message attributes.
    pub fn forwarded_attributes(&self) -> Vec<(&'static str, &str)> {
        if !self.forwarded {
            return Vec::new();
        }
        crate::subscriptions::envelope::attributes(&self.message.payload)
            .map(|a| a.to_vec())
            .unwrap_or_default()
    }
}

/// What a consumer of EventBridge (the event's `detail`), SQS (the body) or SNS (the message)
/// receives of an effect: the action, whose event it is, the idempotency key to deduplicate
/// with, and the effect's payload.
pub fn envelope(message: &OutboxMessage) -> serde_json::Value {
    serde_json::json!({
        "action": message.action,
        "tenant_id": message.tenant_id,
        "event_id": message.external_id,
        "idempotency_key": message.idempotency_key,
        "payload": message.payload,
    })
}

/// The `MessageGroupId` of a FIFO entry: the entity the message is about (`thing:42` for an
/// entity change, `order:ord_1` for a fulfilment, `<source>:<subject>` for a subscription's
/// event that names its entity), so one entity's messages stay in order and
/// different entities' do not wait for each other; the event id when it names none. A value SQS
/// would refuse (over 128 characters, or outside ASCII punctuation and alphanumerics) is
/// replaced by its SHA-256, which keeps the grouping.
pub fn group_of(message: &OutboxMessage) -> String {
    let p = &message.payload;
    let text = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    };
    let forwarded_subject = crate::subscriptions::name_of(&message.action).and_then(|_| {
        Some(format!(
            "{}:{}",
            text(p.get("sourceid")?)?,
            text(p.get("subject")?)?
        ))
    });
    let group = match (
        p.get("entity_type").and_then(text),
        p.get("entity_id").and_then(text),
        p.get("order_id").and_then(text),
    ) {
        (Some(kind), Some(id), _) => format!("{kind}:{id}"),
        (_, _, Some(order)) => format!("order:{order}"),
        _ if forwarded_subject.is_some() => forwarded_subject.unwrap_or_default(),
        _ => format!("event:{}", message.external_id),
    };
    let allowed = |c: char| c.is_ascii_alphanumeric() || c.is_ascii_punctuation();
    if group.len() <= 128 && group.chars().all(allowed) {
        group
    } else {
        hex::encode(sha2::Sha256::digest(group.as_bytes()))
    }
}

/// Splits one destination's messages into calls: at most [`BATCH_ENTRIES`] each and within the
/// service's request size. A message too large for any call goes alone, and the service's
/// refusal is its own.
pub fn calls<'a, 'b>(
    destination: &Destination,
    outgoing: &'b [Outgoing<'a>],
) -> Vec<&'b [Outgoing<'a>]> {
    let (entries, bytes) = (destination.entries_per_call(), destination.bytes_per_call());
    let mut calls = Vec::new();
    let (mut start, mut size) = (0, 0usize);
    for (i, o) in outgoing.iter().enumerate() {
        let len = o.body.len() + o.message.action.len() + 64;
        if i > start && (i - start == entries || size.saturating_add(len) > bytes) {
            calls.push(&outgoing[start..i]);
            (start, size) = (i, 0);
        }
        size = size.saturating_add(len);
    }
    if start < outgoing.len() {
        calls.push(&outgoing[start..]);
    }
    calls
}

/// Error codes that mean "later", whatever the HTTP status: throttling and the service's own
/// faults.
fn is_transient_code(code: &str) -> bool {
    let code = code.rsplit('.').next().unwrap_or(code);
    matches!(
        code,
        "ThrottlingException"
            | "Throttling"
            | "ThrottledException"
            | "RequestThrottled"
            | "RequestThrottledException"
            | "TooManyRequestsException"
            | "ProvisionedThroughputExceededException"
            | "RequestLimitExceeded"
            | "LimitExceededException"
            | "KMSThrottlingException"
            | "KMSThrottling"
            | "KmsThrottled"
            | "InternalError"
            | "InternalFailure"
            | "InternalErrorException"
            | "ServiceUnavailable"
            | "ServiceUnavailableException"
            | "RequestTimeout"
            | "RequestTimeoutException"
    )
}

/// One entry's failure inside a call that succeeded.
fn entry_failed(code: &str, message: &str, sender_fault: bool) -> Delivery {
    let why = short(format!("{code}: {message}"));
    if is_transient_code(code) || !sender_fault {
        Delivery::Transient(why)
    } else {
        Delivery::Refused(why)
    }
}

/// A whole call that failed: every entry of it shares the outcome.
fn call_failed<E>(operation: &str, error: SdkError<E, HttpResponse>) -> Delivery
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let status = error.raw_response().map(|r| r.status().as_u16());
    let code = error.code().unwrap_or_default().to_owned();
    let why = short(format!(
        "{operation} failed: {}",
        DisplayErrorContext(&error)
    ));
    match error {
        SdkError::ConstructionFailure(_) => Delivery::Refused(why),
        SdkError::ServiceError(_) => {
            let server = status.is_some_and(|s| s >= 500 || s == 429 || s == 408);
            if server || is_transient_code(&code) {
                Delivery::Transient(why)
            } else {
                Delivery::Refused(why)
            }
        }
        // Timeouts, connection failures, unreadable answers.
        _ => Delivery::Transient(why),
    }
}

/// An entry the answer names neither as sent nor as failed: not delivered.
fn unanswered() -> Delivery {
    Delivery::Transient("the answer did not name this entry".into())
}

/// Outcomes in the batch's order from the ids the answer names (`"0"`, `"1"`... by position).
fn by_entry_id(
    len: usize,
    succeeded: impl IntoIterator<Item = String>,
    failed: impl IntoIterator<Item = (String, Delivery)>,
) -> Vec<Delivery> {
    let mut outcomes: Vec<Option<Delivery>> = vec![None; len];
    let slot = |id: &str| id.parse::<usize>().ok().filter(|i| *i < len);
    for (id, why) in failed {
        if let Some(i) = slot(&id) {
            outcomes[i] = Some(why);
        }
    }
    for id in succeeded {
        if let Some(i) = slot(&id) {
            // A failure named for the same entry wins: never delivered on a contradiction.
            outcomes[i].get_or_insert(Delivery::Delivered);
        }
    }
    outcomes
        .into_iter()
        .map(|o| o.unwrap_or_else(unanswered))
        .collect()
}

/// Keeps an error short enough for `last_error` and a table cell.
fn short(mut why: String) -> String {
    const MAX: usize = 600;
    if why.len() > MAX {
        let mut end = MAX;
        while !why.is_char_boundary(end) {
            end -= 1;
        }
        why.truncate(end);
        why.push('…');
    }
    why
}

/// Endpoint overrides per service (`EVENTBRIDGE_ENDPOINT`, `SQS_ENDPOINT`, `SNS_ENDPOINT`):
/// moto locally, VPC endpoints in production.
#[derive(Debug, Clone, Default)]
pub struct AwsDestinationEndpoints {
    pub eventbridge: AwsEndpoint,
    pub sqs: AwsEndpoint,
    pub sns: AwsEndpoint,
}

impl AwsDestinationEndpoints {
    /// One endpoint for every service (moto serves them all on one port).
    pub fn all(endpoint: AwsEndpoint) -> Self {
        Self {
            eventbridge: endpoint.clone(),
            sqs: endpoint.clone(),
            sns: endpoint,
        }
    }
}

struct AwsClients {
    eventbridge: aws_sdk_eventbridge::Client,
    sqs: aws_sdk_sqs::Client,
    sns: aws_sdk_sns::Client,
}

/// The clients of every destination, one of each per process; the AWS ones built at the first
/// message routed to AWS (an HTTP-only sender never loads an AWS configuration).
pub struct Destinations {
    http: reqwest::Client,
    request_timeout: Duration,
    endpoints: AwsDestinationEndpoints,
    aws: OnceCell<AwsClients>,
    /// The HTTP URL last called, parsed: a batch calls one URL many times, and parsing it (its
    /// host through IDNA) was a share of every call.
    parsed: std::sync::Mutex<Option<(String, reqwest::Url)>>,
}

impl Destinations {
    pub fn new(
        request_timeout: Duration,
        endpoints: AwsDestinationEndpoints,
    ) -> Result<Self, reqwest::Error> {
        Ok(Self {
            http: http::client(request_timeout)?,
            request_timeout,
            endpoints,
            aws: OnceCell::new(),
            parsed: std::sync::Mutex::new(None),
        })
    }

    /// `url` parsed, from the last parse when it is the same; `None` when it does not parse
    /// (a stored route is validated, so only a hand-edited one).
    fn parsed(&self, url: &str) -> Option<reqwest::Url> {
        let mut last = self.parsed.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((text, parsed)) = last.as_ref()
            && text == url
        {
            return Some(parsed.clone());
        }
        let parsed = reqwest::Url::parse(url).ok()?;
        *last = Some((url.to_owned(), parsed.clone()));
        Some(parsed)
    }

    async fn aws(&self) -> &AwsClients {
        self.aws
            .get_or_init(|| async {
                let timeouts = aws_sdk_sqs::config::timeout::TimeoutConfig::builder()
                    .operation_attempt_timeout(self.request_timeout)
                    .operation_timeout(self.request_timeout)
                    .build();
                let e = &self.endpoints;
                let eventbridge = crate::aws::sdk_config(&e.eventbridge).await;
                let sqs = crate::aws::sdk_config(&e.sqs).await;
                let sns = crate::aws::sdk_config(&e.sns).await;
                AwsClients {
                    eventbridge: aws_sdk_eventbridge::Client::from_conf(
                        aws_sdk_eventbridge::config::Builder::from(&eventbridge)
                            .timeout_config(timeouts.clone())
                            .build(),
                    ),
                    sqs: aws_sdk_sqs::Client::from_conf(
                        aws_sdk_sqs::config::Builder::from(&sqs)
                            .timeout_config(timeouts.clone())
                            .build(),
                    ),
                    sns: aws_sdk_sns::Client::from_conf(
                        aws_sdk_sns::config::Builder::from(&sns)
                            .timeout_config(timeouts)
                            .build(),
                    ),
                }
            })
            .await
    }

    /// Sends one call's messages (see [`calls`]) and answers one outcome per message, in order.
    /// Gives up after `timeout`: every message of the call is then a transient failure (the
    /// request may have been sent, so the try counts).
    pub async fn deliver(
        &self,
        destination: &Destination,
        call: &[Outgoing<'_>],
        timeout: Duration,
    ) -> Vec<Delivery> {
        let sent = async {
            match destination {
                Destination::Http { url } => {
                    let Some(parsed) = self.parsed(url) else {
                        let why = format!("the route's URL {url:?} does not parse");
                        return call
                            .iter()
                            .map(|_| Delivery::Refused(why.clone()))
                            .collect();
                    };
                    let mut outcomes = Vec::with_capacity(call.len());
                    for o in call {
                        outcomes.push(http::post(&self.http, parsed.clone(), o, timeout).await);
                    }
                    outcomes
                }
                Destination::EventBridge { bus, event_source } => {
                    let client = &self.aws().await.eventbridge;
                    eventbridge::put_events(client, bus, event_source, call).await
                }
                Destination::Sqs { queue_url } => {
                    let client = &self.aws().await.sqs;
                    sqs::send_batch(client, queue_url, destination.is_fifo(), call).await
                }
                Destination::Sns { topic_arn } => {
                    let client = &self.aws().await.sns;
                    sns::publish_batch(client, topic_arn, destination.is_fifo(), call).await
                }
            }
        };
        // Boxed: the SDKs' futures are deep, and inline they overflow the compiler's layout
        // query depth in the outbox function's `main` (as the buffer's filing did).
        match tokio::time::timeout(timeout, Box::pin(sent)).await {
            Ok(outcomes) => outcomes,
            Err(_) => {
                let why = format!(
                    "{} did not answer within {} ms",
                    destination.kind().as_str(),
                    timeout.as_millis()
                );
                vec![Delivery::Transient(why); call.len()]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(payload: serde_json::Value) -> OutboxMessage {
        OutboxMessage {
            outbox_id: 1,
            tenant_id: "t".into(),
            external_id: "evt_1".into(),
            action: "entity.changed".into(),
            payload,
            idempotency_key: "k".into(),
            attempts: 0,
            source_id: None,
        }
    }

    #[test]
    fn the_group_is_the_entity_and_always_one_sqs_takes() {
        let m = message(serde_json::json!({"entity_type": "thing", "entity_id": "42"}));
        assert_eq!(group_of(&m), "thing:42");
        let m = message(serde_json::json!({"order_id": "ord_1", "amount_minor": 5}));
        assert_eq!(group_of(&m), "order:ord_1");
        assert_eq!(group_of(&message(serde_json::json!({}))), "event:evt_1");
        let odd = message(serde_json::json!({"entity_type": "thing", "entity_id": "ä b"}));
        let hashed = group_of(&odd);
        assert_eq!(hashed.len(), 64);
        assert_eq!(hashed, group_of(&odd), "the same entity, the same group");
        let long = message(serde_json::json!({"entity_type": "t", "entity_id": "x".repeat(200)}));
        assert_eq!(group_of(&long).len(), 64);
    }

    #[test]
    fn calls_hold_at_most_ten_entries_and_the_service_request_size() {
        let small: Vec<OutboxMessage> = (0..23).map(|_| message(serde_json::json!({}))).collect();
        let outgoing: Vec<Outgoing> = small.iter().map(Outgoing::new).collect();
        let sqs =
            Destination::sqs("https://sqs.us-east-1.amazonaws.com/123456789012/q".into()).unwrap();
        let sizes: Vec<usize> = calls(&sqs, &outgoing).iter().map(|c| c.len()).collect();
        assert_eq!(sizes, [10, 10, 3]);
        let http = Destination::http("https://x.example/h".into()).unwrap();
        assert_eq!(calls(&http, &outgoing).len(), 23);

        let big = "x".repeat(100 * 1024);
        let mut large: Vec<OutboxMessage> = (0..4)
            .map(|_| message(serde_json::json!({ "blob": big })))
            .collect();
        large.push(message(
            serde_json::json!({ "blob": "y".repeat(300 * 1024) }),
        ));
        let outgoing: Vec<Outgoing> = large.iter().map(Outgoing::new).collect();
        let sns = Destination::sns("arn:aws:sns:us-east-1:123456789012:t".into()).unwrap();
        let sizes: Vec<usize> = calls(&sns, &outgoing).iter().map(|c| c.len()).collect();
        assert_eq!(
            sizes,
            [2, 2, 1],
            "256 KiB per PublishBatch; the oversized one alone"
        );
    }

    #[test]
    fn throttling_and_service_faults_are_retried_and_sender_faults_are_not() {
        assert!(matches!(
            entry_failed("ThrottlingException", "slow down", true),
            Delivery::Transient(_)
        ));
        assert!(matches!(
            entry_failed("KMS.ThrottlingException", "", true),
            Delivery::Transient(_)
        ));
        assert!(matches!(
            entry_failed("InternalError", "", false),
            Delivery::Transient(_)
        ));
        assert!(matches!(
            entry_failed("SomethingNew", "", false),
            Delivery::Transient(_)
        ));
        assert!(matches!(
            entry_failed("InvalidParameter", "Message too long", true),
            Delivery::Refused(_)
        ));
    }

    #[test]
    fn an_entry_the_answer_does_not_name_is_not_delivered() {
        let outcomes = by_entry_id(
            4,
            ["0".to_owned(), "2".to_owned(), "9".to_owned()],
            [
                ("2".to_owned(), Delivery::Refused("both".into())),
                ("3".to_owned(), Delivery::Transient("busy".into())),
            ],
        );
        assert_eq!(
            outcomes,
            [
                Delivery::Delivered,
                unanswered(),
                Delivery::Refused("both".into()),
                Delivery::Transient("busy".into()),
            ]
        );
    }

    #[test]
    fn destinations_are_validated() {
        assert!(
            Destination::sqs("https://sqs.us-east-1.amazonaws.com/123456789012/a.fifo".into())
                .unwrap()
                .is_fifo()
        );
        assert!(Destination::sqs("https://sqs.us-east-1.amazonaws.com/a".into()).is_err());
        assert!(
            Destination::sns("arn:aws:sns:us-east-1:123456789012:t.fifo".into())
                .unwrap()
                .is_fifo()
        );
        assert!(Destination::sns("arn:aws:sns:us-east-1:1:t".into()).is_err());
        assert!(
            Destination::eventbridge(
                "arn:aws:events:us-east-1:123456789012:event-bus/orders".into(),
                "acme".into()
            )
            .is_ok()
        );
        assert!(Destination::eventbridge("a bus".into(), "acme".into()).is_err());
        assert!(Destination::http("ftp://x".into()).is_err());
        let d = Destination::eventbridge("orders".into(), "acme".into()).unwrap();
        let (kind, target, source) = d.to_columns();
        assert_eq!(Destination::from_columns(kind, &target, source), Ok(d));
    }
}
