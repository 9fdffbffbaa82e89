//! Batches are events: a request that carries several events (HubSpot's array, SendGrid's)
//! files each element as its own event, exactly once, whatever batch it comes back in. Signed
//! as the providers sign, through the ingest handler, against a real PostgreSQL; the buffer's
//! consumer files a buffered batch the same way.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{HeaderMap, StatusCode};
use pipeline_tests::drain::{fast_settings, queue_len};
use pipeline_tests::*;
use shared::domain::Scheme;
use shared::secrets::{SecretSet, SecretStore, SigningSecret};
use shared::signature::{self, Signing};
use sqlx::PgPool;

const HUBSPOT_SECRET: &str = "hubspot-client-secret";
const SUBSCRIBER_SECRET: &str = "whsec_c3Vic2NyaWJlci1zaWduaW5nLXNlY3JldC1mb3ItdGVzdHM=";

/// The URL the test handler receives a request at (`post_to`), which HubSpot's v3 signs.
fn url_of(source_id: &str) -> String {
    format!("https://example.execute-api.us-east-1.amazonaws.com/webhooks/{source_id}")
}

/// A HubSpot request as HubSpot signs it (v3: HMAC-SHA256 of method, URL, body and timestamp).
fn hubspot_signed(body: &[u8]) -> HeaderMap {
    let v3 = Scheme::Hubspot
        .provider()
        .signatures
        .iter()
        .find(|l| l.name.as_deref() == Some("v3"))
        .unwrap();
    let url = url_of("hubspot");
    let mut headers: HeaderMap = signature::sign_with(
        v3,
        &SigningSecret::new(HUBSPOT_SECRET),
        &Signing {
            message_id: "",
            timestamp: now(),
            body,
            method: "POST",
            url: Some(&url),
        },
    )
    .unwrap()
    .into_iter()
    .collect();
    set(&mut headers, "content-type", "application/json");
    headers
}

/// A HubSpot contact event of portal 62515, subscription 12345, as attempt `attempt`.
fn hubspot_event(event_id: u64, object_id: u64, attempt: u32) -> serde_json::Value {
    serde_json::json!({
        "eventId": event_id, "subscriptionId": 12345, "portalId": 62515, "appId": 54321,
        "occurredAt": 1_764_000_000_000_u64, "subscriptionType": "contact.propertyChange",
        "attemptNumber": attempt, "objectId": object_id, "changeSource": "CRM",
        "propertyName": "email", "propertyValue": format!("c{object_id}@example.com"),
    })
}

fn secrets() -> SecretStore {
    SecretStore::memory([
        (
            "secret/hubspot".to_owned(),
            SecretSet::new(HUBSPOT_SECRET, None),
        ),
        (
            "subscriber/signing".to_owned(),
            SecretSet::new(SUBSCRIBER_SECRET, None),
        ),
    ])
}

async fn hubspot_app(pool: &PgPool) -> TestApp {
    let hubspot = source("hubspot", TENANT, Scheme::Hubspot, "secret/hubspot");
    TestApp::with_limits(
        pool.clone(),
        &[hubspot],
        secrets(),
        Duration::from_secs(30),
        shared::config::DEFAULT_MAX_BODY_BYTES,
    )
    .await
}

/// `body`, signed by HubSpot now, as ingest buffers it (delivery `delivery_id`, verified by
/// `layout`): one SQS message for the consumer.
fn buffered_hubspot(
    hubspot: &shared::sources::Source,
    delivery_id: &str,
    body: &[u8],
    layout: Option<&str>,
) -> shared::buffer::filing::Message {
    let kept: std::collections::BTreeMap<String, String> =
        shared::ingest::kept_headers(hubspot, &hubspot_signed(body))
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
            .collect();
    shared::buffer::filing::Message {
        message_id: delivery_id.to_owned(),
        delivery: Ok(shared::buffer::BufferedDelivery {
            envelope: shared::buffer::Envelope {
                v: shared::buffer::ENVELOPE_VERSION,
                delivery_id: delivery_id.to_owned(),
                verified_layout: layout.map(str::to_owned),
                source_id: "hubspot".to_owned(),
                received_at_micros: shared::ingest::unix_now_micros(),
                verified_with: "current".to_owned(),
                signed_headers: vec!["x-hubspot-request-timestamp".to_owned()],
                headers: kept,
                signed_digest: None,
                element_digests: Vec::new(),
            },
            body: body.to_vec(),
        }),
    }
}

