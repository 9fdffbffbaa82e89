//! The scheduled and operator Lambdas, called as the runtime calls them: a constructed
//! `LambdaEvent` with a deadline in its context.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_lambda_events::eventbridge::EventBridgeEvent;
use lambda_runtime::{Context, LambdaEvent};
use pipeline_tests::drain::*;
use shared::effects::EffectRegistry;
use sqlx::PgPool;

fn scheduled(deadline_in: Duration) -> LambdaEvent<EventBridgeEvent> {
    let event: EventBridgeEvent = serde_json::from_value(serde_json::json!({
        "version": "0", "id": "53dc4d37-cffa-4f76-80c9-8b7d4a4d2eaa", "detail-type": "Scheduled Event",
        "source": "aws.events", "account": "123456789012", "time": "2026-11-30T12:00:00Z",
        "region": "us-east-1", "resources": ["arn:aws:events:us-east-1:123456789012:rule/drain"], "detail": {}
    }))
    .unwrap();
    let mut context = Context::default();
    context.deadline = (SystemTime::now() + deadline_in)
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    LambdaEvent::new(event, context)
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_drain_function_drains_and_reports_counts(pool: PgPool) {
    let app = app(pool.clone()).await;
    for i in 0..120 {
        let d = entity_event(&format!("f-{i}"), &format!("x-{i}"), 1, "thing.updated");
        app.post(ENTITIES, d.headers, &d.body).await;
    }
    let drainer = standard_drainer(&pool);
    // An event that arrives while the invocation waits for work, a second in: started by its
    // schedule, the function stays in its time (here three seconds: a six-second deadline less
    // a three-second margin) and processes it then, not at the next schedule.
    let late = {
        let ingestor = app.ingestor.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let d = entity_event("f-late", "x-late", 1, "thing.updated");
            pipeline_tests::post_to(&ingestor, ENTITIES, d.headers, &d.body).await
        })
    };

    let started = std::time::Instant::now();
    let summary = ::drain::handler(
        scheduled(Duration::from_secs(6)),
        &drainer,
        Duration::from_secs(3),
    )
    .await
    .unwrap();

    assert!(late.await.unwrap().status.is_success());
    assert_eq!(
        (summary.claimed, summary.processed, summary.batches),
        (121, 121, 4),
        "three batches of the 120, one of the late event; the polls that found nothing are not batches"
    );
    assert_eq!(queue_len(&pool).await, 0);
    assert!(
        started.elapsed() >= Duration::from_millis(2500),
        "it stayed until its deadline less the margin"
    );
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_drain_function_stops_at_its_deadline(pool: PgPool) {
    let app = app(pool.clone()).await;
    let d = entity_event("late-1", "x", 1, "thing.updated");
    app.post(ENTITIES, d.headers, &d.body).await;
    let drainer = standard_drainer(&pool);
    // Two seconds left, a three-second margin: no batch may start.
    let summary = ::drain::handler(
        scheduled(Duration::from_secs(2)),
        &drainer,
        Duration::from_secs(3),
    )
    .await
    .unwrap();
    assert_eq!(summary.batches, 0);
    assert_eq!(queue_len(&pool).await, 1);
}

