//! What each provider really sends, including the awkward parts (issue 11): Slack's URL
//! handshake and retries, Shopify's deletes and one-second versions, signed bodies replayed under
//! new ids, bytes PostgreSQL cannot store, list backfill scoped to the endpoint's event types,
//! late deliveries of backfilled events, two sources of one tenant, and GitHub's redelivery.
//! Each is driven through the ingest handler as the provider would send it.

use http::{HeaderMap, StatusCode};
use pipeline_tests::*;
use serde_json::json;
use shared::domain::Scheme;
use sqlx::PgPool;

const SLACK: Scheme = Scheme::Slack;

fn slack_signed(body: &[u8], at: i64) -> Delivery {
    resign(
        SLACK,
        &secret_of(SLACK),
        "",
        at,
        HeaderMap::new(),
        body.to_vec(),
    )
}

// ---- 1. Slack: url_verification and X-Slack-Retry-Num -------------------------------------

/// Slack's request URL handshake, as Slack sends it when an Events API URL is saved: signed, and
/// answered with the challenge. Nothing is stored, not even as an anomaly; an unsigned one is 401.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn slack_url_verification_is_answered_with_the_challenge_and_stores_nothing(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let body = br#"{"token":"Jhj5dZrVaK7ZwHHjRyZWjbDl","challenge":"3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P","type":"url_verification"}"#;
    let signed = slack_signed(body, now());

    let reply = app
        .post("slack", signed.headers.clone(), &signed.body)
        .await;

    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json);
    assert_eq!(
        reply.json,
        json!({"challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"})
    );
    let forged = resign(
        SLACK,
        "not-the-secret",
        "",
        now(),
        HeaderMap::new(),
        body.to_vec(),
    );
    assert_eq!(
        app.post("slack", forged.headers, &forged.body).await.status,
        StatusCode::UNAUTHORIZED,
        "the handshake is verified before it is answered"
    );
    let stale = slack_signed(body, now() - 3600);
    assert_eq!(
        app.post("slack", stale.headers, &stale.body).await.status,
        StatusCode::UNAUTHORIZED
    );
    assert!(events(&app.pool).await.is_empty());
    assert!(anomalies(&app.pool).await.is_empty());
}

/// Slack redelivers an event it thinks failed with `X-Slack-Retry-Num` and a fresh signature
/// over the same body: a duplicate of the stored event, counted as a provider retry.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn slack_retries_are_duplicates_counted_as_provider_retries(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let body = serde_json::to_vec(&json!({"type": "event_callback", "event_id": "Ev0RETRY", "event": {"type": "message", "text": "hi"}})).unwrap();
    let first = slack_signed(&body, now() - 5);
    assert_eq!(
        app.post("slack", first.headers, &first.body)
            .await
            .outcome(),
        "accepted"
    );
    for n in ["1", "2"] {
        let mut retry = slack_signed(&body, now());
        set(&mut retry.headers, "x-slack-retry-num", n);
        set(&mut retry.headers, "x-slack-retry-reason", "http_timeout");
        let reply = app.post("slack", retry.headers, &retry.body).await;
        assert_eq!(
            (reply.status, reply.outcome()),
            (StatusCode::OK, "duplicate"),
            "{:?}",
            reply.json
        );
    }
    // An event whose first attempt never reached the database arrives as a retry.
    let late = serde_json::to_vec(
        &json!({"type": "event_callback", "event_id": "Ev0LATE", "event": {"type": "message"}}),
    )
    .unwrap();
    let mut retry = slack_signed(&late, now());
    set(&mut retry.headers, "x-slack-retry-num", "1");
    set(&mut retry.headers, "x-slack-retry-reason", "http_error");
    assert_eq!(
        app.post("slack", retry.headers, &retry.body)
            .await
            .outcome(),
        "accepted"
    );

    let counted: Vec<(String, i32, i32)> = sqlx::query_as(
        "SELECT external_id, delivery_count, provider_retries FROM webhook_events ORDER BY external_id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        counted,
        [("Ev0LATE".into(), 1, 1), ("Ev0RETRY".into(), 3, 2)]
    );
    let late_row = event(&app.pool, TENANT, "Ev0LATE").await.unwrap();
    assert_eq!(late_row.headers["x-slack-retry-reason"], "http_error");
    assert!(anomalies(&app.pool).await.is_empty());
    // Three provider retries for two events: Slack is retrying because the receiver fails.
    assert_breached(&app.pool, "provider_retry_rate_last_day").await;
}

/// Runs the anomaly checks once; `check` must be among the breaches.
async fn assert_breached(pool: &PgPool, check: &str) {
    let report = shared::anomaly::run_once(pool, &Default::default(), "test")
        .await
        .unwrap();
    assert!(
        report.breaches.iter().any(|b| b == check),
        "{check} not breached: {:?}",
        report.breaches
    );
}

// ---- 4. Bytes PostgreSQL cannot store -----------------------------------------------------

/// A NUL (`\u0000`) in a signed field: PostgreSQL's text cannot hold it. The delivery is
/// unusable as sent, so it is 400 with an `invalid_field` anomaly, never a 500 the provider
/// retries forever.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_nul_in_a_signed_field_is_400_invalid_field_not_500(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let stripe = Scheme::Stripe;
    let nul_type = br#"{"id":"evt_nul_type","object":"event","type":"charge.succeeded\u0000","data":{"object":{"id":"ch_1"}}}"#;
    let nul_entity = br#"{"id":"evt_nul_entity","object":"event","type":"charge.succeeded","data":{"object":{"id":"ch_\u0000"}}}"#;
    let mut cases = Vec::new();
    for body in [&nul_type[..], &nul_entity[..]] {
        cases.push((
            "stripe",
            resign(
                stripe,
                &secret_of(stripe),
                "",
                now(),
                HeaderMap::new(),
                body.to_vec(),
            ),
        ));
    }
    let shopify = delivery(
        Scheme::Shopify,
        &secret_of(Scheme::Shopify),
        "wh_nul",
        now(),
        json!({"admin_graphql_api_id": "gid://shopify/Order/1\u{0}", "id": "1\u{0}"}),
    );
    cases.push(("shopify", shopify));
    let slack = slack_signed(
        br#"{"type":"event_callback","event_id":"Ev0NUL","event":{"type":"mess\u0000age"}}"#,
        now(),
    );
    cases.push(("slack", slack));

    for (source, d) in cases {
        let reply = app.post(source, d.headers, &d.body).await;
        assert_eq!(
            reply.status,
            StatusCode::BAD_REQUEST,
            "{source}: {:?}",
            reply.json
        );
        assert!(
            reply.json["error"].as_str().unwrap_or("").contains("NUL"),
            "{source}: {:?}",
            reply.json
        );
    }
    assert!(events(&app.pool).await.is_empty());
    let kinds: Vec<String> = anomalies(&app.pool)
        .await
        .into_iter()
        .map(|a| a.kind)
        .collect();
    assert_eq!(kinds, ["invalid_field"; 4]);
}

// ---- 3. A signed body replayed under a new id ---------------------------------------------