async fn scalar(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// A subscriber on a loopback port that records the `webhook-id` of every request and answers
/// 204.
async fn subscriber() -> (String, Arc<Mutex<Vec<String>>>) {
    let arrivals: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = arrivals.clone();
    let app = axum::Router::new().route(
        "/hooks",
        axum::routing::post(move |headers: axum::http::HeaderMap| {
            let seen = seen.clone();
            async move {
                let id = headers
                    .get("webhook-id")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                seen.lock().unwrap().push(id);
                axum::http::StatusCode::NO_CONTENT
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hooks", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, arrivals)
}

/// The HubSpot case the product exists for: a batch of three, then HubSpot retries its second
/// event on its own (a new `attemptNumber`) inside another batch, beside a new event. Four
/// events are stored, the retried one counted twice; each element's row holds its own JSON;
/// each request's bytes are kept once; a subscriber of every HubSpot event hears of each of the
/// four exactly once.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_hubspot_element_retried_inside_another_batch_is_one_event(pool: PgPool) {
    let app = hubspot_app(&pool).await;
    let (url, arrivals) = subscriber().await;
    let routes = shared::outbox::routes::parse_routes(
        "routes.toml",
        &format!(
            "[[route]]\ntenant = \"{TENANT}\"\nsource = \"hubspot\"\naction = \"event\"\n\
             name = \"crm\"\ndestination = \"http\"\nurl = \"{url}\"\n\
             signing_secret_ref = \"subscriber/signing\"\n"
        ),
    )
    .unwrap();
    shared::outbox::routes::apply(&pool, &routes).await.unwrap();

    let first = serde_json::to_vec(&serde_json::json!([
        hubspot_event(1001, 7, 0),
        hubspot_event(1002, 8, 0),
        hubspot_event(1003, 9, 0),
    ]))
    .unwrap();
    let reply = app.post("hubspot", hubspot_signed(&first), &first).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json);
    assert_eq!(
        reply.json,
        serde_json::json!({"status": "accepted",
                           "elements": {"accepted": 3, "duplicate": 0, "conflict": 0}})
    );

    let second = serde_json::to_vec(&serde_json::json!([
        hubspot_event(1004, 10, 0),
        hubspot_event(1002, 8, 1),
    ]))
    .unwrap();
    let reply = app.post("hubspot", hubspot_signed(&second), &second).await;
    assert_eq!(
        reply.json,
        serde_json::json!({"status": "accepted",
                           "elements": {"accepted": 1, "duplicate": 1, "conflict": 0}})
    );

    let stored = events(&pool).await;
    let ids: Vec<(&str, i32)> = stored
        .iter()
        .map(|e| (e.external_id.as_str(), e.delivery_count))
        .collect();
    assert_eq!(
        ids,
        [
            ("62515:12345:1001", 1),
            ("62515:12345:1002", 2),
            ("62515:12345:1003", 1),
            ("62515:12345:1004", 1)
        ]
    );
    for row in &stored {
        assert_eq!(row.event_type, "contact.propertyChange");
        let payload: serde_json::Value =
            serde_json::from_slice(row.payload.as_deref().unwrap()).unwrap();
        assert!(payload.is_object(), "each element stores its own JSON");
        assert_eq!(
            row.entity_id.as_deref(),
            Some(payload["objectId"].to_string().as_str())
        );
    }
    let retried = event(&pool, TENANT, "62515:12345:1002").await.unwrap();
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&retried.payload.unwrap()).unwrap()["attemptNumber"],
        0,
        "the first attempt's bytes stay"
    );
    assert!(anomalies(&pool).await.is_empty(), "a retry is no conflict");
    // Each request kept once, whole, with the ids of the events it carried.
    let kept: Vec<(Vec<String>, Vec<u8>)> =
        sqlx::query_as("SELECT external_ids, body FROM batch_requests ORDER BY batch_request_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    let ids = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        kept,
        [
            (
                ids(&["62515:12345:1001", "62515:12345:1002", "62515:12345:1003"]),
                first.clone()
            ),
            (
                ids(&["62515:12345:1004", "62515:12345:1002"]),
                second.clone()
            )
        ]
    );
    // The requests that delivered an event, found from the event.
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM webhook_events AS e JOIN batch_requests AS b \
             ON b.source_id = e.source_id AND e.external_id = ANY (b.external_ids) \
             WHERE e.external_id = '62515:12345:1002'"
        )
        .await,
        2
    );
    assert_eq!(scalar(&pool, "SELECT count(*) FROM event_queue").await, 4);

    // Downstream: the drain and the outbox, until settled.
    let drainer = shared::drain::Drainer::new(
        pool.clone(),
        Arc::new(shared::effects::EffectRegistry::standard()),
        shared::drain::DrainSettings {
            idle_poll: Duration::from_millis(20),
            ..fast_settings()
        },
    );
    let sender = shared::outbox::OutboxSender::new(
        pool.clone(),
        shared::outbox::OutboxSettings {
            idle_poll: Duration::from_millis(20),
            ..shared::outbox::OutboxSettings::routed()
        },
    )
    .unwrap()
    .with_secrets(Arc::new(secrets()));
    let give_up = Instant::now() + Duration::from_secs(30);
    let running = async {
        let (drained, sent) = tokio::join!(drainer.stay_until(give_up), sender.stay_until(give_up));
        drained.unwrap();
        sent.unwrap();
    };
    let settled = async {
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if queue_len(&pool).await == 0
                && scalar(
                    &pool,
                    "SELECT count(*) FROM outbox WHERE status = 'pending'",
                )
                .await
                    == 0
                && arrivals.lock().unwrap().len() >= 4
            {
                return;
            }
        }
    };
    tokio::select! {
        () = running => panic!("pipeline not settled"),
        () = settled => {}
    }
    let heard = arrivals.lock().unwrap().clone();
    let distinct: HashSet<&String> = heard.iter().collect();
    assert_eq!(
        (heard.len(), distinct.len()),
        (4, 4),
        "each event once: {heard:?}"
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM webhook_events WHERE status = 'processed'"
        )
        .await,
        4
    );
}

