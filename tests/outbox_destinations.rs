//! The outbox's destinations beyond HTTP (issue 24), against a real PostgreSQL and moto's
//! EventBridge, SQS and SNS: what a consumer reads off each (an EventBridge rule and an SNS
//! subscription deliver into SQS queues the tests read), FIFO deduplication of a resent
//! message, a failed entry inside a successful batch call, a message no route covers, and a
//! destination that refuses for good until the route is fixed and the message resent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use aws_sdk_sqs::types::{MessageSystemAttributeName, QueueAttributeName};
use hookctl::backend::Backend;
use hookctl::commands::{self, OutboxAction, OutboxFilter};
use pipeline_tests::drain::*;
use pipeline_tests::*;
use shared::aws::AwsEndpoint;
use shared::outbox::destinations::{AwsDestinationEndpoints, Destination};
use shared::outbox::routes::{self, Route};
use shared::outbox::{OutboxSender, OutboxSettings};
use sqlx::PgPool;

fn endpoint() -> AwsEndpoint {
    AwsEndpoint {
        endpoint_url: Some(moto_endpoint()),
        region: Some("us-east-1".into()),
    }
}

/// A name no other test (nor an earlier run against the same moto) uses.
fn unique(prefix: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}-{}",
        std::process::id(),
        now(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

struct Moto {
    sqs: aws_sdk_sqs::Client,
    eventbridge: aws_sdk_eventbridge::Client,
    sns: aws_sdk_sns::Client,
}

async fn moto() -> Moto {
    let config = shared::aws::sdk_config(&endpoint()).await;
    Moto {
        sqs: aws_sdk_sqs::Client::new(&config),
        eventbridge: aws_sdk_eventbridge::Client::new(&config),
        sns: aws_sdk_sns::Client::new(&config),
    }
}

impl Moto {
    /// A queue (FIFO when `name` ends in `.fifo`, without content-based deduplication): its
    /// URL and ARN.
    async fn queue(&self, name: &str) -> (String, String) {
        let mut create = self.sqs.create_queue().queue_name(name);
        if name.ends_with(".fifo") {
            create = create
                .attributes(QueueAttributeName::FifoQueue, "true")
                .attributes(QueueAttributeName::ContentBasedDeduplication, "false");
        }
        let url = create.send().await.unwrap().queue_url.unwrap();
        let arn = self
            .sqs
            .get_queue_attributes()
            .queue_url(&url)
            .attribute_names(QueueAttributeName::QueueArn)
            .send()
            .await
            .unwrap()
            .attributes
            .unwrap()
            .remove(&QueueAttributeName::QueueArn)
            .unwrap();
        (url, arn)
    }

    /// Everything that arrives on the queue within `wait` of the last message: (body, system
    /// attributes), in the order received; each deleted once read.
    async fn drain_queue(
        &self,
        url: &str,
        wait: Duration,
    ) -> Vec<(
        serde_json::Value,
        HashMap<MessageSystemAttributeName, String>,
    )> {
        let mut all = Vec::new();
        let mut quiet_since = Instant::now();
        while quiet_since.elapsed() < wait {
            let received = self
                .sqs
                .receive_message()
                .queue_url(url)
                .max_number_of_messages(10)
                .wait_time_seconds(0)
                .message_system_attribute_names(MessageSystemAttributeName::All)
                .send()
                .await
                .unwrap();
            let messages = received.messages.unwrap_or_default();
            if messages.is_empty() {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            quiet_since = Instant::now();
            for m in messages {
                self.sqs
                    .delete_message()
                    .queue_url(url)
                    .receipt_handle(m.receipt_handle.clone().unwrap())
                    .send()
                    .await
                    .unwrap();
                let body = serde_json::from_str(m.body.as_deref().unwrap()).unwrap();
                all.push((body, m.attributes.unwrap_or_default()));
            }
        }
        all
    }
}

fn settings() -> OutboxSettings {
    OutboxSettings {
        max_attempts: 3,
        backoff_base: Duration::from_millis(5),
        backoff_cap: Duration::from_millis(20),
        endpoints: AwsDestinationEndpoints::all(endpoint()),
        ..OutboxSettings::routed()
    }
}

fn route(action: &str, destination: Destination) -> Route {
    Route {
        tenant_id: TENANT.into(),
        source_id: None,
        action: action.into(),
        destination,
        signing_secret_ref: None,
        subscription: None,
    }
}

/// Ingests and drains the entity events `(event id, entity, version)`, leaving one
/// `entity.changed` outbox row each, written in that order.
async fn outbox_rows(pool: &PgPool, events: &[(&str, &str, i64)]) {
    let app = app(pool.clone()).await;
    for (id, entity, version) in events {
        let d = entity_event(id, entity, *version, "thing.updated");
        assert_eq!(app.post(ENTITIES, d.headers, &d.body).await.status, 200);
    }
    let drainer = standard_drainer(pool);
    drain_all(&drainer, pool, Duration::from_secs(10)).await;
    assert_eq!(
        scalar(pool, "SELECT count(*) FROM outbox").await,
        events.len() as i64
    );
}

fn events(n: usize) -> Vec<(String, String)> {
    (0..n)
        .map(|i| (format!("d-{i}"), format!("thing-{i}")))
        .collect()
}

async fn rows_of(pool: &PgPool, n: usize) {
    let events = events(n);
    let refs: Vec<(&str, &str, i64)> = events
        .iter()
        .map(|(id, entity)| (id.as_str(), entity.as_str(), 1))
        .collect();
    outbox_rows(pool, &refs).await;
}

async fn send_until_settled(sender: &OutboxSender, pool: &PgPool) {
    let give_up = Instant::now() + Duration::from_secs(20);
    while scalar(pool, "SELECT count(*) FROM outbox WHERE status = 'pending'").await > 0 {
        assert!(Instant::now() < give_up, "outbox not settled");
        sender
            .send_until(Instant::now() + Duration::from_secs(5))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Routes every `entity.changed` message to `destination` and sends until none is pending;
/// returns the sender, for a test that sends again.
async fn send_every_effect_to(pool: &PgPool, destination: Destination) -> OutboxSender {
    routes::apply(pool, &[route("entity.changed", destination)])
        .await
        .unwrap();
    let sender = OutboxSender::new(pool.clone(), settings()).unwrap();
    send_until_settled(&sender, pool).await;
    sender
}

/// (external_id, idempotency_key, status, attempts, destination, last_error), by id.
type Row = (String, String, String, i32, Option<String>, Option<String>);

async fn rows(pool: &PgPool) -> Vec<Row> {
    sqlx::query_as(
        "SELECT o.external_id, o.idempotency_key, o.status, o.attempts, d.destination, o.last_error \
         FROM outbox AS o LEFT JOIN outbox_destinations AS d USING (outbox_id) ORDER BY o.outbox_id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Twelve messages go to an EventBridge bus in two PutEvents calls (ten, then two); a rule on
/// the bus sends them to an SQS queue, where each arrives once as an EventBridge event: source
/// the route's, detail-type the action, detail the message with its idempotency key and event id.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_eventbridge_rule_receives_every_message_with_its_key(pool: PgPool) {
    let moto = moto().await;
    let bus = unique("orders");
    moto.eventbridge
        .create_event_bus()
        .name(&bus)
        .send()
        .await
        .unwrap();
    let (queue_url, queue_arn) = moto.queue(&unique("from-bus")).await;
    let rule = unique("all-acme");
    moto.eventbridge
        .put_rule()
        .name(&rule)
        .event_bus_name(&bus)
        .event_pattern(r#"{"source": ["acme.webhooks"]}"#)
        .send()
        .await
        .unwrap();
    moto.eventbridge
        .put_targets()
        .rule(&rule)
        .event_bus_name(&bus)
        .targets(
            aws_sdk_eventbridge::types::Target::builder()
                .id("queue")
                .arn(&queue_arn)
                .build()
                .unwrap(),
        )
        .send()
        .await
        .unwrap();
    rows_of(&pool, 12).await;
    let destination = Destination::eventbridge(bus.clone(), "acme.webhooks".into()).unwrap();
    send_every_effect_to(&pool, destination).await;

    let rows = rows(&pool).await;
    for r in &rows {
        assert_eq!(
            (r.2.as_str(), r.3, r.4.as_deref()),
            ("delivered", 1, Some(format!("eventbridge {bus}").as_str())),
            "{r:?}"
        );
    }
    let arrived = moto.drain_queue(&queue_url, Duration::from_secs(2)).await;
    assert_eq!(arrived.len(), 12, "each message once: {arrived:?}");
    let keys: HashMap<&str, &str> = rows.iter().map(|r| (r.0.as_str(), r.1.as_str())).collect();
    for (event, _) in &arrived {
        assert_eq!(event["source"], "acme.webhooks");
        assert_eq!(event["detail-type"], "entity.changed");
        let detail = &event["detail"];
        let event_id = detail["event_id"].as_str().unwrap();
        assert_eq!(detail["idempotency_key"], keys[event_id], "{event}");
        assert_eq!(detail["tenant_id"], TENANT);
        assert_eq!(detail["payload"]["entity_type"], "thing");
    }
    let mut seen: Vec<&str> = arrived
        .iter()
        .map(|(e, _)| e["detail"]["event_id"].as_str().unwrap())
        .collect();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 12);

    // What went where, as `hookctl outbox sent` shows it.
    let sent = operator(
        &pool,
        serde_json::json!({"action": "list_sent_outbox", "tenant_id": TENANT, "outbox_action": "entity.changed", "limit": 5}),
    )
    .await;
    let sent = sent["sent_outbox"].as_array().unwrap();
    assert_eq!(sent.len(), 5, "{sent:?}");
    for m in sent {
        assert_eq!(m["destination"], format!("eventbridge {bus}"));
    }
    assert_eq!(
        sent[0]["outbox_id"].as_i64().unwrap(),
        scalar(&pool, "SELECT max(outbox_id) FROM outbox").await,
        "newest first"
    );
}

/// The operator's answer to `request`, as JSON (what the operator function returns).
async fn operator(pool: &PgPool, request: serde_json::Value) -> serde_json::Value {
    let request = shared::operator::parse(request).unwrap();
    let registry = shared::effects::EffectRegistry::standard();
    let answer = shared::operator::handle(pool, &registry, request)
        .await
        .unwrap();
    serde_json::to_value(answer).unwrap()
}

/// A FIFO queue gets each entity's messages in one group, in the order written, deduplicated
/// by the idempotency key: a message sent again (its sender's acknowledgement lost, the row
/// due again) is taken by SQS and dropped, so the consumer reads it once.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_fifo_queue_keeps_an_entity_in_order_and_drops_a_resent_message(pool: PgPool) {
    let moto = moto().await;
    let (queue_url, _) = moto.queue(&format!("{}.fifo", unique("entities"))).await;
    outbox_rows(
        &pool,
        &[
            ("f-1", "a", 1),
            ("f-2", "b", 1),
            ("f-3", "a", 2),
            ("f-4", "a", 3),
        ],
    )
    .await;
    let sender = send_every_effect_to(&pool, Destination::sqs(queue_url.clone()).unwrap()).await;

    // f-3's delivery is repeated, as when a sender crashed after SQS took it and before the row
    // was marked: the row is due again and sent with the same key.
    sqlx::query(
        "UPDATE outbox SET status = 'pending', next_attempt_at = now() WHERE external_id = 'f-3'",
    )
    .execute(&pool)
    .await
    .unwrap();
    send_until_settled(&sender, &pool).await;

    let rows = rows(&pool).await;
    assert!(rows.iter().all(|r| r.2 == "delivered"), "{rows:?}");
    assert_eq!(
        rows.iter().find(|r| r.0 == "f-3").unwrap().3,
        2,
        "the resend was a try"
    );
    let arrived = moto.drain_queue(&queue_url, Duration::from_secs(2)).await;
    let ids: Vec<&str> = arrived
        .iter()
        .map(|(b, _)| b["event_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        arrived.len(),
        4,
        "the resent f-3 is dropped by SQS: {ids:?}"
    );
    let group = |id: &str| -> (String, String) {
        let (_, attributes) = arrived.iter().find(|(b, _)| b["event_id"] == id).unwrap();
        (
            attributes[&MessageSystemAttributeName::MessageGroupId].clone(),
            attributes[&MessageSystemAttributeName::MessageDeduplicationId].clone(),
        )
    };
    for r in &rows {
        let (group_id, dedup) = group(&r.0);
        assert_eq!(dedup, r.1, "deduplicated by the idempotency key");
        let entity = if r.0 == "f-2" { "b" } else { "a" };
        assert_eq!(group_id, format!("thing:{entity}"));
    }
    let of_a: Vec<&str> = ids.iter().copied().filter(|i| *i != "f-2").collect();
    assert_eq!(
        of_a,
        ["f-1", "f-3", "f-4"],
        "one entity's messages in order"
    );
}

/// The sender makes its calls concurrently, but a FIFO destination's one after another: forty
/// changes of one entity, four calls of ten, arrive in the order written.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_fifo_queue_gets_an_entity_in_order_across_calls(pool: PgPool) {
    let moto = moto().await;
    let (queue_url, _) = moto.queue(&format!("{}.fifo", unique("ordered"))).await;
    let ids: Vec<String> = (1..=40).map(|v| format!("o-{v:02}")).collect();
    let rows_in: Vec<(&str, &str, i64)> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (id.as_str(), "a", i as i64 + 1))
        .collect();
    outbox_rows(&pool, &rows_in).await;
    send_every_effect_to(&pool, Destination::sqs(queue_url.clone()).unwrap()).await;
    let arrived = moto.drain_queue(&queue_url, Duration::from_secs(2)).await;
    let got: Vec<&str> = arrived
        .iter()
        .map(|(b, _)| b["event_id"].as_str().unwrap())
        .collect();
    let want: Vec<&str> = ids.iter().map(String::as_str).collect();
    assert_eq!(got, want, "one entity's messages in order across calls");
}

/// SNS refuses one entry of a PublishBatch (a message over its 256 KiB limit, written here
/// straight into the outbox: no effect writes one that large today) and takes the others: the
/// refused one ends failed with SNS's reason after one try; the others are delivered and reach
/// the topic's subscriber once each.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_failed_entry_of_a_publish_batch_fails_alone(pool: PgPool) {
    let moto = moto().await;
    let topic_arn = moto
        .sns
        .create_topic()
        .name(unique("changes"))
        .send()
        .await
        .unwrap()
        .topic_arn
        .unwrap();
    let (queue_url, queue_arn) = moto.queue(&unique("subscriber")).await;
    moto.sns
        .subscribe()
        .topic_arn(&topic_arn)
        .protocol("sqs")
        .endpoint(&queue_arn)
        .attributes("RawMessageDelivery", "true")
        .send()
        .await
        .unwrap();
    rows_of(&pool, 3).await;
    sqlx::query(
        "INSERT INTO outbox (tenant_id, external_id, action, payload, idempotency_key) \
         VALUES ($1, 'huge', 'entity.changed', jsonb_build_object('blob', repeat('x', 300000)), 'huge-key')",
    )
    .bind(TENANT)
    .execute(&pool)
    .await
    .unwrap();
    send_every_effect_to(&pool, Destination::sns(topic_arn.clone()).unwrap()).await;

    let rows = rows(&pool).await;
    let huge = rows.iter().find(|r| r.0 == "huge").unwrap();
    assert_eq!((huge.2.as_str(), huge.3), ("failed", 1), "{huge:?}");
    assert!(
        huge.5.as_deref().unwrap().contains("Message too long"),
        "{huge:?}"
    );
    let others: Vec<&Row> = rows.iter().filter(|r| r.0 != "huge").collect();
    assert_eq!(others.len(), 3);
    for r in &others {
        assert_eq!((r.2.as_str(), r.3), ("delivered", 1), "{r:?}");
    }
    let arrived = moto.drain_queue(&queue_url, Duration::from_secs(2)).await;
    let mut ids: Vec<&str> = arrived
        .iter()
        .map(|(b, _)| b["event_id"].as_str().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, ["d-0", "d-1", "d-2"]);
    assert!(
        arrived
            .iter()
            .all(|(b, _)| b["idempotency_key"].as_str().is_some_and(|k| k.len() == 64))
    );
}

async fn failed_outbox_finding(pool: &PgPool) -> i64 {
    let report = shared::status::report(pool, &Default::default())
        .await
        .unwrap();
    report
        .findings
        .iter()
        .find(|f| f.kind == shared::status::FindingKind::FailedOutbox)
        .map_or(0, |f| f.count)
}

fn resend_all() -> OutboxAction {
    OutboxAction::Resend {
        filter: OutboxFilter {
            tenant: Some(TENANT.into()),
            limit: 1000,
            ..OutboxFilter::default()
        },
        all: false,
        decision: commands::Decision {
            reason: "the route is fixed".into(),
            actor: Some("alice".into()),
        },
    }
}

/// With no route and no default target, a message fails at once, spending no attempt, with a
/// reason that names what to route; the operator sees it in status and `hookctl outbox list`,
/// applies a route and resends it, and it is delivered.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_message_without_a_route_waits_failed_until_routed_and_resent(pool: PgPool) {
    let moto = moto().await;
    rows_of(&pool, 2).await;
    let sender = OutboxSender::new(pool.clone(), settings()).unwrap();
    let pass = sender
        .send_until(Instant::now() + Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!((pass.unrouted, pass.delivered), (2, 0), "{pass:?}");
    for r in rows(&pool).await {
        assert_eq!((r.2.as_str(), r.3, r.4.as_deref()), ("failed", 0, None));
        assert_eq!(
            r.5.as_deref(),
            Some(
                "no route for entity.changed of tenant acme, source entities: add one to the route file (hookctl routes apply), then resend"
            )
        );
    }
    assert_eq!(failed_outbox_finding(&pool).await, 2);
    let backend = Backend::direct(pool.clone());
    let listed = OutboxAction::List(OutboxFilter {
        error_contains: Some("no route".into()),
        limit: 1000,
        ..OutboxFilter::default()
    });
    assert_eq!(commands::outbox(&backend, true, listed).await, 0);

    let (queue_url, _) = moto.queue(&unique("late-route")).await;
    routes::apply(
        &pool,
        &[route(
            "entity.changed",
            Destination::sqs(queue_url.clone()).unwrap(),
        )],
    )
    .await
    .unwrap();
    assert_eq!(commands::outbox(&backend, true, resend_all()).await, 0);
    send_until_settled(&sender, &pool).await;

    for r in rows(&pool).await {
        assert_eq!(
            (r.2.as_str(), r.3, r.4),
            ("delivered", 1, Some(format!("sqs {queue_url}")))
        );
    }
    assert_eq!(failed_outbox_finding(&pool).await, 0);
    let arrived = moto.drain_queue(&queue_url, Duration::from_secs(2)).await;
    assert_eq!(arrived.len(), 2);
}

/// A route to a queue that does not exist: SQS refuses the batch for good, so each message
/// ends failed after one try (no retry can make the queue exist). Once the route names a real
/// queue, `hookctl outbox resend` sends them there, under the keys they first had.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_refusing_destination_fails_the_messages_and_resend_delivers_after_the_fix(pool: PgPool) {
    let moto = moto().await;
    rows_of(&pool, 3).await;
    let missing = format!("{}/123456789012/{}", moto_endpoint(), unique("missing"));
    let sender = send_every_effect_to(&pool, Destination::sqs(missing.clone()).unwrap()).await;
    let before = rows(&pool).await;
    for r in &before {
        assert_eq!((r.2.as_str(), r.3), ("failed", 1), "{r:?}");
        let why = r.5.as_deref().unwrap();
        assert!(
            why.starts_with("SQS SendMessageBatch failed") && why.contains("NonExistentQueue"),
            "{why}"
        );
    }
    assert_eq!(failed_outbox_finding(&pool).await, 3);
    let listed = operator(&pool, serde_json::json!({"action": "list_failed_outbox"})).await;
    for m in listed["failed_outbox"].as_array().unwrap() {
        assert_eq!(
            m["destination"],
            format!("sqs {missing}"),
            "where it was tried"
        );
    }

    let (queue_url, _) = moto.queue(&unique("fixed")).await;
    routes::apply(
        &pool,
        &[route(
            "entity.changed",
            Destination::sqs(queue_url.clone()).unwrap(),
        )],
    )
    .await
    .unwrap();
    let backend = Backend::direct(pool.clone());
    assert_eq!(commands::outbox(&backend, true, resend_all()).await, 0);
    send_until_settled(&sender, &pool).await;

    let after = rows(&pool).await;
    for r in &after {
        assert_eq!((r.2.as_str(), r.3), ("delivered", 1), "{r:?}");
    }
    let arrived = moto.drain_queue(&queue_url, Duration::from_secs(2)).await;
    let mut keys: Vec<&str> = arrived
        .iter()
        .map(|(b, _)| b["idempotency_key"].as_str().unwrap())
        .collect();
    keys.sort();
    let mut expected: Vec<&str> = before.iter().map(|r| r.1.as_str()).collect();
    expected.sort();
    assert_eq!(keys, expected, "the keys they were first sent with");
}

/// A route naming a source the tenant does not have is refused, and nothing is applied.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_route_to_an_unknown_source_is_refused_whole(pool: PgPool) {
    let _ = app(pool.clone()).await;
    let good = route(
        "fulfil_order",
        Destination::http("https://x.example/fulfil".into()).unwrap(),
    );
    routes::apply(&pool, std::slice::from_ref(&good))
        .await
        .unwrap();
    let stray = Route {
        source_id: Some("no-such-source".into()),
        ..route(
            "entity.changed",
            Destination::http("https://x.example/changes".into()).unwrap(),
        )
    };
    let refused = routes::apply(&pool, &[stray])
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("no-such-source"), "{refused}");
    assert_eq!(
        routes::list(&mut pool.acquire().await.unwrap())
            .await
            .unwrap(),
        vec![good]
    );
}

/// Where a delivered message went is kept as long as the message: retention, taking an event
/// past the identity horizon with its outbox rows, takes their destinations too.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn retention_takes_a_message_destination_with_it(pool: PgPool) {
    let moto = moto().await;
    rows_of(&pool, 2).await;
    let (queue_url, _) = moto.queue(&unique("retained")).await;
    send_every_effect_to(&pool, Destination::sqs(queue_url).unwrap()).await;
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM outbox_destinations").await,
        2
    );

    assert_eq!(retention_past_the_horizon(&pool).await, 2);
    assert_eq!(scalar(&pool, "SELECT count(*) FROM outbox").await, 0);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM outbox_destinations").await,
        0
    );
}