/// GitHub and Shopify sign only the body: their id and event type headers are outside the HMAC.
/// Whoever holds one signed delivery can replay it under fresh ids; each replay is answered
/// `duplicate` and recorded; its bytes are stored once, under the original, and the replay's
/// row is held: accounted for, never queued, no payload copy, no effect.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_signed_body_replayed_under_new_ids_is_stored_once_and_recorded(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    for (scheme, id_header, type_header) in [
        (Scheme::Github, "x-github-delivery", "x-github-event"),
        (Scheme::Shopify, "x-shopify-webhook-id", "x-shopify-topic"),
    ] {
        let original = delivery(
            scheme,
            &secret_of(scheme),
            &format!("{scheme}-original"),
            now(),
            json!({}),
        );
        let reply = app
            .post(scheme.as_str(), original.headers.clone(), &original.body)
            .await;
        assert_eq!(reply.outcome(), "accepted", "{scheme}: {:?}", reply.json);
        for n in 0..3 {
            let mut replay = original.headers.clone();
            set(&mut replay, id_header, &format!("{scheme}-replay-{n}"));
            if n == 2 {
                set(&mut replay, type_header, "member");
            }
            let reply = app.post(scheme.as_str(), replay, &original.body).await;
            assert_eq!(
                (reply.status, reply.outcome()),
                (StatusCode::OK, "duplicate"),
                "{scheme} replay {n}: {:?}",
                reply.json
            );
        }
    }

    let rows = events(&app.pool).await;
    let with_bytes: Vec<&str> = rows
        .iter()
        .filter(|r| r.payload.is_some())
        .map(|r| r.external_id.as_str())
        .collect();
    assert_eq!(
        with_bytes,
        ["github-original", "shopify-original"],
        "bytes stored once"
    );
    assert!(rows.iter().all(|r| r.delivery_count == 1));
    assert_eq!(pipeline_tests::drain::queue_len(&app.pool).await, 2);
    let mut held = stored_deliveries(&app.pool).await;
    held.retain(|(id, ..)| id.contains("-replay-"));
    assert_eq!(held.len(), 6, "{held:?}");
    for (id, status, queued, replay_of) in &held {
        assert_eq!((status.as_str(), *queued), ("processed", false), "{id}");
        assert!(
            replay_of
                .as_deref()
                .is_some_and(|o| o.ends_with("-original")),
            "{id}"
        );
    }
    let found = anomalies(&app.pool).await;
    assert_eq!(found.len(), 6, "{found:?}");
    for a in &found {
        assert_eq!(a.kind, "replayed_body");
        assert!(
            a.external_id
                .as_deref()
                .is_some_and(|id| id.contains("-replay-"))
        );
        assert!(a.detail.contains("-original"), "{}", a.detail);
    }
    assert_breached(&app.pool, "replayed_bodies_last_day").await;
}

/// Replays racing each other on real connections: one is stored as the event, every other is a
/// duplicate held as a replay of it.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn concurrent_replays_of_one_body_store_it_once(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let original = delivery(
        Scheme::Github,
        &secret_of(Scheme::Github),
        "race-0",
        now(),
        json!({}),
    );
    let tasks: Vec<_> = (0..8)
        .map(|n| {
            let (ingestor, mut headers, body) = (
                app.ingestor.clone(),
                original.headers.clone(),
                original.body.clone(),
            );
            set(&mut headers, "x-github-delivery", &format!("race-{n}"));
            tokio::spawn(async move { post_to(&ingestor, "github", headers, &body).await })
        })
        .collect();
    let mut outcomes = Vec::new();
    for t in tasks {
        let reply = t.await.unwrap();
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json);
        outcomes.push(reply.outcome().to_owned());
    }
    outcomes.sort();
    assert_eq!(outcomes, [vec!["accepted"], vec!["duplicate"; 7]].concat());
    let rows = stored_deliveries(&app.pool).await;
    let effective: Vec<&String> = rows
        .iter()
        .filter(|(_, _, _, replay_of)| replay_of.is_none())
        .map(|(id, ..)| id)
        .collect();
    assert_eq!(effective.len(), 1, "{rows:?}");
    assert_eq!(rows.len(), 8);
    for (id, status, queued, replay_of) in &rows {
        if id != effective[0] {
            assert_eq!((status.as_str(), *queued), ("processed", false), "{id}");
            assert_eq!(replay_of.as_ref(), Some(effective[0]), "{id}");
        }
    }
    assert_eq!(pipeline_tests::drain::queue_len(&app.pool).await, 1);
    assert_eq!(anomalies(&app.pool).await.len(), 7);
}

// ---- 3b. Distinct deliveries, replays past the identity horizon, bounded anomalies ---------

/// Every `webhook_events` row's external id and status, whether it is queued, and which stored
/// event it repeats the body of (held: its `replayed_body` anomaly names it).
async fn stored_deliveries(pool: &PgPool) -> Vec<(String, String, bool, Option<String>)> {
    sqlx::query_as(
        "SELECT e.external_id, e.status, EXISTS (SELECT 1 FROM event_queue AS q \
                 WHERE q.tenant_id = e.tenant_id AND q.external_id = e.external_id), \
             (SELECT a.replay_of FROM ingest_anomalies AS a WHERE a.tenant_id = e.tenant_id \
                 AND a.external_id = e.external_id AND a.kind = 'replayed_body' \
                 AND a.payload_sha256 = e.payload_sha256) \
         FROM webhook_events AS e ORDER BY e.external_id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// (version, deleted, title, last event) of every projected entity, and the outbox's size.
async fn projection(pool: &PgPool) -> (Vec<(i64, bool, Option<String>, String)>, i64) {
    let rows = sqlx::query_as(
        "SELECT version, deleted, state->>'title', last_event_id FROM entities ORDER BY entity_id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    (
        rows,
        pipeline_tests::drain::scalar(pool, "SELECT count(*) FROM outbox").await,
    )
}

/// One Shopify endpoint subscribed to `orders/updated` and `orders/paid` gets the same order
/// JSON twice, under two webhook ids: two distinct deliveries with byte-identical bodies. Both are
/// stored and accounted for (the second held from a second effect, with a `replayed_body`
/// anomaly that keeps its headers and names both rows), never dropped.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn two_shopify_topics_with_one_body_are_both_stored_and_accounted_for(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let order = json!({"id": 450789469, "admin_graphql_api_id": "gid://shopify/Order/450789469",
                       "total_price": "10.00", "updated_at": "2026-11-30T10:00:00-05:00"});
    let at = "2026-11-30T15:00:00.100000000Z";
    let updated = shopify("wh-updated", "orders/updated", at, order.clone());
    let paid = shopify("wh-paid", "orders/paid", at, order);
    assert_eq!(updated.body, paid.body, "byte-identical bodies");

    let first = app.post("shopify", updated.headers, &updated.body).await;
    assert_eq!(first.outcome(), "accepted", "{:?}", first.json);
    let second = app.post("shopify", paid.headers, &paid.body).await;
    assert_eq!(second.status, StatusCode::OK, "{:?}", second.json);

    let ids: Vec<String> = events(&app.pool)
        .await
        .into_iter()
        .map(|e| e.external_id)
        .collect();
    assert_eq!(ids, ["wh-paid", "wh-updated"], "both deliveries stored");
    assert_eq!(
        stored_deliveries(&app.pool).await,
        [
            (
                "wh-paid".into(),
                "processed".into(),
                false,
                Some("wh-updated".into())
            ),
            ("wh-updated".into(), "pending".into(), true, None),
        ],
        "both deliveries stored; the second held from a second effect"
    );
    let held = event(&app.pool, TENANT, "wh-paid").await.unwrap();
    assert_eq!(held.event_type, "orders/paid");
    assert_eq!(held.payload_sha256, sha256(&paid.body));
    assert_eq!(held.headers["x-shopify-topic"], json!("orders/paid"));

    let found = anomalies(&app.pool).await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        (found[0].kind.as_str(), found[0].external_id.as_deref()),
        ("replayed_body", Some("wh-paid"))
    );
    assert!(
        found[0].detail.contains("wh-updated"),
        "{}",
        found[0].detail
    );
    let (headers, replay_of): (serde_json::Value, Option<String>) =
        sqlx::query_as("SELECT headers, replay_of FROM ingest_anomalies")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(
        headers["x-shopify-topic"],
        json!("orders/paid"),
        "{headers}"
    );
    assert_eq!(replay_of.as_deref(), Some("wh-updated"));

    // Accounted for: hookctl status counts both, gap detection finds both.
    let activity = shared::store::webhook_events::activity_by_source(&app.pool)
        .await
        .unwrap();
    let shop = activity.iter().find(|a| a.source_id == "shopify").unwrap();
    assert_eq!((shop.events_last_day, shop.held_last_day), (2, 1));
}