/// The same element in another order of keys is the same bytes for comparison (its digest is
/// taken in canonical form); a changed element under the same id is a digest conflict, counted
/// in the answer and recorded.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_element_is_compared_by_what_it_says_not_how_it_is_written(pool: PgPool) {
    let app = hubspot_app(&pool).await;
    let first = br#"[{"eventId":1,"subscriptionId":2,"portalId":3,"subscriptionType":"contact.creation","attemptNumber":0,"objectId":4}]"#;
    let reply = app.post("hubspot", hubspot_signed(first), first).await;
    assert_eq!(reply.json["elements"]["accepted"], 1, "{:?}", reply.json);
    let reordered = br#"[{"objectId":4,"attemptNumber":3,"subscriptionType":"contact.creation","portalId":3,"subscriptionId":2,"eventId":1}]"#;
    let reply = app
        .post("hubspot", hubspot_signed(reordered), reordered)
        .await;
    assert_eq!(reply.json["elements"]["duplicate"], 1, "{:?}", reply.json);
    let changed = br#"[{"eventId":1,"subscriptionId":2,"portalId":3,"subscriptionType":"contact.creation","attemptNumber":0,"objectId":5}]"#;
    let reply = app.post("hubspot", hubspot_signed(changed), changed).await;
    assert_eq!(
        reply.json,
        serde_json::json!({"status": "conflict",
                           "elements": {"accepted": 0, "duplicate": 0, "conflict": 1}})
    );
    assert_eq!(anomalies(&pool).await[0].kind, "digest_conflict");
    assert_eq!(events(&pool).await.len(), 1);
}

/// All or none: a batch one of whose elements cannot be read stores no element (the request is
/// kept as an anomaly and answered 400); a batch of more events than a request may carry is
/// refused 413 with nothing stored, not even an anomaly.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_batch_is_stored_whole_or_not_at_all(pool: PgPool) {
    let app = hubspot_app(&pool).await;
    let mut broken = vec![hubspot_event(1, 1, 0), hubspot_event(2, 2, 0)];
    broken[1]
        .as_object_mut()
        .unwrap()
        .remove("subscriptionType");
    let body = serde_json::to_vec(&broken).unwrap();
    let reply = app.post("hubspot", hubspot_signed(&body), &body).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{:?}", reply.json);
    assert!(
        reply.json["error"]
            .as_str()
            .unwrap()
            .contains("element 1 of json:/"),
        "{:?}",
        reply.json
    );
    assert!(events(&pool).await.is_empty());
    assert_eq!(anomalies(&pool).await.len(), 1);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM batch_requests").await,
        0
    );

    let too_many: Vec<serde_json::Value> = (0..=shared::batches::MAX_ELEMENTS as u64)
        .map(|i| serde_json::json!({"eventId": i, "subscriptionId": 1, "portalId": 1, "subscriptionType": "t"}))
        .collect();
    let body = serde_json::to_vec(&too_many).unwrap();
    assert!(body.len() < shared::config::DEFAULT_MAX_BODY_BYTES);
    let reply = app.post("hubspot", hubspot_signed(&body), &body).await;
    assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        reply.json["error"]
            .as_str()
            .unwrap()
            .contains("4001 events"),
        "{:?}",
        reply.json
    );
    assert!(events(&pool).await.is_empty());
    assert_eq!(anomalies(&pool).await.len(), 1, "nothing more kept");
}