/// The retention function purges until nothing is past its horizons, within its deadline: with
/// two seconds left and a three-second margin it starts no batch and says so.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_retention_function_purges_within_its_deadline(pool: PgPool) {
    let app = app(pool.clone()).await;
    for i in 0..30 {
        let d = entity_event(&format!("r-{i}"), &format!("x-{i}"), 1, "thing.updated");
        app.post(ENTITIES, d.headers, &d.body).await;
    }
    drain_all(&standard_drainer(&pool), &pool, Duration::from_secs(10)).await;
    sqlx::query(
        "UPDATE webhook_events SET first_received_at = now() - interval '40 days', \
             last_seen_at = now() - interval '40 days'",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("UPDATE outbox SET status = 'delivered', delivered_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    let settings = shared::retention::RetentionSettings {
        batch_size: 10,
        ..Default::default()
    };

    let late = ::retention::handler(
        scheduled(Duration::from_secs(2)),
        &pool,
        &settings,
        Duration::from_secs(3),
    )
    .await
    .unwrap();
    assert_eq!(late.identities_purged, 0, "{late:?}");
    assert!(late.cut_short.contains(&"identities"), "{late:?}");
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM webhook_events").await,
        30
    );

    let done = ::retention::handler(
        scheduled(Duration::from_secs(60)),
        &pool,
        &settings,
        Duration::from_secs(3),
    )
    .await
    .unwrap();
    assert_eq!(
        (done.identities_purged, done.cut_short.len()),
        (30, 0),
        "{done:?}"
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM webhook_events").await,
        0
    );
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_operator_function_replays_lists_and_triages(pool: PgPool) {
    let app = app(pool.clone()).await;
    create_order(&pool, "ord-1", "REF-1", 100, "eur").await;
    // A payment event dead-lettered by hand, as an operator would find it after an outage.
    let d = payment("evt_dl", "ord-1", "REF-1", 100, "eur");
    app.post("stripe", d.headers, &d.body).await;
    sqlx::query(
        "WITH q AS (DELETE FROM event_queue RETURNING tenant_id, external_id), \
              e AS (UPDATE webhook_events SET status = 'dead_lettered', attempts = 8 WHERE external_id = 'evt_dl' RETURNING *) \
         INSERT INTO dead_letters (tenant_id, external_id, source_id, event_type, payload, headers, error, reason, attempts) \
         SELECT tenant_id, external_id, source_id, event_type, payload, headers, 'retryable: upstream timeout', 'exhausted', attempts FROM e",
    )
    .execute(&pool)
    .await
    .unwrap();
    let registry = EffectRegistry::standard();
    let invoke = |json: serde_json::Value| {
        operator::handler(
            LambdaEvent::new(json, Context::default()),
            &pool,
            &registry,
            None,
        )
    };

    let listed = serde_json::to_value(
        invoke(serde_json::json!({"action": "list_dead_letters"}))
            .await
            .unwrap(),
    )
    .unwrap();
    let id = listed["dead_letters"][0]["dead_letter_id"]
        .as_i64()
        .unwrap();
    assert_eq!(listed["dead_letters"][0]["external_id"], "evt_dl");
    let triaged = serde_json::to_value(invoke(serde_json::json!({"action": "set_dead_letter_status", "dead_letter_id": id, "status": "investigating", "actor": "alice", "reason": "upstream timeouts"})).await.unwrap()).unwrap();
    assert_eq!(triaged["status"], "investigating");
    let bad = invoke(serde_json::json!({"action": "set_dead_letter_status", "dead_letter_id": id, "status": "replayed"})).await.unwrap_err();
    assert_eq!(bad.error_type, "BadRequest");

    let replayed = serde_json::to_value(
        invoke(serde_json::json!({"action": "replay", "filter": {"error_contains": "timeout"}, "actor": "alice", "reason": "upstream is back"}))
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        replayed,
        serde_json::json!({"selected": 1, "replayed": 1, "failed": 0, "skipped": 0})
    );
    let again = serde_json::to_value(
        invoke(serde_json::json!({"action": "replay", "filter": {"ids": [id]}, "actor": "alice", "reason": "once more"}))
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(again["selected"], 0);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM orders WHERE state = 'paid'").await,
        1
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE action = 'fulfil_order'"
        )
        .await,
        1
    );
}