/// The same signed body under a fresh webhook id with a forged topic and trigger time: stored
/// and held, never a second effect.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_replay_under_a_fresh_id_makes_no_new_effect(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let original = shopify(
        "wh-orig",
        "products/update",
        "2026-11-30T15:00:05.200000000Z",
        product(632910392, "Hoodie", "2026-11-30T10:00:05-05:00"),
    );
    deliver_in_order(&app, vec![original]).await;
    let before = projection(&app.pool).await;
    assert_eq!(before.0.len(), 1);

    let mut forged = event(&app.pool, TENANT, "wh-orig").await.unwrap();
    let mut headers = HeaderMap::new();
    for (k, v) in forged.headers.as_object().unwrap() {
        headers.insert(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            http::HeaderValue::from_str(v.as_str().unwrap()).unwrap(),
        );
    }
    set(&mut headers, "x-shopify-webhook-id", "wh-fresh");
    set(&mut headers, "x-shopify-topic", "products/delete");
    set(
        &mut headers,
        "x-shopify-triggered-at",
        "2099-01-01T00:00:00.000000000Z",
    );
    let body = forged.payload.take().unwrap();
    let reply = app.post("shopify", headers, &body).await;
    assert_eq!(
        (reply.status, reply.outcome()),
        (StatusCode::OK, "duplicate"),
        "{:?}",
        reply.json
    );
    let drainer = pipeline_tests::drain::standard_drainer(&app.pool);
    pipeline_tests::drain::drain_all(&drainer, &app.pool, std::time::Duration::from_secs(10)).await;

    assert_eq!(
        projection(&app.pool).await,
        before,
        "entity and outbox unchanged"
    );
    let ids: Vec<String> = events(&app.pool)
        .await
        .into_iter()
        .map(|e| e.external_id)
        .collect();
    assert_eq!(ids, ["wh-fresh", "wh-orig"], "the replay is stored, held");
    assert_eq!(
        stored_deliveries(&app.pool).await,
        [
            (
                "wh-fresh".into(),
                "processed".into(),
                false,
                Some("wh-orig".into())
            ),
            ("wh-orig".into(), "processed".into(), false, None),
        ]
    );
}

/// A month after the delivery, its identity purged, the same signed body re-posted under a fresh
/// id with a forged `products/delete` topic and a future trigger time: still a replay.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_signed_body_replayed_after_the_identity_horizon_is_still_refused(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let original = shopify(
        "wh-month-old",
        "products/update",
        "2026-11-30T15:00:05.200000000Z",
        product(632910392, "Hoodie", "2026-11-30T10:00:05-05:00"),
    );
    let body = original.body.clone();
    let mut headers = original.headers.clone();
    deliver_in_order(&app, vec![original]).await;
    let before = projection(&app.pool).await;
    // The outbox sender delivered the change's announcement (retention keeps an event whose
    // announcement is still to deliver).
    sqlx::query("UPDATE outbox SET status = 'delivered', delivered_at = now()")
        .execute(&app.pool)
        .await
        .unwrap();

    // 31 days pass: every timestamp of every table moves into the past.
    let columns: Vec<(String, String)> = sqlx::query_as(
        "SELECT c.table_name::text, c.column_name::text FROM information_schema.columns AS c \
         JOIN information_schema.tables AS t USING (table_schema, table_name) \
         WHERE c.table_schema = current_schema() AND t.table_type = 'BASE TABLE' \
           AND c.data_type = 'timestamp with time zone' AND c.table_name NOT LIKE '\\_sqlx%'",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    for (table, column) in columns {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE \"{table}\" SET \"{column}\" = \"{column}\" - interval '31 days'"
        )))
        .execute(&app.pool)
        .await
        .unwrap();
    }
    let purged = shared::retention::run_once(&app.pool, &Default::default(), "test")
        .await
        .unwrap();
    assert_eq!(purged.identities_purged, 1, "{purged:?}");
    assert!(event(&app.pool, TENANT, "wh-month-old").await.is_none());
    let (entities_before, _) = before;
    let before = projection(&app.pool).await;
    assert_eq!(before.0, entities_before);

    set(&mut headers, "x-shopify-webhook-id", "wh-forged");
    set(&mut headers, "x-shopify-topic", "products/delete");
    set(
        &mut headers,
        "x-shopify-triggered-at",
        "2099-01-01T00:00:00.000000000Z",
    );
    let reply = app.post("shopify", headers, &body).await;
    assert_eq!(
        (reply.status, reply.outcome()),
        (StatusCode::OK, "duplicate"),
        "{:?}",
        reply.json
    );
    let drainer = pipeline_tests::drain::standard_drainer(&app.pool);
    pipeline_tests::drain::drain_all(&drainer, &app.pool, std::time::Duration::from_secs(10)).await;
    assert_eq!(
        projection(&app.pool).await,
        before,
        "entity unchanged, nothing announced"
    );
}

/// One signed body posted again and again under the unsigned id of a stored, pending event: one
/// anomaly row per (event, body) that counts them, and the event keeps its own payload. Both for
/// a body the source stores as another event and for one it does not store at all.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_signed_body_posted_under_a_stored_events_id_leaves_one_counted_row(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let at = "2026-11-30T15:00:05.200000000Z";
    let target = shopify(
        "wh-target",
        "products/update",
        at,
        product(1, "Target", "2026-11-30T10:00:05-05:00"),
    );
    let other = shopify(
        "wh-other",
        "products/update",
        at,
        product(2, "Other", "2026-11-30T10:00:05-05:00"),
    );
    // Signed by the shop, never stored here (its identity long purged, say).
    let unseen = shopify(
        "wh-unseen",
        "products/update",
        at,
        product(3, "Unseen", "2026-11-30T10:00:05-05:00"),
    );
    for d in [&target, &other] {
        let reply = app.post("shopify", d.headers.clone(), &d.body).await;
        assert_eq!(reply.outcome(), "accepted", "{:?}", reply.json);
    }

    for body in [&other.body, &unseen.body] {
        for _ in 0..100 {
            let mut headers = target.headers.clone();
            for (name, value) in shared::signature::sign(
                Scheme::Shopify,
                &shared::secrets::SigningSecret::new(secret_of(Scheme::Shopify)),
                "wh-target",
                now(),
                body,
            )
            .unwrap()
            {
                headers.insert(name, value);
            }
            let reply = app.post("shopify", headers, body).await;
            assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json);
        }
    }

    let kept = event(&app.pool, TENANT, "wh-target").await.unwrap();
    assert_eq!(kept.status, "pending");
    assert_eq!(
        kept.payload.as_deref(),
        Some(&target.body[..]),
        "the pending event kept its own payload"
    );
    assert_eq!(
        pipeline_tests::drain::scalar(&app.pool, "SELECT count(*) FROM ingest_anomalies").await,
        2,
        "one anomaly row per (event, body)"
    );
    let rows: Vec<(String, Vec<u8>, i32, bool)> = sqlx::query_as(
        "SELECT kind, payload_sha256, seen_count, payload IS NOT NULL FROM ingest_anomalies \
         WHERE external_id = 'wh-target' ORDER BY anomaly_id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        [
            ("replayed_body".into(), sha256(&other.body), 100, false),
            ("digest_conflict".into(), sha256(&unseen.body), 100, true),
        ],
        "one row per (event, body), counted"
    );
}