/// A SendGrid batch of 1 000 events is stored as 1 000 events; SendGrid sending it again whole
/// (as it does: most events arrive more than once) is 1 000 duplicates and no new event. Signed
/// with a P-256 key as SendGrid signs (timestamp and body).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_sendgrid_batch_sent_again_whole_is_all_duplicates(pool: PgPool) {
    use base64::Engine as _;
    use ring::signature::KeyPair as _;
    let rng = ring::rand::SystemRandom::new();
    let algorithm = &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING;
    let pkcs8 = ring::signature::EcdsaKeyPair::generate_pkcs8(algorithm, &rng).unwrap();
    let key = ring::signature::EcdsaKeyPair::from_pkcs8(algorithm, pkcs8.as_ref(), &rng).unwrap();
    let public = base64::engine::general_purpose::STANDARD.encode(key.public_key().as_ref());
    let app = TestApp::with_limits(
        pool.clone(),
        &[source(
            "sendgrid",
            TENANT,
            Scheme::Sendgrid,
            "secret/sendgrid",
        )],
        SecretStore::memory([("secret/sendgrid".to_owned(), SecretSet::new(public, None))]),
        Duration::from_secs(30),
        shared::config::DEFAULT_MAX_BODY_BYTES,
    )
    .await;
    let batch: Vec<serde_json::Value> = (0..1000)
        .map(|i| {
            let event = ["processed", "delivered", "open"][i % 3];
            serde_json::json!({
                "email": format!("user{i}@example.com"), "timestamp": 1_764_000_000 + i,
                "smtp-id": format!("<{i}@example.com>"), "event": event,
                "category": "cat facts", "sg_event_id": format!("sg-event-{i:04}"),
                "sg_message_id": format!("msg-{}", i / 3),
            })
        })
        .collect();
    let body = serde_json::to_vec(&batch).unwrap();
    let app = &app;
    let send = |body: Vec<u8>| {
        let timestamp = now().to_string();
        let mut signed = timestamp.as_bytes().to_vec();
        signed.extend_from_slice(&body);
        let signature = key.sign(&rng, &signed).unwrap();
        let mut headers = HeaderMap::new();
        set(
            &mut headers,
            "x-twilio-email-event-webhook-signature",
            &base64::engine::general_purpose::STANDARD.encode(signature.as_ref()),
        );
        set(
            &mut headers,
            "x-twilio-email-event-webhook-timestamp",
            &timestamp,
        );
        set(&mut headers, "content-type", "application/json");
        async move { app_post(app, headers, &body).await }
    };
    async fn app_post(app: &TestApp, headers: HeaderMap, body: &[u8]) -> Reply {
        app.post("sendgrid", headers, body).await
    }
    let reply = send(body.clone()).await;
    assert_eq!(
        reply.json,
        serde_json::json!({"status": "accepted",
                           "elements": {"accepted": 1000, "duplicate": 0, "conflict": 0}})
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM webhook_events").await,
        1000
    );
    let reply = send(body).await;
    assert_eq!(
        reply.json,
        serde_json::json!({"status": "duplicate",
                           "elements": {"accepted": 0, "duplicate": 1000, "conflict": 0}})
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM webhook_events").await,
        1000
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM webhook_events WHERE delivery_count = 2"
        )
        .await,
        1000
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM event_queue").await,
        1000
    );
    let types: Vec<(String, i64)> =
        sqlx::query_as("SELECT event_type, count(*) FROM webhook_events GROUP BY 1 ORDER BY 1")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        types,
        [
            ("delivered".to_owned(), 333),
            ("open".to_owned(), 333),
            ("processed".to_owned(), 334)
        ]
    );
}

/// A buffered batch is one SQS message, as ingest sent it; the consumer files its elements as
/// the direct path does, and a second copy of a buffered batch (another request) is all
/// duplicates.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_buffer_files_a_batch_element_by_element(pool: PgPool) {
    let hubspot = source("hubspot", TENANT, Scheme::Hubspot, "secret/hubspot");
    shared::sources::apply(&pool, std::slice::from_ref(&hubspot))
        .await
        .unwrap();
    let body = serde_json::to_vec(&serde_json::json!([
        hubspot_event(1, 1, 0),
        hubspot_event(2, 2, 0),
        hubspot_event(1, 1, 0),
    ]))
    .unwrap();
    let buffered = |delivery_id: &str| buffered_hubspot(&hubspot, delivery_id, &body, None);
    let consumed = shared::buffer::consumer::consume(&pool, &[buffered("d-1"), buffered("d-2")])
        .await
        .unwrap();
    assert_eq!(consumed.stored, 2, "{consumed:?}");
    let stored = events(&pool).await;
    let counts: Vec<(&str, i32)> = stored
        .iter()
        .map(|e| (e.external_id.as_str(), e.delivery_count))
        .collect();
    // Element 1 is in each request twice: four deliveries of it, two of element 2.
    assert_eq!(counts, [("62515:12345:1", 4), ("62515:12345:2", 2)]);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM batch_requests").await,
        2
    );
    assert_eq!(scalar(&pool, "SELECT count(*) FROM event_queue").await, 2);
}

/// A source that stored events a request at a time keeps reading them so until its operator
/// says otherwise: applying the catalogue's per-element reading over it is refused with what to
/// do, and `--change-event-ids` (apply_changing_event_ids) takes it.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_source_with_request_level_events_changes_to_elements_only_when_told(pool: PgPool) {
    let mut old = source("hubspot", TENANT, Scheme::Hubspot, "secret/hubspot");
    old.fields.elements = None;
    old.fields.external_id = shared::domain::FieldLocator::json("/0/eventId");
    old.fields.event_type = shared::domain::FieldLocator::json("/0/subscriptionType");
    old.fields.entity_id = None;
    let app = TestApp::with_limits(
        pool.clone(),
        std::slice::from_ref(&old),
        secrets(),
        Duration::from_secs(30),
        shared::config::DEFAULT_MAX_BODY_BYTES,
    )
    .await;
    let body = serde_json::to_vec(&serde_json::json!([
        hubspot_event(1, 1, 0),
        hubspot_event(2, 2, 0)
    ]))
    .unwrap();
    let reply = app.post("hubspot", hubspot_signed(&body), &body).await;
    assert_eq!(reply.json, serde_json::json!({"status": "accepted"}));
    assert_eq!(events(&pool).await[0].external_id, "1");

    let new = source("hubspot", TENANT, Scheme::Hubspot, "secret/hubspot");
    let refused = shared::sources::apply(&pool, std::slice::from_ref(&new))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("elements: none")
            && refused.contains("elements: json:/")
            && refused.contains("--change-event-ids"),
        "{refused}"
    );
    shared::sources::apply_changing_event_ids(&pool, &[new])
        .await
        .unwrap();
    let stored = shared::sources::find(&pool, &old.source_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        stored.fields.elements.map(|e| e.to_string()),
        Some("json:/".to_owned())
    );
}