/// Invoked directly (`aws lambda invoke`, no hookctl in front), the operator function still
/// refuses a change without an actor or a reason and a replay with no filter unless `all`, and
/// records what Lambda said about the invocation beside the claimed actor. `show_dead_letter`
/// withholds the signature headers.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_operator_function_refuses_unattributed_or_unbounded_changes(pool: PgPool) {
    let app = app(pool.clone()).await;
    create_order(&pool, "ord-1", "REF-1", 100, "eur").await;
    let d = payment("evt_dl", "ord-1", "REF-1", 100, "eur");
    app.post("stripe", d.headers, &d.body).await;
    sqlx::query(
        "WITH q AS (DELETE FROM event_queue RETURNING tenant_id, external_id), \
              e AS (UPDATE webhook_events SET status = 'dead_lettered', attempts = 8 WHERE external_id = 'evt_dl' RETURNING *) \
         INSERT INTO dead_letters (tenant_id, external_id, source_id, event_type, payload, headers, error, reason, attempts) \
         SELECT tenant_id, external_id, source_id, event_type, payload, headers, 'retryable: upstream timeout', 'exhausted', attempts FROM e",
    )
    .execute(&pool)
    .await
    .unwrap();
    let id: i64 = sqlx::query_scalar("SELECT dead_letter_id FROM dead_letters")
        .fetch_one(&pool)
        .await
        .unwrap();
    let registry = EffectRegistry::standard();
    let invoke = |json: serde_json::Value| {
        let mut context = Context::default();
        context.request_id = "8f5e2c1a-request".into();
        context.invoked_function_arn =
            "arn:aws:lambda:us-east-1:123456789012:function:webhooks-operator".into();
        operator::handler(LambdaEvent::new(json, context), &pool, &registry, None)
    };

    let refused = |json: serde_json::Value| async move {
        let error = invoke(json).await.unwrap_err();
        assert_eq!(error.error_type, "BadRequest", "{}", error.error_message);
        error.error_message
    };
    let everything = refused(
        serde_json::json!({"action": "replay", "filter": {}, "actor": "alice", "reason": "fixed"}),
    )
    .await;
    assert!(everything.contains(r#""all": true"#), "{everything}");
    let resend = refused(
        serde_json::json!({"action": "resend_outbox", "actor": "alice", "reason": "fixed"}),
    )
    .await;
    assert!(resend.contains(r#""all": true"#), "{resend}");
    let anonymous = refused(
        serde_json::json!({"action": "replay", "filter": {"ids": [id]}, "reason": "fixed"}),
    )
    .await;
    assert!(anonymous.contains("actor"), "{anonymous}");
    let unexplained = refused(serde_json::json!({"action": "set_dead_letter_status", "dead_letter_id": id, "status": "discarded", "actor": "alice"})).await;
    assert!(unexplained.contains("reason"), "{unexplained}");
    let blank = refused(serde_json::json!({"action": "discard_outbox", "outbox_ids": [1], "actor": " ", "reason": "x"})).await;
    assert!(blank.contains("actor"), "{blank}");
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM dead_letters WHERE status = 'new'"
        )
        .await,
        1
    );

    let shown = serde_json::to_value(
        invoke(serde_json::json!({"action": "show_dead_letter", "dead_letter_id": id}))
            .await
            .unwrap(),
    )
    .unwrap();
    let stored: serde_json::Value = sqlx::query_scalar("SELECT headers FROM dead_letters")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(stored["stripe-signature"].is_string(), "{stored}");
    assert!(
        shown["dead_letter"]["headers"]
            .get("stripe-signature")
            .is_none(),
        "{shown}"
    );
    assert_eq!(
        shown["dead_letter"]["withheld_headers"],
        serde_json::json!(["stripe-signature"])
    );

    let replayed = serde_json::to_value(
        invoke(serde_json::json!({"action": "replay", "filter": {"ids": [id]}, "actor": "alice", "reason": "upstream fixed"}))
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(replayed["replayed"], 1);
    let (action, actor, reason, via, invocation, affected): (
        String,
        String,
        String,
        String,
        serde_json::Value,
        serde_json::Value,
    ) = sqlx::query_as(
        "SELECT action, actor, reason, via, invocation, affected FROM operator_actions",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (
            action.as_str(),
            actor.as_str(),
            reason.as_str(),
            via.as_str()
        ),
        ("replay", "alice", "upstream fixed", "function")
    );
    assert_eq!(affected, serde_json::json!([id]));
    assert_eq!(invocation["request_id"], "8f5e2c1a-request");
    assert_eq!(
        invocation["invoked_function_arn"],
        "arn:aws:lambda:us-east-1:123456789012:function:webhooks-operator"
    );
}

#[test]
fn the_reconcile_function_tells_its_triggers_apart() {
    let schedule = serde_json::json!({
        "version": "0", "id": "1", "detail-type": "Scheduled Event", "source": "aws.events", "account": "123456789012",
        "time": "2026-11-30T12:00:00Z", "region": "us-east-1", "resources": [], "detail": {}
    });
    assert_eq!(reconcile::trigger_of(&schedule).unwrap(), "schedule");
    let alarm_message =
        serde_json::json!({"AlarmName": "webhooks-oldest-pending-age", "NewStateValue": "ALARM"})
            .to_string();
    let sns = serde_json::json!({"Records": [{
        "EventSource": "aws:sns", "EventVersion": "1.0", "EventSubscriptionArn": "arn:aws:sns:us-east-1:123456789012:alarms:1",
        "Sns": {"Type": "Notification", "MessageId": "m1", "TopicArn": "arn:aws:sns:us-east-1:123456789012:alarms",
                "Subject": "ALARM", "Message": alarm_message, "Timestamp": "2026-11-30T12:00:00.000Z",
                "SignatureVersion": "1", "Signature": "x", "SigningCertUrl": "https://x", "UnsubscribeUrl": "https://x",
                "MessageAttributes": {}}
    }]});
    assert_eq!(
        reconcile::trigger_of(&sns).unwrap(),
        "alarm:webhooks-oldest-pending-age"
    );
    let junk = reconcile::trigger_of(&serde_json::json!({"hello": 1})).unwrap_err();
    assert_eq!(junk.error_type, "UnrecognisedTrigger");
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_reconcile_function_runs_a_pass_and_records_its_trigger(pool: PgPool) {
    let drainer = standard_drainer(&pool);
    let payload = serde_json::json!({
        "version": "0", "id": "1", "detail-type": "Scheduled Event", "source": "aws.events", "account": "123456789012",
        "time": "2026-11-30T12:00:00Z", "region": "us-east-1", "resources": [], "detail": {}
    });
    let outcome = reconcile::handler(
        LambdaEvent::new(payload, Context::default()),
        &pool,
        &drainer,
        &Default::default(),
    )
    .await
    .unwrap();
    assert!(
        matches!(
            outcome,
            shared::reconcile::ReconcileOutcome::Completed { .. }
        ),
        "{outcome:?}"
    );
    let trigger: String = sqlx::query_scalar("SELECT trigger FROM maintenance_runs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(trigger, "schedule");
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_anomaly_function_runs_the_checks_and_reports_them(pool: PgPool) {
    app(pool.clone()).await;
    let report = ::anomaly::handler(
        scheduled(Duration::from_secs(60)),
        &pool,
        &Default::default(),
        None,
    )
    .await
    .unwrap();
    assert!(report.checks >= 30, "{report:?}");
    let (job, trigger, status): (String, String, String) =
        sqlx::query_as("SELECT job, trigger, status FROM maintenance_runs WHERE run_id = $1")
            .bind(report.run_id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (job.as_str(), trigger.as_str(), status.as_str()),
        ("anomaly", "schedule", "completed")
    );
}

/// A setting of the session, in milliseconds (`SHOW` answers `8s`, `500ms`, `2min`, or `0`).
async fn session_ms(pool: &PgPool, setting: &str) -> u64 {
    let shown: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {setting}")))
        .fetch_one(pool)
        .await
        .unwrap();
    let (number, unit) = shown.split_at(
        shown
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(shown.len()),
    );
    let n: u64 = number.parse().unwrap();
    n * match unit {
        "" | "ms" => 1,
        "s" => 1000,
        "min" => 60_000,
        "h" => 3_600_000,
        other => panic!("unit {other:?} of {setting} = {shown}"),
    }
}

/// Every function's sessions end a runaway statement, a lock wait and an abandoned transaction
/// before the function's own deadline (`FUNCTION_TIMEOUT_SECONDS`, its Lambda timeout), so a
/// frozen or half-open session never holds the locks other drainers wait on.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn function_sessions_time_out_below_the_function_deadline(pool: PgPool) {
    use pipeline_tests::lambda::{url_of, vars};
    let url = url_of(&pool);
    for timeout in ["10", "55", "300"] {
        let function = vars(&[
            ("DATABASE_URL", &url),
            ("FUNCTION_TIMEOUT_SECONDS", timeout),
        ]);
        let function_pool = function.vars.pool().await.unwrap();
        let deadline_ms: u64 = timeout.parse::<u64>().unwrap() * 1000;
        let statement = session_ms(&function_pool, "statement_timeout").await;
        let lock = session_ms(&function_pool, "lock_timeout").await;
        let idle = session_ms(&function_pool, "idle_in_transaction_session_timeout").await;
        for (name, value) in [
            ("statement_timeout", statement),
            ("lock_timeout", lock),
            ("idle_in_transaction_session_timeout", idle),
        ] {
            assert!(
                value > 0 && value < deadline_ms,
                "{timeout} s function: {name} = {value} ms"
            );
        }
        assert!(
            lock <= statement,
            "lock_timeout {lock} > statement_timeout {statement}"
        );
    }

    // A session left idle in a transaction is ended by the server, its locks released.
    let function = vars(&[("DATABASE_URL", &url), ("FUNCTION_TIMEOUT_SECONDS", "2")]);
    let function_pool = function.vars.pool().await.unwrap();
    let mut conn = function_pool.acquire().await.unwrap();
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    sqlx::query("SELECT 1 FROM pg_class LIMIT 1 FOR SHARE")
        .execute(&mut *conn)
        .await
        .ok();
    let give_up = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let alive: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
                .bind(pid)
                .fetch_one(&pool)
                .await
                .unwrap();
        if !alive {
            break;
        }
        assert!(
            std::time::Instant::now() < give_up,
            "the session idle in a transaction was not ended"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        sqlx::query("SELECT 1").execute(&mut *conn).await.is_err(),
        "the abandoned session still answers"
    );
}