// ---- 7. Two sources of one tenant never collide -------------------------------------------

/// Two endpoints of one tenant receiving the same event id: GitHub gives every hook subscribed
/// to an event the same `X-GitHub-Delivery` (a repository hook and its organisation's hook), and
/// two Stripe accounts can number alike. The second source's delivery is an anomaly kept with
/// its bytes; the first source's row is never replaced.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_event_id_stored_under_another_source_of_the_tenant_is_an_anomaly_never_a_replacement(
    pool: PgPool,
) {
    let stripe = Scheme::Stripe;
    let github = Scheme::Github;
    let list = [
        source("stripe-eu", TENANT, stripe, "secret/stripe"),
        source("stripe-us", TENANT, stripe, "secret/stripe"),
        source("github-repo", TENANT, github, "secret/github"),
        source("github-org", TENANT, github, "secret/github"),
    ];
    let app = TestApp::new(pool, &list, secrets_for_every_scheme()).await;
    let eu = delivery(
        stripe,
        &secret_of(stripe),
        "evt_same",
        now(),
        json!({"account": "eu"}),
    );
    let us = delivery(
        stripe,
        &secret_of(stripe),
        "evt_same",
        now(),
        json!({"account": "us"}),
    );
    let hook = delivery(
        github,
        &secret_of(github),
        "58474f00-b361-11eb-836d-0e4f3503ccbe",
        now(),
        json!({}),
    );

    assert_eq!(
        app.post("stripe-eu", eu.headers, &eu.body).await.outcome(),
        "accepted"
    );
    assert_eq!(
        app.post("github-repo", hook.headers.clone(), &hook.body)
            .await
            .outcome(),
        "accepted"
    );
    let other_account = app.post("stripe-us", us.headers, &us.body).await;
    let org_hook = app.post("github-org", hook.headers, &hook.body).await;

    assert_eq!(
        (other_account.status, other_account.outcome()),
        (StatusCode::OK, "conflict"),
        "{:?}",
        other_account.json
    );
    assert_eq!(
        (org_hook.status, org_hook.outcome()),
        (StatusCode::OK, "duplicate"),
        "{:?}",
        org_hook.json
    );
    let kept = event(&app.pool, TENANT, "evt_same").await.unwrap();
    assert_eq!(
        (
            kept.source_id.as_str(),
            kept.payload.as_deref(),
            kept.status.as_str()
        ),
        ("stripe-eu", Some(&eu.body[..]), "pending"),
        "the pending row of the first source kept its own payload"
    );
    assert_eq!((kept.delivery_count, kept.conflict_count), (1, 0));
    let hook_row = event(&app.pool, TENANT, "58474f00-b361-11eb-836d-0e4f3503ccbe")
        .await
        .unwrap();
    assert_eq!(
        (hook_row.source_id.as_str(), hook_row.delivery_count),
        ("github-repo", 1)
    );

    let found = anomalies(&app.pool).await;
    let seen: Vec<(&str, &str, Option<&str>)> = found
        .iter()
        .map(|a| {
            (
                a.kind.as_str(),
                a.source_id.as_str(),
                a.external_id.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("source_collision", "stripe-us", Some("evt_same")),
            (
                "source_collision",
                "github-org",
                Some("58474f00-b361-11eb-836d-0e4f3503ccbe")
            ),
        ]
    );
    assert_eq!(
        found[0].payload.as_deref(),
        Some(&us.body[..]),
        "the delivered bytes are kept"
    );
    assert_eq!(found[0].payload_replaced, Some(false));
    assert!(found[0].detail.contains("stripe-eu"), "{}", found[0].detail);
    assert_eq!(pipeline_tests::drain::queue_len(&app.pool).await, 2);
    assert_breached(&app.pool, "source_collisions_last_day").await;
}

/// `hookctl sources apply` refuses two sequence sources of one tenant whose IDs follow the same
/// template: their numbers would name each other's events.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn sources_apply_refuses_two_sequence_sources_of_a_tenant_with_one_id_template(pool: PgPool) {
    let dir =
        std::env::temp_dir().join(format!("fidelity-sources-{}-{}", std::process::id(), now()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let seq = |id: &str, tenant: &str, template: &str| {
        format!(
            "[[source]]\nid = '{id}'\ntenant = '{tenant}'\nscheme = 'stripe'\nsecret_ref = 's'\n\
             [source.fields]\nsequence = 'json:/sequence'\n[source.gaps]\nstrategy = 'sequence'\n\
             id_template = '{template}'\napi_base_url = 'http://127.0.0.1:9'\napi_secret_ref = 'k'\n"
        )
    };
    let apply = |path: std::path::PathBuf| {
        let pool = pool.clone();
        async move {
            let list = shared::sources::read_sources_file(&path).map_err(|e| e.to_string())?;
            shared::sources::apply(&pool, &list)
                .await
                .map_err(|e| e.to_string())
        }
    };

    let both = write(
        "both.toml",
        &(seq("seq-a", "acme", "evt_{seq}") + &seq("seq-b", "acme", "evt_{seq}")),
    );
    let refused = apply(both).await.unwrap_err();
    assert!(
        refused.contains("seq-a") && refused.contains("seq-b") && refused.contains("evt_{seq}"),
        "{refused}"
    );
    assert_eq!(
        pipeline_tests::drain::scalar(&pool, "SELECT count(*) FROM sources").await,
        0,
        "nothing applied"
    );

    apply(write("a.toml", &seq("seq-a", "acme", "evt_{seq}")))
        .await
        .unwrap();
    let later = apply(write("b.toml", &seq("seq-b", "acme", "evt_{seq}")))
        .await
        .unwrap_err();
    assert!(later.contains("seq-a"), "{later}");
    // Another tenant, or another template, is fine; so is re-applying the same source.
    apply(write(
        "c.toml",
        &(seq("seq-c", "globex", "evt_{seq}") + &seq("seq-d", "acme", "ord_{seq}")),
    ))
    .await
    .unwrap();
    apply(write("a2.toml", &seq("seq-a", "acme", "evt_{seq}")))
        .await
        .unwrap();
    assert_eq!(
        pipeline_tests::drain::scalar(&pool, "SELECT count(*) FROM sources").await,
        3
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Re-applying a source that has stored events with its event id read another way would
/// re-identify every redelivery of those events: each stored again as a new event, its effects
/// made twice. `apply` refuses it, naming both locators and how to keep or take the change;
/// `apply_changing_event_ids` (`hookctl sources apply --change-event-ids`) takes it. A source
/// with no events yet may change freely. (The catalogue's default can change under an
/// unchanged sources file: Adyen's id moved from the body's digest to signed values.)
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn reapplying_a_source_with_events_under_another_event_id_is_refused(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let stored = delivery(
        Scheme::Stripe,
        &secret_of(Scheme::Stripe),
        "evt_ids_1",
        now(),
        json!({}),
    );
    assert_eq!(
        app.post("stripe", stored.headers, &stored.body)
            .await
            .outcome(),
        "accepted"
    );
    let mut rekeyed = source("stripe", TENANT, Scheme::Stripe, "secret/stripe");
    rekeyed.fields.external_id = shared::FieldLocator::parse("json:/data/object/id").unwrap();
    let locator = |pool: PgPool| async move {
        sqlx::query_scalar::<_, String>(
            "SELECT external_id_from FROM sources WHERE source_id = 'stripe'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };

    let refused = shared::sources::apply(&app.pool, std::slice::from_ref(&rekeyed))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("stripe")
            && refused.contains("json:/id")
            && refused.contains("json:/data/object/id")
            && refused.contains("--change-event-ids"),
        "{refused}"
    );
    assert_eq!(
        locator(app.pool.clone()).await,
        "json:/id",
        "nothing applied"
    );
    // The same locator, and another source with no events, apply as before.
    let mut quiet = rekeyed.clone();
    quiet.source_id = shared::domain::SourceId::parse("stripe-quiet").unwrap();
    shared::sources::apply(
        &app.pool,
        &[
            source("stripe", TENANT, Scheme::Stripe, "secret/stripe"),
            quiet,
        ],
    )
    .await
    .unwrap();

    shared::sources::apply_changing_event_ids(&app.pool, std::slice::from_ref(&rekeyed))
        .await
        .unwrap();
    assert_eq!(locator(app.pool.clone()).await, "json:/data/object/id");
}

// ---- 6. A backfilled event's late delivery is not a conflict ------------------------------

/// Stripe's API renders an event differently from the delivery (`pending_webhooks`, and
/// `request` in the API version of the call, not the endpoint's): an event backfilled during an
/// outage, then delivered when Stripe's retry finally gets through, is the same event. Its
/// delivery is a duplicate, never a digest conflict.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_backfilled_event_delivered_late_is_a_duplicate_not_a_conflict(pool: PgPool) {
    use pipeline_tests::gaps::*;
    use std::sync::Arc;
    use std::time::Duration;

    let provider = provider(60, vec![]);
    let base = Arc::clone(&provider).serve().await;
    let app = app(
        pool.clone(),
        &[provider_source(
            "by-listing",
            shared::sources::GapStrategy::ListApi,
            &base,
            Duration::ZERO,
        )],
    )
    .await;
    let (deliveries, _) = provider.deliveries(simulator::DeliveryPlan {
        duplicate_rate: 0.0,
        drop_rate: 0.0,
        reorder_window: 1,
        seed: 1,
        signed_at: now(),
    });
    // An outage: events 41..=50 never got through; Stripe keeps retrying them.
    let (outage, arrived): (Vec<_>, Vec<_>) = deliveries.into_iter().partition(|d| {
        let n: u64 = d.id.trim_start_matches("evt_").parse().unwrap();
        (41..=50).contains(&n)
    });
    deliver_all(&app, "by-listing", arrived).await;
    let pass = backfiller(&pool).run_once("test").await.unwrap();
    assert!(
        matches!(&pass, shared::backfill::BackfillRun::Completed { outcome, .. } if outcome.backfilled == 10),
        "{pass:?}"
    );
    let api_copy = event(&pool, TENANT, "evt_45").await.unwrap();
    let late = outage.iter().find(|d| d.id == "evt_45").unwrap();
    assert_eq!(api_copy.verified_with, "provider_api");
    assert_ne!(
        api_copy.payload.as_deref(),
        Some(&late.body[..]),
        "the simulator's API copy differs from the delivery, as Stripe's does"
    );

    for d in outage {
        let reply = app.post("by-listing", d.headers, &d.body).await;
        assert_eq!(
            (reply.status, reply.outcome()),
            (StatusCode::OK, "duplicate"),
            "{}: {:?}",
            d.id,
            reply.json
        );
    }

    assert!(
        anomalies(&pool).await.is_empty(),
        "{:?}",
        anomalies(&pool).await
    );
    let counts: (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), sum(delivery_count), sum(conflict_count) FROM webhook_events WHERE verified_with = 'provider_api'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(counts, (10, 20, 0));
}

// ---- 2. Shopify deletes and versions ------------------------------------------------------

/// A Shopify delivery as Shopify sends it: the id, topic and trigger time in headers.
fn shopify(webhook_id: &str, topic: &str, triggered_at: &str, body: serde_json::Value) -> Delivery {
    let mut headers = HeaderMap::new();
    set(&mut headers, "x-shopify-webhook-id", webhook_id);
    set(
        &mut headers,
        "x-shopify-event-id",
        &format!("event-{webhook_id}"),
    );
    set(&mut headers, "x-shopify-topic", topic);
    set(&mut headers, "x-shopify-triggered-at", triggered_at);
    set(&mut headers, "x-shopify-shop-domain", "acme.myshopify.com");
    resign(
        Scheme::Shopify,
        &secret_of(Scheme::Shopify),
        webhook_id,
        now(),
        headers,
        serde_json::to_vec(&body).unwrap(),
    )
}

fn product(id: i64, title: &str, updated_at: &str) -> serde_json::Value {
    json!({"id": id, "admin_graphql_api_id": format!("gid://shopify/Product/{id}"), "title": title, "updated_at": updated_at})
}

/// Delivers one at a time and drains after each, so the drain sees them in this order.
async fn deliver_in_order(app: &TestApp, deliveries: Vec<Delivery>) {
    let drainer = pipeline_tests::drain::standard_drainer(&app.pool);
    for d in deliveries {
        let reply = app.post("shopify", d.headers, &d.body).await;
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json);
        pipeline_tests::drain::drain_all(&drainer, &app.pool, std::time::Duration::from_secs(10))
            .await;
    }
}

/// (type, id) → (title, deleted) of every projected entity.
async fn entities(pool: &PgPool) -> Vec<(String, String, Option<String>, bool)> {
    sqlx::query_as(
        "SELECT entity_type, entity_id, state->>'title', deleted FROM entities ORDER BY entity_type, entity_id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// A `products/delete` body is only `{"id": N}`: no GraphQL id, no `updated_at`. It lands on the
/// entity its updates land on, versioned by `X-Shopify-Triggered-At`, and a late update never
/// resurrects it.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_shopify_delete_lands_on_the_entity_of_its_updates(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let update = shopify(
        "wh-upd",
        "products/update",
        "2026-11-30T15:00:05.200000000Z",
        product(632910392, "Hoodie", "2026-11-30T10:00:05-05:00"),
    );
    let delete = shopify(
        "wh-del",
        "products/delete",
        "2026-11-30T15:07:00.000000000Z",
        json!({"id": 632910392}),
    );

    // The delete overtakes the update.
    deliver_in_order(&app, vec![delete, update]).await;

    assert_eq!(
        entities(&app.pool).await,
        [("products".into(), "632910392".into(), None, true)],
        "one entity, deleted, not resurrected by the late update"
    );
    let delete = event(&app.pool, TENANT, "wh-del").await.unwrap();
    assert_eq!(
        (
            &delete.headers["x-shopify-event-id"],
            &delete.headers["x-shopify-triggered-at"]
        ),
        (
            &json!("event-wh-del"),
            &json!("2026-11-30T15:07:00.000000000Z")
        ),
        "the shop event id and trigger time are kept with the delivery"
    );
    let rows: Vec<(String, Option<String>, Option<i64>)> = sqlx::query_as(
        "SELECT external_id, entity_id, entity_version FROM webhook_events ORDER BY external_id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        [
            (
                "wh-del".into(),
                Some("632910392".into()),
                Some(1_796_051_220_000_000)
            ),
            (
                "wh-upd".into(),
                Some("632910392".into()),
                Some(1_796_050_805_000_000)
            ),
        ]
    );
}

/// `updated_at` has one-second precision. Two updates in one second carry one version; the
/// later trigger time decides, whatever order they are processed in.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn two_shopify_updates_in_one_second_keep_the_later(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let second = "2026-11-30T10:00:05-05:00";
    let first_change = |id: i64| {
        shopify(
            &format!("wh-{id}-a"),
            "products/update",
            "2026-11-30T15:00:05.100000000Z",
            product(id, "first", second),
        )
    };
    let second_change = |id: i64| {
        shopify(
            &format!("wh-{id}-b"),
            "products/update",
            "2026-11-30T15:00:05.700000000Z",
            product(id, "second", second),
        )
    };
    deliver_in_order(&app, vec![first_change(1), second_change(1)]).await;
    deliver_in_order(&app, vec![second_change(2), first_change(2)]).await;

    assert_eq!(
        entities(&app.pool).await,
        [
            ("products".into(), "1".into(), Some("second".into()), false),
            ("products".into(), "2".into(), Some("second".into()), false),
        ]
    );
    assert!(
        anomalies(&app.pool).await.is_empty(),
        "the trigger time orders them: nothing ambiguous"
    );
    let report = shared::anomaly::run_once(&app.pool, &Default::default(), "test")
        .await
        .unwrap();
    assert!(
        !report
            .breaches
            .iter()
            .any(|b| b == "semantic_duplicates_last_day"),
        "two changes in one second are not the same change: {:?}",
        report.breaches
    );
}

/// Two different changes with one version and one trigger time: nothing says which is later.
/// The same one wins in any processing order (the greater event id), and it is recorded.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn two_changes_nothing_orders_are_settled_alike_and_recorded(pool: PgPool) {
    let app = TestApp::spawn(pool).await;
    let second = "2026-11-30T10:00:05-05:00";
    let at = "2026-11-30T15:00:05.500000000Z";
    let change = |id: i64, tag: &str| {
        shopify(
            &format!("wh-{id}-{tag}"),
            "products/update",
            at,
            product(id, tag, second),
        )
    };
    deliver_in_order(&app, vec![change(1, "a"), change(1, "b")]).await;
    deliver_in_order(&app, vec![change(2, "b"), change(2, "a")]).await;

    assert_eq!(
        entities(&app.pool).await,
        [
            ("products".into(), "1".into(), Some("b".into()), false),
            ("products".into(), "2".into(), Some("b".into()), false),
        ],
        "the same change wins in both orders"
    );
    let found = anomalies(&app.pool).await;
    let kinds: Vec<(&str, Option<&str>)> = found
        .iter()
        .map(|a| (a.kind.as_str(), a.external_id.as_deref()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("ambiguous_version", Some("wh-1-b")),
            ("ambiguous_version", Some("wh-2-a"))
        ]
    );
    assert!(found[0].detail.contains("wh-1-a"), "{}", found[0].detail);
    assert_breached(&app.pool, "ambiguous_versions_last_day").await;
}