/// Day 60: a batched request's bytes go with the payloads of its day (the payload horizon), so
/// `batch_requests` holds a retention window of requests, not every request ever received.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn retention_deletes_batched_requests_with_the_payloads_of_their_day(pool: PgPool) {
    let app = hubspot_app(&pool).await;
    for n in 0..3_u64 {
        let body = serde_json::to_vec(&[hubspot_event(n, n, 0)]).unwrap();
        let reply = app.post("hubspot", hubspot_signed(&body), &body).await;
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json);
    }
    sqlx::query(
        "UPDATE batch_requests SET received_at = received_at - interval '8 days' \
         WHERE batch_request_id IN (SELECT min(batch_request_id) FROM batch_requests)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let settings = shared::retention::RetentionSettings::default();
    let run = shared::retention::run_once(&pool, &settings, "test")
        .await
        .unwrap();
    assert_eq!(run.batch_requests_purged, 1, "{run:?}");
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM batch_requests").await,
        2
    );
}

/// Mailchimp Transactional (Mandrill) posts its batch as a form field holding JSON
/// (`elements = "form:mandrill_events"`), signed over the URL and the sorted form: each element
/// is its own event, its JSON its payload. Its URL check, an unsigned HEAD, is answered 200 with
/// nothing stored.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_mandrill_form_batch_is_filed_element_by_element(pool: PgPool) {
    let key = "mandrill-webhook-key";
    let app = TestApp::with_limits(
        pool.clone(),
        &[source(
            "mandrill",
            TENANT,
            Scheme::Mandrill,
            "secret/mandrill",
        )],
        SecretStore::memory([("secret/mandrill".to_owned(), SecretSet::new(key, None))]),
        Duration::from_secs(30),
        shared::config::DEFAULT_MAX_BODY_BYTES,
    )
    .await;
    let events_json = serde_json::json!([
        {"event": "open", "_id": "msg-1", "ts": 1_764_000_100, "msg": {"_id": "msg-1", "state": "sent"}},
        {"event": "click", "_id": "msg-1", "ts": 1_764_000_160, "url": "https://example.com/a",
         "msg": {"_id": "msg-1", "state": "sent"}},
    ])
    .to_string();
    let body: String = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("mandrill_events", &events_json)
        .finish();
    let layout = &Scheme::Mandrill.provider().signatures[0];
    let url = url_of("mandrill");
    let mut headers: HeaderMap = signature::sign_with(
        layout,
        &SigningSecret::new(key),
        &Signing {
            message_id: "",
            timestamp: now(),
            body: body.as_bytes(),
            method: "POST",
            url: Some(&url),
        },
    )
    .unwrap()
    .into_iter()
    .collect();
    set(
        &mut headers,
        "content-type",
        "application/x-www-form-urlencoded",
    );
    let reply = app.post("mandrill", headers.clone(), body.as_bytes()).await;
    assert_eq!(
        reply.json,
        serde_json::json!({"status": "accepted",
                           "elements": {"accepted": 2, "duplicate": 0, "conflict": 0}})
    );
    let stored = events(&pool).await;
    let ids: Vec<(&str, &str, Option<&str>)> = stored
        .iter()
        .map(|e| {
            (
                e.external_id.as_str(),
                e.event_type.as_str(),
                e.entity_id.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        ids,
        [
            ("msg-1:click:1764000160", "click", Some("msg-1")),
            ("msg-1:open:1764000100", "open", Some("msg-1"))
        ]
    );
    let click: serde_json::Value =
        serde_json::from_slice(stored[0].payload.as_deref().unwrap()).unwrap();
    assert_eq!(click["url"], "https://example.com/a");
    let kept: Vec<u8> = sqlx::query_scalar("SELECT body FROM batch_requests")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(kept, body.as_bytes(), "the form as signed, kept once");
    // Mandrill's retry of the batch: two duplicates.
    let reply = app.post("mandrill", headers, body.as_bytes()).await;
    assert_eq!(reply.json["elements"]["duplicate"], 2, "{:?}", reply.json);

    // The URL check: a HEAD, answered 200, nothing stored.
    let mut request = http::Request::builder()
        .method("HEAD")
        .uri(url_of("mandrill"))
        .body(lambda_http::Body::Empty)
        .unwrap();
    *request.headers_mut() = HeaderMap::new();
    use lambda_http::RequestExt as _;
    let request = request.with_path_parameters(std::collections::HashMap::from([(
        "source_id".to_owned(),
        "mandrill".to_owned(),
    )]));
    let response = ingest::handler(request, &app.ingestor).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(events(&pool).await.len(), 2);
}

/// An Adyen notification item as Adyen signs it: base64 HMAC-SHA256 (the key hex) of its eight
/// values joined with `:`. Returns the item and the SHA-256 of the signed string.
fn adyen_item(
    key_hex: &str,
    psp: &str,
    event_code: &str,
    value: i64,
) -> (serde_json::Value, [u8; 32]) {
    use base64::Engine as _;
    use hmac::{KeyInit, Mac};
    use sha2::Digest as _;
    let signed = format!("{psp}::merchantAccount:ref-{psp}:{value}:EUR:{event_code}:true");
    let mut mac =
        hmac::Hmac::<sha2::Sha256>::new_from_slice(&hex::decode(key_hex).unwrap()).unwrap();
    mac.update(signed.as_bytes());
    let signature = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    let item = serde_json::json!({"NotificationRequestItem": {
        "additionalData": {"hmacSignature": signature},
        "amount": {"currency": "EUR", "value": value}, "eventCode": event_code,
        "eventDate": "2026-12-05T10:00:00+01:00", "merchantAccountCode": "merchantAccount",
        "merchantReference": format!("ref-{psp}"), "pspReference": psp, "success": "true",
    }});
    (item, sha2::Sha256::digest(signed.as_bytes()).into())
}

/// Adyen signs each notification item on its own: every item of a request is checked (not
/// only the first, which the layout reads), each is its own event, and one forged item refuses
/// the whole request. Each item's replay claim is its own signed string's digest, on the direct
/// path and through the buffer alike.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn every_adyen_item_is_verified_and_filed_as_its_own_event(pool: PgPool) {
    let key = "44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056";
    let adyen = source("adyen", TENANT, Scheme::Adyen, "secret/adyen");
    let app = TestApp::with_limits(
        pool.clone(),
        std::slice::from_ref(&adyen),
        SecretStore::memory([("secret/adyen".to_owned(), SecretSet::new(key, None))]),
        Duration::from_secs(30),
        shared::config::DEFAULT_MAX_BODY_BYTES,
    )
    .await;
    let (capture, capture_digest) = adyen_item(key, "PSP0001", "CAPTURE", 1000);
    let (refund, refund_digest) = adyen_item(key, "PSP0002", "REFUND", 250);
    let body = |items: Vec<serde_json::Value>| {
        serde_json::to_vec(&serde_json::json!({"live": "false", "notificationItems": items}))
            .unwrap()
    };

    // A forged second item (its amount raised after signing): the whole request is refused.
    let mut forged = refund.clone();
    forged["NotificationRequestItem"]["amount"]["value"] = serde_json::json!(25_000);
    let forged_body = body(vec![capture.clone(), forged]);
    let reply = app.post("adyen", HeaderMap::new(), &forged_body).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{:?}", reply.json);
    assert!(events(&pool).await.is_empty());

    let both = body(vec![capture.clone(), refund.clone()]);
    let reply = app.post("adyen", HeaderMap::new(), &both).await;
    assert_eq!(
        reply.json,
        serde_json::json!({"status": "accepted",
                           "elements": {"accepted": 2, "duplicate": 0, "conflict": 0}})
    );
    let ids: Vec<(String, String)> = events(&pool)
        .await
        .into_iter()
        .map(|e| (e.external_id, e.event_type))
        .collect();
    assert_eq!(
        ids,
        [
            ("PSP0001:CAPTURE:true".to_owned(), "CAPTURE".to_owned()),
            ("PSP0002:REFUND:true".to_owned(), "REFUND".to_owned())
        ]
    );
    // Each item claims its own signed string.
    let claims: Vec<(Vec<u8>, String)> = sqlx::query_as(
        "SELECT payload_sha256, external_id FROM signed_bodies ORDER BY external_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        claims,
        [
            (capture_digest.to_vec(), "PSP0001:CAPTURE:true".to_owned()),
            (refund_digest.to_vec(), "PSP0002:REFUND:true".to_owned())
        ]
    );

    // The same request through the buffer (as ingest would have sent it, with each item's
    // digest): both duplicates, no replay, no new claim.
    let message = shared::buffer::filing::Message {
        message_id: "m-adyen".to_owned(),
        delivery: Ok(shared::buffer::BufferedDelivery {
            envelope: shared::buffer::Envelope {
                v: shared::buffer::ENVELOPE_VERSION,
                delivery_id: "d-adyen".to_owned(),
                verified_layout: None,
                source_id: "adyen".to_owned(),
                received_at_micros: shared::ingest::unix_now_micros(),
                verified_with: "current".to_owned(),
                signed_headers: Vec::new(),
                headers: Default::default(),
                signed_digest: Some(hex::encode(capture_digest)),
                element_digests: vec![hex::encode(capture_digest), hex::encode(refund_digest)],
            },
            body: both.clone(),
        }),
    };
    shared::buffer::consumer::consume(&pool, &[message])
        .await
        .unwrap();
    let counts: Vec<(String, i32)> = events(&pool)
        .await
        .into_iter()
        .map(|e| (e.external_id, e.delivery_count))
        .collect();
    assert_eq!(
        counts,
        [
            ("PSP0001:CAPTURE:true".to_owned(), 2),
            ("PSP0002:REFUND:true".to_owned(), 2)
        ]
    );
    assert!(anomalies(&pool).await.is_empty(), "no replay, no conflict");
    assert_eq!(scalar(&pool, "SELECT count(*) FROM signed_bodies").await, 2);
}