/// A Shopify source applied before deletes could project, with products already projected under
/// their GraphQL ids: the migration moves the source to the numeric id and the version fallback,
/// and re-keys what it stored, so the next delete lands on the entity its updates made.
#[sqlx::test(migrations = false)]
async fn shopify_sources_applied_before_keep_one_entity_per_resource(pool: PgPool) {
    let migrator = &shared::store::MIGRATOR;
    migrator.run_to(20261201000022, &pool).await.unwrap();
    sqlx::query(
        "INSERT INTO sources (source_id, tenant_id, scheme, secret_ref, external_id_from, event_type_from, \
             entity_id_from, entity_version_from) \
         VALUES ('shopify', $1, 'shopify', 'secret/shopify', 'header:x-shopify-webhook-id', 'header:x-shopify-topic', \
             'json:/admin_graphql_api_id', 'json:/updated_at')",
    )
    .bind(TENANT)
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, entity_id, entity_version, \
             payload, payload_sha256, verified_with, received_at, first_received_at, last_seen_at, status, processed_at, expects) \
         VALUES ($1, 'wh-old', 'shopify', 'products/update', 'gid://shopify/Product/77', 1796050805000000, \
             '{}', sha256('old'), 'current', now(), now(), now(), 'processed', now(), 'projection')",
    )
    .bind(TENANT)
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO entities (tenant_id, entity_type, entity_id, version, state, last_event_id) \
         VALUES ($1, 'products', 'gid://shopify/Product/77', 1796050805000000, '{\"title\": \"Cap\"}', 'wh-old')",
    )
    .bind(TENANT)
    .execute(&pool)
    .await
    .unwrap();

    migrator.run(&pool).await.unwrap();

    let stored = shared::sources::find(&pool, &shared::SourceId::parse("shopify").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        stored.fields,
        shared::extract::FieldMap::defaults_for(Scheme::Shopify)
    );
    let app = TestApp::new(pool.clone(), &[], secrets_for_every_scheme()).await;
    deliver_in_order(
        &app,
        vec![shopify(
            "wh-del-77",
            "products/delete",
            "2026-11-30T16:00:00Z",
            json!({"id": 77}),
        )],
    )
    .await;
    assert_eq!(
        entities(&pool).await,
        [("products".into(), "77".into(), Some("Cap".into()), true)]
    );
    let entity_ids: Vec<Option<String>> =
        sqlx::query_scalar("SELECT entity_id FROM webhook_events ORDER BY external_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(entity_ids, [Some("77".into()), Some("77".into())]);
}

// ---- 5. List backfill lists what the endpoint subscribed to -------------------------------

/// One Stripe account, three event types, two endpoints: billing subscribed to `invoice.paid`,
/// crm to `customer.updated`; nobody to `charge.refunded`. Each source lists only its own types:
/// it backfills its own drops, never the other endpoint's events or ones nobody subscribed to.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn list_backfill_asks_only_for_the_types_the_endpoint_subscribed_to(pool: PgPool) {
    use pipeline_tests::gaps::*;
    use std::sync::Arc;
    use std::time::Duration;

    let provider = typed_provider(90, &["invoice.paid", "customer.updated", "charge.refunded"]);
    let base = Arc::clone(&provider).serve().await;
    let typed = |id: &str, types: &[&str]| {
        let mut s = provider_source(
            id,
            shared::sources::GapStrategy::ListApi,
            &base,
            Duration::ZERO,
        );
        if let Some(gaps) = s.gaps.as_mut() {
            gaps.event_types = Some(types.iter().map(|t| t.to_string()).collect());
        }
        s
    };
    let app = app(
        pool.clone(),
        &[
            typed("billing", &["invoice.paid"]),
            typed("crm", &["customer.updated"]),
        ],
    )
    .await;
    let (deliveries, _) = provider.deliveries(simulator::DeliveryPlan {
        duplicate_rate: 0.0,
        drop_rate: 0.0,
        reorder_window: 1,
        seed: 2,
        signed_at: now(),
    });
    let type_of = |d: &simulator::Delivery| {
        serde_json::from_slice::<serde_json::Value>(&d.body).unwrap()["type"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let mut dropped = Vec::new();
    for (source_id, event_type) in [("billing", "invoice.paid"), ("crm", "customer.updated")] {
        let (mine, _): (Vec<_>, Vec<_>) = deliveries
            .iter()
            .cloned()
            .partition(|d| type_of(d) == event_type);
        // Every fifth of the endpoint's own events never arrived.
        let (lost, arrived): (Vec<_>, Vec<_>) =
            mine.into_iter().enumerate().partition(|(i, _)| i % 5 == 0);
        dropped.extend(lost.into_iter().map(|(_, d)| (source_id, d.id)));
        deliver_all(
            &app,
            source_id,
            arrived.into_iter().map(|(_, d)| d).collect(),
        )
        .await;
    }

    let run = backfiller(&pool).run_once("test").await.unwrap();

    let shared::backfill::BackfillRun::Completed { outcome, .. } = run else {
        panic!("{run:?}")
    };
    assert_eq!(
        (outcome.backfilled as usize, outcome.errors),
        (dropped.len(), 0),
        "{outcome:?}"
    );
    let mut fetched = provider.fetched();
    fetched.sort();
    let mut expected: Vec<String> = dropped.iter().map(|(_, id)| id.clone()).collect();
    expected.sort();
    assert_eq!(
        fetched, expected,
        "only the endpoints' own drops were fetched"
    );
    let stored: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT source_id, event_type, count(*) FROM webhook_events GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        stored,
        [
            ("billing".into(), "invoice.paid".into(), 30),
            ("crm".into(), "customer.updated".into(), 30)
        ]
    );
    let mut asked = provider.listed_types();
    asked.sort();
    asked.dedup();
    assert_eq!(
        asked,
        [
            vec!["customer.updated".to_owned()],
            vec!["invoice.paid".to_owned()]
        ]
    );
}