/// A Microsoft Graph request: the notifications in `value`, each carrying `client_state`.
fn graph_batch(notifications: &[(&str, &str, &str)], expires: &str) -> Vec<u8> {
    let value: Vec<serde_json::Value> = notifications
        .iter()
        .map(|(id, change, client_state)| {
            serde_json::json!({
                "id": id, "subscriptionId": "6f1b0c1e-2a3d-4e5f-8a9b-0c1d2e3f4a5b",
                "subscriptionExpirationDateTime": expires, "clientState": client_state,
                "changeType": change, "resource": format!("Users/u-1/Messages/{id}"),
                "tenantId": "84bd8158-6d4d-4958-8b9f-9d6445542f95",
                "resourceData": {"@odata.type": "#Microsoft.Graph.Message", "id": id},
            })
        })
        .collect();
    serde_json::to_vec(&serde_json::json!({ "value": value })).unwrap()
}

fn json_headers() -> HeaderMap {
    let mut headers = HeaderMap::new();
    set(
        &mut headers,
        "content-type",
        "application/json; charset=utf-8",
    );
    headers
}

/// Microsoft Graph signs nothing: every notification of a request carries the subscription's
/// clientState, each compared with the source's secret, one wrong or missing refusing the
/// whole request. The clientState is the secret: no stored payload, kept request or header
/// holds it. Graph's validation request (a `validationToken` query parameter, no body) is
/// answered with the token as text, nothing stored; a renewal that changes only the
/// subscription's expiry makes no second event.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn every_graph_notification_is_checked_and_its_client_state_never_kept(pool: PgPool) {
    let client_state = "graph-client-state-8f2c1d";
    let app = TestApp::with_limits(
        pool.clone(),
        &[source(
            "graph",
            TENANT,
            Scheme::MicrosoftGraph,
            "secret/graph",
        )],
        SecretStore::memory([(
            "secret/graph".to_owned(),
            SecretSet::new(client_state, None),
        )]),
        Duration::from_secs(30),
        shared::config::DEFAULT_MAX_BODY_BYTES,
    )
    .await;

    // The validation request when the subscription is created.
    let request = http::Request::builder()
        .method("POST")
        .uri(format!(
            "{}?validationToken=Validation%3a+Testing+client+application+reachability",
            url_of("graph")
        ))
        .header("content-type", "text/plain; charset=utf-8")
        .body(lambda_http::Body::Empty)
        .unwrap();
    use lambda_http::RequestExt as _;
    let request = request.with_path_parameters(std::collections::HashMap::from([(
        "source_id".to_owned(),
        "graph".to_owned(),
    )]));
    let response = ingest::handler(request, &app.ingestor).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers()["content-type"],
        "text/plain",
        "Graph wants the token as text"
    );
    assert_eq!(
        response.body().as_ref(),
        b"Validation: Testing client application reachability"
    );
    assert!(events(&pool).await.is_empty());

    // A request whose second notification carries another clientState: refused whole.
    let forged = graph_batch(
        &[
            ("n-1", "created", client_state),
            ("n-2", "updated", "graph-client-state-8f2c1e"),
        ],
        "2026-12-08T10:00:00Z",
    );
    let reply = app.post("graph", json_headers(), &forged).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{:?}", reply.json);
    // One without it: refused too.
    let mut missing: serde_json::Value = serde_json::from_slice(&graph_batch(
        &[("n-1", "created", client_state), ("n-2", "updated", "x")],
        "2026-12-08T10:00:00Z",
    ))
    .unwrap();
    missing["value"][1]
        .as_object_mut()
        .unwrap()
        .remove("clientState");
    let missing = serde_json::to_vec(&missing).unwrap();
    let reply = app.post("graph", json_headers(), &missing).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{:?}", reply.json);
    assert!(events(&pool).await.is_empty());

    let body = graph_batch(
        &[
            ("n-1", "created", client_state),
            ("n-2", "updated", client_state),
        ],
        "2026-12-08T10:00:00Z",
    );
    let reply = app.post("graph", json_headers(), &body).await;
    assert_eq!(
        reply.json,
        serde_json::json!({"status": "accepted",
                           "elements": {"accepted": 2, "duplicate": 0, "conflict": 0}})
    );
    let stored = events(&pool).await;
    let mut kinds: Vec<(&str, Option<&str>)> = stored
        .iter()
        .map(|e| (e.event_type.as_str(), e.entity_id.as_deref()))
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        [
            ("created", Some("Users/u-1/Messages/n-1")),
            ("updated", Some("Users/u-1/Messages/n-2"))
        ]
    );
    for event in &stored {
        let payload: serde_json::Value =
            serde_json::from_slice(event.payload.as_deref().unwrap()).unwrap();
        assert!(payload.get("clientState").is_none(), "{payload}");
        assert_eq!(payload["tenantId"], "84bd8158-6d4d-4958-8b9f-9d6445542f95");
    }
    let kept: Vec<u8> = sqlx::query_scalar("SELECT body FROM batch_requests")
        .fetch_one(&pool)
        .await
        .unwrap();
    let kept_text = String::from_utf8(kept).unwrap();
    assert!(kept_text.contains("n-2"), "{kept_text}");
    let everywhere: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM webhook_events
                  WHERE convert_from(payload, 'UTF8') LIKE '%' || $1 || '%'
                     OR headers::text LIKE '%' || $1 || '%')
              + (SELECT count(*) FROM batch_requests
                  WHERE convert_from(body, 'UTF8') LIKE '%' || $1 || '%'
                     OR headers::text LIKE '%' || $1 || '%')
              + (SELECT count(*) FROM ingest_anomalies
                  WHERE convert_from(payload, 'UTF8') LIKE '%' || $1 || '%')",
    )
    .bind(client_state)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(everywhere, 0, "the clientState is stored nowhere");

    // Graph retries the second notification on its own after the subscription was renewed:
    // only its expiry differs, and it is the same event.
    let retried = graph_batch(&[("n-2", "updated", client_state)], "2026-12-11T10:00:00Z");
    let reply = app.post("graph", json_headers(), &retried).await;
    assert_eq!(reply.json["elements"]["duplicate"], 1, "{:?}", reply.json);
    assert_eq!(events(&pool).await.len(), 2);
}