/// A listing longer than `BACKFILL_MAX_LIST_PAGES` is cut: what was listed is still used, and
/// the cut is recorded in the pass and breaches a check (it used to fail the source quietly).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_listing_past_its_page_limit_is_recorded_and_trips_a_check(pool: PgPool) {
    use pipeline_tests::gaps::*;
    use std::sync::Arc;
    use std::time::Duration;

    let provider = provider(250, vec![]);
    let base = Arc::clone(&provider).serve().await;
    let app = app(
        pool.clone(),
        &[provider_source(
            "by-listing",
            shared::sources::GapStrategy::ListApi,
            &base,
            Duration::ZERO,
        )],
    )
    .await;
    let (deliveries, _) = provider.deliveries(simulator::DeliveryPlan {
        duplicate_rate: 0.0,
        drop_rate: 0.0,
        reorder_window: 1,
        seed: 3,
        signed_at: now(),
    });
    // The newest and the oldest of the window never arrived.
    deliver_all(
        &app,
        "by-listing",
        deliveries
            .into_iter()
            .filter(|d| d.id != "evt_240" && d.id != "evt_10")
            .collect(),
    )
    .await;
    let settings = shared::backfill::BackfillSettings {
        max_list_pages: 2,
        ..Default::default()
    };

    let run = backfiller_with(&pool, settings)
        .run_once("test")
        .await
        .unwrap();

    let shared::backfill::BackfillRun::Completed { outcome, run_id } = run else {
        panic!("{run:?}")
    };
    assert_eq!(outcome.truncated_listings, ["by-listing"], "{outcome:?}");
    assert!(outcome.failed_sources.is_empty(), "{outcome:?}");
    assert_eq!(
        provider.fetched(),
        ["evt_240"],
        "the newest pages were listed and used"
    );
    let recorded: serde_json::Value = sqlx::query_scalar(
        "SELECT found->'truncated_listings' FROM maintenance_runs WHERE run_id = $1",
    )
    .bind(run_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(recorded, json!(["by-listing"]));
    assert_breached(&pool, "truncated_gap_listings").await;
}

/// Stripe's `types[]` takes up to 20 types: an endpoint subscribed to more is listed in groups.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn more_than_twenty_subscribed_types_are_listed_in_groups(pool: PgPool) {
    use pipeline_tests::gaps::*;
    use std::sync::Arc;
    use std::time::Duration;

    let types: Vec<String> = (0..25).map(|n| format!("thing_{n:02}.updated")).collect();
    let names: Vec<&str> = types.iter().map(String::as_str).collect();
    let provider = typed_provider(50, &names);
    let base = Arc::clone(&provider).serve().await;
    let mut source = provider_source(
        "many",
        shared::sources::GapStrategy::ListApi,
        &base,
        Duration::ZERO,
    );
    if let Some(gaps) = source.gaps.as_mut() {
        gaps.event_types = Some(types.clone());
    }
    let _app = app(pool.clone(), &[source]).await;

    let run = backfiller(&pool).run_once("test").await.unwrap();

    let shared::backfill::BackfillRun::Completed { outcome, .. } = run else {
        panic!("{run:?}")
    };
    assert_eq!((outcome.backfilled, outcome.errors), (50, 0), "{outcome:?}");
    assert_eq!(
        provider.listed_types(),
        [types[..20].to_vec(), types[20..].to_vec()]
    );
}

// ---- 8. GitHub backfill: list the hook's deliveries, ask for the failed ones again ---------

mod github {
    use std::sync::Arc;

    use chrono::TimeDelta;
    use pipeline_tests::*;
    use shared::backfill::{BackfillSettings, Backfiller};
    use shared::domain::Scheme;
    use shared::secrets::{SecretSet, SecretStore};
    use simulator::github::{GithubHook, HookAuth, HookConfig, guid};
    use sqlx::PgPool;

    const TOKEN: &str = "ghp_simulated_token";

    /// The local runner over HTTP: GitHub delivers and redelivers to it as to the real endpoint.
    async fn runner(app: &TestApp) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let runner = hookctl::serve::Runner {
            ingestor: Arc::clone(&app.ingestor),
            registry: Arc::new(shared::effects::EffectRegistry::standard()),
            buffer: None,
        };
        tokio::spawn(hookctl::serve::serve(
            listener,
            hookctl::serve::router(runner, MAX_BODY),
        ));
        format!("http://{address}")
    }

    /// Applies a sources file as `hookctl sources apply` does.
    async fn apply_sources(pool: &PgPool, toml: &str) {
        let path = std::env::temp_dir().join(format!(
            "fidelity-github-{}-{}.toml",
            std::process::id(),
            now()
        ));
        std::fs::write(&path, toml).unwrap();
        let read = shared::sources::read_sources_file(&path);
        std::fs::remove_file(&path).ok();
        shared::sources::apply(pool, &read.unwrap()).await.unwrap();
    }

    fn github_source(id: &str, tenant: &str, hook: &str, base: &str, extra: &str) -> String {
        format!(
            "[[source]]\nid = '{id}'\ntenant = '{tenant}'\nscheme = 'github'\nsecret_ref = 'github-signing'\n\
             [source.gaps]\nstrategy = 'github_deliveries'\nhook = '{hook}'\napi_base_url = '{base}'\n\
             api_secret_ref = '{id}-api'\ngrace_seconds = 0\nwindow = 86400\n{extra}\n"
        )
    }

    async fn stored_guids(pool: &PgPool, source_id: &str) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT external_id FROM webhook_events WHERE source_id = $1 ORDER BY external_id",
        )
        .bind(source_id)
        .fetch_all(pool)
        .await
        .unwrap()
    }

    /// A repository hook whose receiver was down for ten deliveries: GitHub never retries them.
    /// Backfill lists the hook's deliveries (two pages, followed through `Link`), asks GitHub to
    /// redeliver each failed event by its newest delivery id, and GitHub's signed redeliveries
    /// land through ingest under the same GUID. One delivery GitHub no longer keeps is
    /// tombstoned. A second pass finds nothing to do.
    #[sqlx::test(migrator = "shared::store::MIGRATOR")]
    async fn github_failed_deliveries_are_redelivered_through_ingest(pool: PgPool) {
        let signing = secret_of(Scheme::Github);
        let hook = GithubHook::new(HookConfig {
            path: "/repos/acme/api/hooks/42".into(),
            signing_secret: signing.clone(),
            auth: HookAuth::Token(TOKEN.into()),
            events: 150,
        });
        let api = Arc::clone(&hook).serve().await;
        let secrets = || {
            SecretStore::memory([
                (
                    "github-signing".to_owned(),
                    SecretSet::new(signing.clone(), None),
                ),
                ("gh-repo-api".to_owned(), SecretSet::new(TOKEN, None)),
            ])
        };
        let app = TestApp::new(pool.clone(), &[], secrets()).await;
        apply_sources(
            &pool,
            &github_source("gh-repo", TENANT, "/repos/acme/api/hooks/42", &api, ""),
        )
        .await;
        let url = format!("{}/webhooks/gh-repo", runner(&app).await);
        let failed = |n: u64| n.is_multiple_of(15);
        hook.deliver(&url, TimeDelta::minutes(30), failed).await;
        hook.expire(&guid(150));
        assert_eq!(stored_guids(&pool, "gh-repo").await.len(), 140);
        let backfiller = Backfiller::new(
            pool.clone(),
            Arc::new(secrets()),
            BackfillSettings::default(),
        );

        let first = backfill_pass(&backfiller).await;
        let second = backfill_pass(&backfiller).await;

        assert_eq!(
            (
                first.new_candidates,
                first.redeliveries_requested,
                first.tombstoned,
                first.errors
            ),
            (10, 9, 1, 0),
            "{first:?}"
        );
        assert_eq!(
            (
                second.new_candidates,
                second.redeliveries_requested,
                second.tombstoned
            ),
            (0, 0, 0),
            "{second:?}"
        );
        let mut expected: Vec<String> = (1..=149).map(guid).collect();
        expected.sort();
        assert_eq!(
            stored_guids(&pool, "gh-repo").await,
            expected,
            "every event but the expired one, once"
        );
        let redelivered: Vec<(String, String, i32)> = sqlx::query_as(
            "SELECT external_id, verified_with, delivery_count FROM webhook_events \
             WHERE external_id = ANY($1) ORDER BY external_id",
        )
        .bind((1..=9).map(|k| guid(15 * k)).collect::<Vec<_>>())
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(redelivered.len(), 9);
        assert!(
            redelivered
                .iter()
                .all(|(_, verified, count)| verified == "current" && *count == 1),
            "{redelivered:?}"
        );
        // Each redelivery was asked for by the failed delivery's own id.
        let failed_ids: Vec<(i64, String)> = hook
            .deliveries()
            .into_iter()
            .filter(|d| !d.redelivery && d.status_code == 502)
            .map(|d| (d.id, d.guid))
            .collect();
        assert_eq!(hook.redeliveries(), failed_ids);
        assert_eq!(
            hook.cursors().iter().filter(|c| c.is_some()).count(),
            2,
            "{:?}",
            hook.cursors()
        );
        let statuses: Vec<(String, i64)> = sqlx::query_as(
            "SELECT status, count(*) FROM gap_candidates GROUP BY status ORDER BY status",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(
            statuses,
            [("redelivered".into(), 9), ("tombstoned".into(), 1)]
        );
        let reason: String =
            sqlx::query_scalar("SELECT reason FROM tombstones WHERE external_id = $1")
                .bind(guid(150))
                .fetch_one(&pool)
                .await
                .unwrap();
        assert!(
            reason.contains("GitHub no longer has this delivery"),
            "{reason}"
        );
    }

    /// A GitHub App's hook (`/app/hook`) answers only to a JSON Web Token the App signs with its
    /// private key; an organisation hook to a token. One pass backfills both.
    #[sqlx::test(migrator = "shared::store::MIGRATOR")]
    async fn github_app_and_organisation_hooks_are_backfilled(pool: PgPool) {
        let dir =
            std::env::temp_dir().join(format!("fidelity-app-key-{}-{}", std::process::id(), now()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("app.pem");
        let openssl = |args: &[&str]| {
            let out = std::process::Command::new("openssl")
                .args(args)
                .output()
                .expect("openssl");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        // GitHub hands out PKCS#1 PEM keys.
        openssl(&[
            "genrsa",
            "-traditional",
            "-out",
            key.to_str().unwrap(),
            "2048",
        ]);
        let public = dir.join("app.pub.der");
        openssl(&[
            "rsa",
            "-in",
            key.to_str().unwrap(),
            "-RSAPublicKey_out",
            "-outform",
            "DER",
            "-out",
            public.to_str().unwrap(),
        ]);
        let private_pem = std::fs::read_to_string(&key).unwrap();
        let public_der = std::fs::read(&public).unwrap();
        std::fs::remove_dir_all(&dir).ok();

        let signing = secret_of(Scheme::Github);
        let app_hook = GithubHook::new(HookConfig {
            path: "/app/hook".into(),
            signing_secret: signing.clone(),
            auth: HookAuth::App {
                app_id: "4242".into(),
                public_key: public_der,
            },
            events: 30,
        });
        let org_hook = GithubHook::new(HookConfig {
            path: "/orgs/globex/hooks/7".into(),
            signing_secret: signing.clone(),
            auth: HookAuth::Token(TOKEN.into()),
            events: 30,
        });
        let app_api = Arc::clone(&app_hook).serve().await;
        let org_api = Arc::clone(&org_hook).serve().await;
        let secrets = || {
            SecretStore::memory([
                (
                    "github-signing".to_owned(),
                    SecretSet::new(signing.clone(), None),
                ),
                (
                    "gh-app-api".to_owned(),
                    SecretSet::new(private_pem.clone(), None),
                ),
                ("gh-org-api".to_owned(), SecretSet::new(TOKEN, None)),
            ])
        };
        let app = TestApp::new(pool.clone(), &[], secrets()).await;
        apply_sources(
            &pool,
            &(github_source("gh-app", TENANT, "/app/hook", &app_api, "app_id = '4242'")
                + &github_source("gh-org", "globex", "/orgs/globex/hooks/7", &org_api, "")),
        )
        .await;
        let base = runner(&app).await;
        app_hook
            .deliver(
                &format!("{base}/webhooks/gh-app"),
                TimeDelta::minutes(5),
                |n| n % 10 == 3,
            )
            .await;
        org_hook
            .deliver(
                &format!("{base}/webhooks/gh-org"),
                TimeDelta::minutes(5),
                |n| n == 30,
            )
            .await;
        let backfiller = Backfiller::new(
            pool.clone(),
            Arc::new(secrets()),
            BackfillSettings::default(),
        );

        let outcome = backfill_pass(&backfiller).await;

        assert_eq!(
            (
                outcome.new_candidates,
                outcome.redeliveries_requested,
                outcome.errors,
                outcome.failed_sources.len()
            ),
            (4, 4, 0, 0),
            "{outcome:?}"
        );
        assert_eq!(stored_guids(&pool, "gh-app").await.len(), 30);
        assert_eq!(stored_guids(&pool, "gh-org").await.len(), 30);
        assert_eq!(app_hook.redeliveries().len(), 3);
        assert_eq!(org_hook.redeliveries(), [(1029, guid(30))]);
    }
}