/// An event's filing says which of its provider's layouts verified it, when its source accepts
/// several, and how many of its deliveries came through the SQS buffer (what its page in the
/// console shows): HubSpot's v3 for a direct delivery, none buffered; a buffered copy of the same request counts one more
/// buffered delivery for each element, and a new element filed from the buffer starts at one.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_event_records_the_layout_that_verified_it_and_the_deliveries_the_buffer_filed(
    pool: PgPool,
) {
    // By default a HubSpot source accepts v3 alone: nothing to tell apart, nothing recorded.
    let app = hubspot_app(&pool).await;
    let only = serde_json::to_vec(&serde_json::json!([hubspot_event(9, 9, 0)])).unwrap();
    let reply = app.post("hubspot", hubspot_signed(&only), &only).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json);
    assert_eq!(scalar(&pool, "SELECT count(*) FROM event_filings").await, 0);
    sqlx::query("DELETE FROM event_queue")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM webhook_events")
        .execute(&pool)
        .await
        .unwrap();

    // One that also accepts the legacy v1 records which of the two verified each event.
    let mut both = source("hubspot", TENANT, Scheme::Hubspot, "secret/hubspot");
    both.layouts = Some(vec!["v3".to_owned(), "v1".to_owned()]);
    let app = TestApp::with_limits(
        pool.clone(),
        std::slice::from_ref(&both),
        secrets(),
        Duration::ZERO,
        shared::config::DEFAULT_MAX_BODY_BYTES,
    )
    .await;
    let direct = serde_json::to_vec(&serde_json::json!([hubspot_event(1, 1, 0)])).unwrap();
    let reply = app.post("hubspot", hubspot_signed(&direct), &direct).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json);
    let filing = || async {
        sqlx::query_as::<_, (String, Option<String>, Option<i32>, i32)>(
            "SELECT e.external_id, f.verified_layout, NULLIF(f.buffered_deliveries, 0), \
                    e.delivery_count \
             FROM webhook_events AS e LEFT JOIN event_filings AS f USING (tenant_id, external_id) \
             ORDER BY e.external_id",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    assert_eq!(
        filing().await,
        [("62515:12345:1".to_owned(), Some("v3".to_owned()), None, 1)]
    );

    let body = serde_json::to_vec(&serde_json::json!([
        hubspot_event(1, 1, 0),
        hubspot_event(2, 2, 0)
    ]))
    .unwrap();
    let hubspot = source("hubspot", TENANT, Scheme::Hubspot, "secret/hubspot");
    let message = buffered_hubspot(&hubspot, "d-1", &body, Some("v3"));
    let consumed = shared::buffer::consumer::consume(&pool, &[message])
        .await
        .unwrap();
    assert_eq!(consumed.stored, 1, "{consumed:?}");
    assert_eq!(
        filing().await,
        [
            (
                "62515:12345:1".to_owned(),
                Some("v3".to_owned()),
                Some(1),
                2
            ),
            (
                "62515:12345:2".to_owned(),
                Some("v3".to_owned()),
                Some(1),
                1
            ),
        ]
    );
}
