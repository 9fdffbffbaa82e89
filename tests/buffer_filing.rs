//! The buffer's consumer store (`shared::buffer::filing`, `webhook_events::upsert_batch`): a
//! buffered delivery is filed exactly as its direct delivery would have been stored, once.

use std::collections::BTreeMap;

use http::HeaderMap;
use pipeline_tests::*;
use serde_json::json;
use shared::buffer::BufferedDelivery;
use shared::buffer::filing::{self, Filed, Message};
use shared::domain::Scheme;
use shared::sources::{self, Source};
use shared::store::webhook_events::{self, BatchedEvent, DeliveryOutcome, PROVIDER_API};
use sqlx::{Connection, Executor, PgPool};

/// Every scheme's source, and a second Stripe account of the same tenant (`stripe-us`, same
/// secret) for source collisions.
fn all_sources() -> Vec<Source> {
    let mut list = sources_for_every_scheme();
    list.push(source("stripe-us", TENANT, Scheme::Stripe, "secret/stripe"));
    list
}

fn find_source(id: &str) -> Source {
    all_sources()
        .into_iter()
        .find(|s| s.source_id.as_str() == id)
        .unwrap()
}

/// A delivery to the source `source_id` as ingest would buffer it.
fn buffered(
    source_id: &str,
    headers: &HeaderMap,
    body: &[u8],
    delivery_id: &str,
    received_at_micros: i64,
) -> BufferedDelivery {
    pipeline_tests::buffered(
        &find_source(source_id),
        headers,
        body,
        delivery_id,
        received_at_micros,
    )
}

fn message(d: BufferedDelivery) -> Message {
    Message {
        message_id: format!("m-{}", d.envelope.delivery_id),
        delivery: Ok(d),
    }
}

/// `n` Stripe events `<id_prefix>_<i>` and their buffered messages, delivery ids
/// `<delivery_prefix><i>`, received now.
fn stripe_messages(
    id_prefix: &str,
    delivery_prefix: &str,
    n: usize,
) -> (Vec<Delivery>, Vec<Message>) {
    let list: Vec<Delivery> = (0..n)
        .map(|i| stripe(&format!("{id_prefix}_{i}"), json!({})))
        .collect();
    let messages = list
        .iter()
        .enumerate()
        .map(|(i, d)| {
            message(buffered(
                "stripe",
                &d.headers,
                &d.body,
                &format!("{delivery_prefix}{i}"),
                micros_now(),
            ))
        })
        .collect();
    (list, messages)
}

fn micros_now() -> i64 {
    shared::ingest::unix_now_micros()
}

/// A fresh, migrated database beside the test's own; dropped by [`drop_database`].
async fn second_database(tag: &str) -> (PgPool, String) {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL is not set: run scripts/test");
    let admin: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let name = format!("buffer_{tag}_{}_{}", std::process::id(), micros_now());
    let mut conn = sqlx::PgConnection::connect_with(&admin).await.unwrap();
    conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .await
        .unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(admin.clone().database(&name))
        .await
        .unwrap();
    shared::store::MIGRATOR.run(&pool).await.unwrap();
    sources::apply(&pool, &all_sources()).await.unwrap();
    (pool, name)
}

async fn drop_database(pool: PgPool, name: &str) {
    pool.close().await;
    let url = std::env::var("DATABASE_URL").unwrap();
    let admin: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let mut conn = sqlx::PgConnection::connect_with(&admin).await.unwrap();
    let _ = conn
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )))
        .await;
}

/// Every row of the tables the upsert writes, without timestamps and generated ids, sorted.
async fn snapshot(pool: &PgPool) -> BTreeMap<&'static str, Vec<String>> {
    let mut all = BTreeMap::new();
    for table in [
        "webhook_events",
        "ingest_anomalies",
        "event_queue",
        "signed_bodies",
    ] {
        let skip: Vec<String> = sqlx::query_scalar(
            "SELECT column_name::text FROM information_schema.columns \
             WHERE table_schema = 'public' AND table_name = $1 \
               AND (data_type LIKE 'timestamp%' OR is_identity = 'YES' \
                    OR column_default LIKE 'nextval%')",
        )
        .bind(table)
        .fetch_all(pool)
        .await
        .unwrap();
        let rows: Vec<serde_json::Value> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT to_jsonb(t) FROM {table} AS t"
        )))
        .fetch_all(pool)
        .await
        .unwrap();
        let mut rows: Vec<String> = rows
            .into_iter()
            .map(|mut r| {
                let o = r.as_object_mut().unwrap();
                for k in &skip {
                    o.remove(k);
                }
                r.to_string()
            })
            .collect();
        rows.sort();
        all.insert(table, rows);
    }
    all
}

/// One step of a script: deliveries (one batch when filed all at once), or a change both
/// databases take the same way.
enum Step {
    Deliver(Vec<(&'static str, Delivery)>),
    Sql(&'static str),
    /// A copy fetched from the provider's API by backfill, stored as backfill stores it.
    ApiCopy(Delivery),
}

fn stripe(id: &str, extra: serde_json::Value) -> Delivery {
    delivery(Scheme::Stripe, &secret_of(Scheme::Stripe), id, now(), extra)
}

fn github(id: &str, issue: i64) -> Delivery {
    delivery(
        Scheme::Github,
        &secret_of(Scheme::Github),
        id,
        now(),
        json!({"issue": {"number": issue}}),
    )
}

fn slack(id: &str, retry: Option<&str>) -> Delivery {
    let mut d = delivery(
        Scheme::Slack,
        &secret_of(Scheme::Slack),
        id,
        now(),
        json!({}),
    );
    if let Some(n) = retry {
        set(&mut d.headers, "x-slack-retry-num", n);
    }
    d
}

fn copy(d: &Delivery) -> Delivery {
    Delivery {
        headers: d.headers.clone(),
        body: d.body.clone(),
    }
}

/// Every outcome the direct path knows, and repeats of each anomaly.
fn script() -> Vec<Step> {
    let gh_body = github("gh-1", 1);
    let gh_replay_new_id = resign(
        Scheme::Github,
        &secret_of(Scheme::Github),
        "gh-2",
        now(),
        {
            let mut h = gh_body.headers.clone();
            set(&mut h, "x-github-delivery", "gh-2");
            h
        },
        gh_body.body.clone(),
    );
    let gh_3 = github("gh-3", 3);
    let gh_replay_stored_id = resign(
        Scheme::Github,
        &secret_of(Scheme::Github),
        "gh-3",
        now(),
        gh_3.headers.clone(),
        gh_body.body.clone(),
    );
    let gh_conflict_unsigned = github("gh-1", 99);
    vec![
        Step::ApiCopy(stripe("evt_api", json!({"pending_webhooks": 0}))),
        Step::Deliver(vec![
            ("stripe", stripe("evt_1", json!({}))),
            ("stripe", stripe("evt_1", json!({}))),
            ("stripe", stripe("evt_2", json!({"amount": 100}))),
            ("stripe", stripe("evt_2", json!({"amount": 5}))),
            ("stripe", stripe("evt_3", json!({"amount": 1}))),
            ("github", copy(&gh_body)),
            ("github", copy(&gh_replay_new_id)),
            ("github", copy(&gh_3)),
            ("github", copy(&gh_replay_stored_id)),
            ("stripe-us", stripe("evt_1", json!({}))),
            ("stripe-us", stripe("evt_2", json!({"amount": 7}))),
            ("github", copy(&gh_conflict_unsigned)),
            ("slack", slack("Ev1", None)),
            ("slack", slack("Ev1", Some("1"))),
            ("stripe", stripe("evt_api", json!({"pending_webhooks": 1}))),
        ]),
        Step::Sql(
            "UPDATE webhook_events SET status = 'processed', processed_at = now() \
             WHERE external_id = 'evt_3'",
        ),
        Step::Deliver(vec![
            ("stripe", stripe("evt_3", json!({"amount": 2}))),
            ("stripe", stripe("evt_3", json!({"amount": 2}))),
            ("stripe", stripe("evt_2", json!({"amount": 5}))),
            ("stripe", stripe("evt_2", json!({"amount": 8}))),
            ("github", copy(&gh_replay_new_id)),
            ("github", copy(&gh_replay_stored_id)),
            ("github", copy(&gh_conflict_unsigned)),
            ("stripe-us", stripe("evt_1", json!({}))),
            ("stripe", stripe("evt_4", json!({}))),
        ]),
    ]
}

async fn store_api_copy(pool: &PgPool, d: &Delivery) {
    let source = find_source("stripe");
    let prepared =
        shared::ingest::prepare(&source, &d.headers, &d.body, &|_| false, micros_now()).unwrap();
    let events = prepared.events(&source, &d.body, PROVIDER_API, None, None);
    webhook_events::upsert(pool, &events[0]).await.unwrap();
}

/// Runs the script directly into `a` and buffered into `b` (each delivery its own batch, or
/// each step's deliveries one batch); returns the outcomes each path gave.
async fn run_both(a: &TestApp, b: &PgPool, one_per_batch: bool) -> (Vec<String>, Vec<String>) {
    let mut direct = Vec::new();
    let mut filed = Vec::new();
    let mut n = 0;
    for step in script() {
        match step {
            Step::Sql(sql) => {
                for pool in [&a.pool, b] {
                    sqlx::query(sql).execute(pool).await.unwrap();
                }
            }
            Step::ApiCopy(d) => {
                store_api_copy(&a.pool, &d).await;
                store_api_copy(b, &d).await;
            }
            Step::Deliver(list) => {
                let mut batch = Vec::new();
                for (source_id, d) in &list {
                    let reply = a.post(source_id, d.headers.clone(), &d.body).await;
                    assert_eq!(reply.status, 200, "{source_id}: {:?}", reply.json);
                    direct.push(reply.outcome().to_owned());
                    n += 1;
                    batch.push(message(buffered(
                        source_id,
                        &d.headers,
                        &d.body,
                        &format!("d{n}"),
                        micros_now(),
                    )));
                }
                let chunks: Vec<&[Message]> = if one_per_batch {
                    batch.chunks(1).collect()
                } else {
                    vec![&batch[..]]
                };
                for chunk in chunks {
                    for f in filing::file_batch(b, chunk).await.unwrap() {
                        match f {
                            Filed::Stored(u) => filed.push(u.outcome.as_str().to_owned()),
                            other => panic!("not stored: {other:?}"),
                        }
                    }
                }
            }
        }
    }
    (direct, filed)
}

async fn differential(pool: PgPool, one_per_batch: bool) {
    let a = TestApp::new(pool, &all_sources(), secrets_for_every_scheme()).await;
    let (b, name) = second_database(if one_per_batch { "one" } else { "all" }).await;

    let (direct, filed) = run_both(&a, &b, one_per_batch).await;

    assert_eq!(
        direct, filed,
        "the outcomes each delivery was answered with"
    );
    for expected in ["accepted", "duplicate", "conflict"] {
        assert!(direct.iter().any(|o| o == expected), "{expected} covered");
    }
    let (sa, sb) = (snapshot(&a.pool).await, snapshot(&b).await);
    let kinds: Vec<&str> = ["digest_conflict", "replayed_body", "source_collision"].into();
    for kind in kinds {
        assert!(
            sa["ingest_anomalies"].iter().any(|r| r.contains(kind)),
            "{kind} covered"
        );
    }
    assert!(
        sa["ingest_anomalies"]
            .iter()
            .any(|r| r.contains("\"seen_count\":2")),
        "a repeated anomaly is counted: {:#?}",
        sa["ingest_anomalies"]
    );
    for table in sa.keys() {
        assert_eq!(sa[table], sb[table], "{table}: direct (left) vs buffered");
    }
    // Every row the buffer filed says so, counting no more deliveries than the row has; the
    // direct path's rows came through no buffer.
    let counted = async |pool: &PgPool| {
        sqlx::query_as::<_, (i64, i64, i64)>(
            "SELECT count(*), count(f.buffered_deliveries) FILTER (WHERE f.buffered_deliveries > 0), \
                    count(*) FILTER (WHERE f.buffered_deliveries > e.delivery_count) \
             FROM webhook_events AS e LEFT JOIN event_filings AS f USING (tenant_id, external_id)",
        )
        .fetch_one(pool)
        .await
    };
    let (rows, buffered, too_many) = counted(&b).await.unwrap();
    assert_eq!((buffered, too_many), (rows, 0), "buffered rows");
    let (_, buffered, _) = counted(&a.pool).await.unwrap();
    assert_eq!(buffered, 0, "direct rows");
    drop_database(b, &name).await;
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn every_outcome_filed_one_per_batch_equals_the_direct_path(pool: PgPool) {
    differential(pool, true).await;
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn every_outcome_filed_in_one_batch_equals_the_direct_path(pool: PgPool) {
    differential(pool, false).await;
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn repeated_keys_in_one_batch_give_the_sequential_result(pool: PgPool) {
    sources::apply(&pool, &all_sources()).await.unwrap();
    let (sequential, name) = second_database("seq").await;
    let list = [
        stripe("evt_r", json!({"amount": 1})),
        stripe("evt_r", json!({"amount": 1})),
        stripe("evt_r", json!({"amount": 2})),
        stripe("evt_r", json!({"amount": 1})),
        stripe("evt_s", json!({})),
    ];
    let messages: Vec<Message> = list
        .iter()
        .enumerate()
        .map(|(i, d)| {
            message(buffered(
                "stripe",
                &d.headers,
                &d.body,
                &format!("r{i}"),
                micros_now(),
            ))
        })
        .collect();

    let batch = filing::file_batch(&pool, &messages).await.unwrap();
    let mut one_by_one = Vec::new();
    for m in messages.chunks(1) {
        one_by_one.extend(filing::file_batch(&sequential, m).await.unwrap());
    }

    assert_eq!(batch, one_by_one);
    let outcomes: Vec<&str> = batch
        .iter()
        .map(|f| match f {
            Filed::Stored(u) => u.outcome.as_str(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        outcomes,
        ["accepted", "duplicate", "conflict", "conflict", "accepted"]
    );
    assert_eq!(snapshot(&pool).await, snapshot(&sequential).await);
    let row = event(&pool, TENANT, "evt_r").await.unwrap();
    assert_eq!((row.delivery_count, row.conflict_count), (4, 2));
    drop_database(sequential, &name).await;
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn one_delivery_id_is_filed_once_and_keeps_its_received_time(pool: PgPool) {
    sources::apply(&pool, &all_sources()).await.unwrap();
    let d = stripe("evt_once", json!({}));
    // Buffered ten minutes ago, to the microsecond.
    let received = micros_now() - 600_000_000;
    let m = || message(buffered("stripe", &d.headers, &d.body, "same-id", received));

    let first = filing::file_batch(&pool, &[m()]).await.unwrap();
    let second = filing::file_batch(&pool, &[m()]).await.unwrap();
    let within = filing::file_batch(&pool, &[m(), m()]).await.unwrap();

    assert!(
        matches!(&first[..], [Filed::Stored(u)] if u.outcome == DeliveryOutcome::Accepted),
        "{first:?}"
    );
    assert_eq!(second, [Filed::AlreadyFiled]);
    assert_eq!(within, [Filed::AlreadyFiled, Filed::AlreadyFiled]);
    let t = stripe("evt_twice", json!({}));
    let twice = || message(buffered("stripe", &t.headers, &t.body, "twice", received));
    let both = filing::file_batch(&pool, &[twice(), twice()])
        .await
        .unwrap();
    assert!(
        matches!(&both[..], [Filed::Stored(u), Filed::AlreadyFiled] if u.delivery_count == 1),
        "two copies in one batch: {both:?}"
    );
    let (count, received_at, first_received_at, last_seen_at): (i32, i64, i64, i64) =
        sqlx::query_as(
            "SELECT delivery_count, \
                    (extract(epoch FROM received_at) * 1000000)::bigint, \
                    (extract(epoch FROM first_received_at) * 1000000)::bigint, \
                    (extract(epoch FROM last_seen_at) * 1000000)::bigint \
             FROM webhook_events WHERE external_id = 'evt_once'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 1, "counted once");
    assert_eq!(
        (received_at, first_received_at, last_seen_at),
        (received, received, received),
        "the envelope's time, not the filing's"
    );

    // A later direct delivery moves last_seen_at forward; an older buffered copy (another
    // delivery id) never moves it back.
    let app = TestApp::new(pool.clone(), &all_sources(), secrets_for_every_scheme()).await;
    assert_eq!(
        app.post("stripe", d.headers.clone(), &d.body)
            .await
            .outcome(),
        "duplicate"
    );
    let older = message(buffered(
        "stripe",
        &d.headers,
        &d.body,
        "older-copy",
        received - 1_000_000,
    ));
    filing::file_batch(&pool, &[older]).await.unwrap();
    let (count, stays_later): (i32, bool) = sqlx::query_as(
        "SELECT delivery_count, last_seen_at > now() - interval '1 minute' \
         FROM webhook_events WHERE external_id = 'evt_once'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((count, stays_later), (3, true));
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_buffered_delivery_and_its_direct_retry_are_one_row_either_way(pool: PgPool) {
    let app = TestApp::new(pool.clone(), &all_sources(), secrets_for_every_scheme()).await;
    let buffered_first = stripe("evt_b_then_d", json!({}));
    let direct_first = github("gh-d-then-b", 7);

    let filed = filing::file_batch(
        &pool,
        &[message(buffered(
            "stripe",
            &buffered_first.headers,
            &buffered_first.body,
            "x1",
            micros_now(),
        ))],
    )
    .await
    .unwrap();
    let retried = app
        .post(
            "stripe",
            buffered_first.headers.clone(),
            &buffered_first.body,
        )
        .await;
    let direct = app
        .post("github", direct_first.headers.clone(), &direct_first.body)
        .await;
    let then_filed = filing::file_batch(
        &pool,
        &[message(buffered(
            "github",
            &direct_first.headers,
            &direct_first.body,
            "x2",
            micros_now(),
        ))],
    )
    .await
    .unwrap();

    assert!(
        matches!(&filed[..], [Filed::Stored(u)] if u.outcome == DeliveryOutcome::Accepted),
        "{filed:?}"
    );
    assert_eq!(retried.outcome(), "duplicate");
    assert_eq!(direct.outcome(), "accepted");
    assert!(
        matches!(&then_filed[..], [Filed::Stored(u)] if u.outcome == DeliveryOutcome::Duplicate),
        "{then_filed:?}"
    );
    let rows = events(&pool).await;
    assert_eq!(rows.len(), 2);
    assert!(rows.iter().all(|r| r.delivery_count == 2), "{rows:?}");
    assert_eq!(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM event_queue")
            .fetch_one(&pool)
            .await
            .unwrap(),
        2
    );
    assert!(anomalies(&pool).await.is_empty());
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn filing_and_direct_posts_of_the_same_events_race_to_one_row_each(pool: PgPool) {
    let app = TestApp::new(pool.clone(), &all_sources(), secrets_for_every_scheme()).await;
    let mut list = Vec::new();
    for i in 0..40 {
        list.push(("stripe", stripe(&format!("evt_race_{i}"), json!({}))));
        list.push(("github", github(&format!("gh-race-{i}"), 1000 + i)));
    }
    let messages: Vec<Message> = list
        .iter()
        .enumerate()
        .map(|(i, (s, d))| {
            message(buffered(
                s,
                &d.headers,
                &d.body,
                &format!("race{i}"),
                micros_now(),
            ))
        })
        .collect();

    let (halves, posted) = tokio::join!(
        async {
            let mut out = Vec::new();
            for chunk in messages.chunks(20) {
                out.extend(filing::file_batch(&pool, chunk).await.unwrap());
            }
            out
        },
        async {
            let mut replies = Vec::new();
            for (s, d) in list.iter().rev() {
                replies.push(app.post(s, d.headers.clone(), &d.body).await);
            }
            replies
        }
    );

    assert!(halves.iter().all(|f| matches!(f, Filed::Stored(_))));
    assert!(posted.iter().all(|r| r.status == 200));
    let accepted = halves
        .iter()
        .filter(|f| matches!(f, Filed::Stored(u) if u.outcome == DeliveryOutcome::Accepted))
        .count()
        + posted.iter().filter(|r| r.outcome() == "accepted").count();
    assert_eq!(
        accepted,
        list.len(),
        "each event accepted once, by one path"
    );
    let rows = events(&pool).await;
    assert_eq!(rows.len(), list.len());
    assert!(rows.iter().all(|r| r.delivery_count == 2), "{rows:?}");
    let (queued, distinct): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT (tenant_id, external_id)) FROM event_queue",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((queued, distinct), (list.len() as i64, list.len() as i64));
    assert!(anomalies(&pool).await.is_empty());
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn what_can_never_be_filed_is_an_anomaly_and_what_cannot_now_is_retried(pool: PgPool) {
    let mut list = all_sources();
    sources::apply(&pool, &list).await.unwrap();
    let gone_later = stripe("evt_disabled", json!({}));
    let disabled = buffered(
        "stripe-us",
        &gone_later.headers,
        &gone_later.body,
        "u1",
        micros_now(),
    );
    let not_json = resign(
        Scheme::Stripe,
        &secret_of(Scheme::Stripe),
        "",
        now(),
        HeaderMap::new(),
        b"not json".to_vec(),
    );
    let unreadable = buffered(
        "stripe",
        &not_json.headers,
        &not_json.body,
        "u2",
        micros_now(),
    );
    let mut no_source = buffered("stripe", &gone_later.headers, &gone_later.body, "u3", 0);
    no_source.envelope.source_id = "never-existed".into();
    let undecodable = Message {
        message_id: "m-bad".into(),
        delivery: BufferedDelivery::decode("{", None),
    };
    // Disabled after ingest verified the delivery.
    list.iter_mut()
        .find(|s| s.source_id.as_str() == "stripe-us")
        .unwrap()
        .enabled = false;
    sources::apply(&pool, &list).await.unwrap();

    let messages = [
        message(disabled.clone()),
        message(unreadable.clone()),
        message(no_source),
        undecodable,
    ];
    let filed = filing::file_batch(&pool, &messages).await.unwrap();

    // Admitted before its source was disabled: filed all the same.
    assert!(
        matches!(&filed[0], Filed::Stored(u) if u.outcome == DeliveryOutcome::Accepted),
        "{filed:?}"
    );
    assert!(
        matches!(
            &filed[1],
            Filed::Unfilable {
                kind: "unparseable_payload",
                ..
            }
        ),
        "{filed:?}"
    );
    assert!(matches!(&filed[2], Filed::Retry { .. }), "{filed:?}");
    assert!(matches!(&filed[3], Filed::Retry { .. }), "{filed:?}");
    assert!(!filed[2].is_done() && filed[0].is_done());
    let found = anomalies(&pool).await;
    let seen: Vec<(&str, &str, Option<&[u8]>)> = found
        .iter()
        .map(|a| (a.kind.as_str(), a.source_id.as_str(), a.payload.as_deref()))
        .collect();
    assert_eq!(
        seen,
        [("unparseable_payload", "stripe", Some(&b"not json"[..]))]
    );
    let stored: Vec<String> = events(&pool)
        .await
        .into_iter()
        .map(|e| e.external_id)
        .collect();
    assert_eq!(stored, ["evt_disabled"]);
    let snap = snapshot(&pool).await;
    assert_eq!(snap["event_queue"].len(), 1);
    assert!(snap["signed_bodies"].is_empty());
    let receipts: Vec<String> =
        sqlx::query_scalar("SELECT delivery_id FROM buffer_receipts ORDER BY delivery_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(receipts, ["u1", "u2"], "what is retried is not filed");

    // The queue redelivers the deleted ones only by mistake: nothing is recorded twice.
    let again = filing::file_batch(&pool, &[message(disabled), message(unreadable)])
        .await
        .unwrap();
    assert_eq!(again, [Filed::AlreadyFiled, Filed::AlreadyFiled]);
    assert_eq!(anomalies(&pool).await.len(), 1);

    // The provider got its 200 (`buffered`) and will not send it again: the anomaly checks
    // say the unreadable one was kept, not filed, under the buffer's own check (ingest's 400s
    // have theirs).
    let report = shared::anomaly::run_once(&pool, &Default::default(), "test")
        .await
        .unwrap();
    let breached = |name: &str| report.breaches.iter().any(|b| b == name);
    assert!(
        breached("unfilable_buffered_deliveries_last_day"),
        "{:?}",
        report.breaches
    );
    assert!(
        !breached("unreadable_deliveries_last_hour"),
        "{:?}",
        report.breaches
    );
    let counted: f64 = sqlx::query_scalar(
        "SELECT value FROM anomaly_results WHERE run_id = $1 \
         AND check_name = 'unfilable_buffered_deliveries_last_day'",
    )
    .bind(report.run_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(counted, 1.0);
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_consumer_killed_mid_batch_leaves_nothing_and_the_batch_lands_once(pool: PgPool) {
    let app = TestApp::new(pool.clone(), &all_sources(), secrets_for_every_scheme()).await;
    let source = find_source("stripe");
    let (list, messages) = stripe_messages("evt_kill", "k", 10);

    // What the consumer does, stopped before its commit.
    {
        let mut tx = pool.begin().await.unwrap();
        let ids: Vec<String> = (0..10).map(|i| format!("k{i}")).collect();
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        shared::store::buffer_receipts::claim(&mut *tx, &ids)
            .await
            .unwrap();
        let prepared: Vec<_> = list
            .iter()
            .map(|d| {
                shared::ingest::prepare(&source, &d.headers, &d.body, &|_| false, micros_now())
                    .unwrap()
            })
            .collect();
        let batch: Vec<BatchedEvent<'_>> = prepared
            .iter()
            .zip(&list)
            .map(|(p, d)| BatchedEvent {
                event: p.events(&source, &d.body, "current", None, None)[0].clone(),
                received_at: chrono::Utc::now(),
                buffered: false,
            })
            .collect();
        let stored = webhook_events::upsert_batch(&mut tx, &batch).await.unwrap();
        assert_eq!(stored.len(), 10);
        drop(tx);
    }
    let snap = snapshot(&pool).await;
    assert!(snap.values().all(|rows| rows.is_empty()), "{snap:?}");
    assert_eq!(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM buffer_receipts")
            .fetch_one(&pool)
            .await
            .unwrap(),
        0
    );

    // SQS makes the messages visible again; a direct retry of one arrived meanwhile.
    assert_eq!(
        app.post("stripe", list[3].headers.clone(), &list[3].body)
            .await
            .outcome(),
        "accepted"
    );
    let filed = filing::file_batch(&pool, &messages).await.unwrap();
    let again = filing::file_batch(&pool, &messages).await.unwrap();

    assert_eq!(
        filed
            .iter()
            .filter(|f| matches!(f, Filed::Stored(u) if u.outcome == DeliveryOutcome::Accepted))
            .count(),
        9
    );
    assert!(again.iter().all(|f| *f == Filed::AlreadyFiled));
    let rows = events(&pool).await;
    assert_eq!(rows.len(), 10);
    assert_eq!(
        rows.iter().map(|r| r.delivery_count).sum::<i32>(),
        11,
        "the direct retry and the buffered copy of evt_kill_3"
    );
}

/// A body stored under an unsigned id by the release before `signed_bodies` (no claim for it):
/// the direct path fails on `webhook_events_body_once`, copies the claim in and runs again; the
/// batch statement reaches the same rows in one go.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_body_stored_without_its_claim_is_seen_as_a_replay_by_both_paths(pool: PgPool) {
    let a = TestApp::new(pool, &all_sources(), secrets_for_every_scheme()).await;
    let (b, name) = second_database("legacy").await;
    let legacy = github("gh-legacy", 11);
    let other = github("gh-other", 12);
    let setup = [("github", &legacy), ("github", &other)];
    for (s, d) in setup {
        assert_eq!(
            a.post(s, d.headers.clone(), &d.body).await.outcome(),
            "accepted"
        );
    }
    let setup_messages: Vec<Message> = setup
        .iter()
        .enumerate()
        .map(|(i, (s, d))| {
            message(buffered(
                s,
                &d.headers,
                &d.body,
                &format!("s{i}"),
                micros_now(),
            ))
        })
        .collect();
    filing::file_batch(&b, &setup_messages).await.unwrap();
    for p in [&a.pool, &b] {
        sqlx::query("DELETE FROM signed_bodies")
            .execute(p)
            .await
            .unwrap();
    }
    let with_header = |id: &str| {
        let mut h = legacy.headers.clone();
        set(&mut h, "x-github-delivery", id);
        resign(
            Scheme::Github,
            &secret_of(Scheme::Github),
            id,
            now(),
            h,
            legacy.body.clone(),
        )
    };
    // A new id with the legacy bytes; then the stored gh-other with them.
    let replays = [with_header("gh-new"), with_header("gh-other")];

    let mut direct = Vec::new();
    for d in &replays {
        direct.push(
            a.post("github", d.headers.clone(), &d.body)
                .await
                .outcome()
                .to_owned(),
        );
    }
    let messages: Vec<Message> = replays
        .iter()
        .enumerate()
        .map(|(i, d)| {
            message(buffered(
                "github",
                &d.headers,
                &d.body,
                &format!("l{i}"),
                micros_now(),
            ))
        })
        .collect();
    let filed: Vec<String> = filing::file_batch(&b, &messages)
        .await
        .unwrap()
        .into_iter()
        .map(|f| match f {
            Filed::Stored(u) => u.outcome.as_str().to_owned(),
            other => panic!("{other:?}"),
        })
        .collect();

    assert_eq!(direct, ["duplicate", "conflict"]);
    assert_eq!(filed, direct);
    let (sa, sb) = (snapshot(&a.pool).await, snapshot(&b).await);
    assert!(
        sa["ingest_anomalies"]
            .iter()
            .any(|r| r.contains("\"replay_of\":\"gh-legacy\"")),
        "{:#?}",
        sa["ingest_anomalies"]
    );
    for table in sa.keys() {
        assert_eq!(sa[table], sb[table], "{table}: direct (left) vs buffered");
    }
    drop_database(b, &name).await;
}

/// Day 60: a receipt outlives every copy SQS could still hand out (14 days at most), then
/// retention deletes it; a younger one stays and still refuses its delivery a second time.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn retention_deletes_receipts_past_the_longest_sqs_retention(pool: PgPool) {
    // A copy of a filed delivery can still arrive 28 days after it was buffered: 14 days on the
    // queue and in its dead-letter queue (SQS keeps the first enqueue time there), then a
    // redrive (`hookctl buffer redrive`) sends it back as a new message with 14 days more.
    sqlx::query(
        "INSERT INTO buffer_receipts (delivery_id, filed_at) VALUES \
         ('d-old', now() - interval '30 days'), ('d-redriven', now() - interval '27 days'), \
         ('d-young', now() - interval '13 days')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let outcome = shared::retention::run_once(&pool, &Default::default(), "test")
        .await
        .unwrap();
    assert_eq!(outcome.buffer_receipts_purged, 1);
    let left: Vec<String> =
        sqlx::query_scalar("SELECT delivery_id FROM buffer_receipts ORDER BY delivery_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(left, vec!["d-redriven".to_owned(), "d-young".to_owned()]);
}

/// Two consumers filing batches that hold copies of the same events in opposite orders never
/// fail on each other's locks: each batch takes its keys in one order, and a transaction that
/// still meets a deadlock or a serialization failure is filed again. Before, a deadlock (40P01)
/// failed the whole batch: a hundred deliveries back on the queue after the visibility timeout,
/// a receive spent, and after a long outage a batch on its way to the dead-letter queue.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn batches_holding_the_same_events_in_opposite_orders_never_deadlock(
    pool_options: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let connect_pool = |name: &'static str| {
        let (options, connect) = (pool_options.clone(), connect.clone().application_name(name));
        async move {
            options
                .max_connections(1)
                .connect_with(connect)
                .await
                .unwrap()
        }
    };
    let (one, two) = (
        connect_pool("consumer-1").await,
        connect_pool("consumer-2").await,
    );
    sources::apply(&one, &all_sources()).await.unwrap();
    let (rounds, events) = (200, 25);
    for round in 0..rounds {
        let list: Vec<Delivery> = (0..events)
            .map(|e| stripe(&format!("evt_{round}_{e}"), json!({})))
            .collect();
        let copy = |(e, d): (usize, &Delivery), copy: &str| {
            let id = format!("{round}-{e}-{copy}");
            message(buffered("stripe", &d.headers, &d.body, &id, micros_now()))
        };
        let forward: Vec<Message> = list.iter().enumerate().map(|d| copy(d, "a")).collect();
        let backward: Vec<Message> = list
            .iter()
            .enumerate()
            .rev()
            .map(|d| copy(d, "b"))
            .collect();
        let (a, b) = tokio::join!(
            filing::file_batch(&one, &forward),
            filing::file_batch(&two, &backward)
        );
        let (a, b) = (
            a.unwrap_or_else(|e| panic!("round {round}, first batch: {e}")),
            b.unwrap_or_else(|e| panic!("round {round}, second batch: {e}")),
        );
        assert!(
            a.iter().chain(&b).all(|f| matches!(f, Filed::Stored(_))),
            "round {round}: {a:?} {b:?}"
        );
    }
    let (rows, twice): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE delivery_count = 2) FROM webhook_events",
    )
    .fetch_one(&one)
    .await
    .unwrap();
    let expected = (rounds * events) as i64;
    assert_eq!(
        (rows, twice),
        (expected, expected),
        "each event once, counted twice"
    );
}

/// A batch whose transaction loses a race (a deadlock, 40P01, or a serialization failure, 40001)
/// is filed again in the same call, not returned to the queue: here the database refuses the
/// first two attempts, one of each class, and the call still files the batch once.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_batch_that_loses_a_race_is_filed_again_in_the_same_call(pool: PgPool) {
    sources::apply(&pool, &all_sources()).await.unwrap();
    pool.execute(
        "CREATE SEQUENCE test_races; \
         CREATE FUNCTION test_lose_races() RETURNS trigger LANGUAGE plpgsql AS $$ \
         DECLARE n bigint := nextval('test_races'); BEGIN \
             IF n = 1 THEN RAISE EXCEPTION 'deadlock detected' USING ERRCODE = '40P01'; END IF; \
             IF n = 2 THEN RAISE EXCEPTION 'could not serialize access' USING ERRCODE = '40001'; END IF; \
             RETURN NEW; END $$; \
         CREATE TRIGGER test_lose_races BEFORE INSERT ON webhook_events \
             FOR EACH ROW EXECUTE FUNCTION test_lose_races()",
    )
    .await
    .unwrap();
    let (_, messages) = stripe_messages("evt_race_lost", "lost-", 3);
    let filed = filing::file_batch(&pool, &messages)
        .await
        .expect("filed after losing two races");
    assert!(
        filed
            .iter()
            .all(|f| matches!(f, Filed::Stored(u) if u.outcome == DeliveryOutcome::Accepted)),
        "{filed:?}"
    );
    let (rows, attempts): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM webhook_events), (SELECT last_value FROM test_races)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(rows, 3);
    assert_eq!(
        attempts, 5,
        "two refused attempts, then three rows inserted"
    );
}

/// A delivery filed late (redriven from the dead-letter queue after more than the payload
/// horizon) lands behind the payload purge's cursor, which never walks back: it is listed for
/// the purge in the transaction that files it, and its payload is cleared once it is processed,
/// not kept until its identity goes.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_delivery_filed_behind_the_payload_cursor_has_its_payload_purged(pool: PgPool) {
    sources::apply(&pool, &all_sources()).await.unwrap();
    // Retention has walked the payloads of everything received until 7 days and an hour ago.
    sqlx::query(
        "INSERT INTO retention_cursors (name, through, after_at, after_tenant_id, after_external_id) \
         VALUES ('payloads', now() - interval '7 days 1 hour', now() - interval '7 days 1 hour', 'zz', 'zz')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let late = stripe("evt_redriven_late", json!({}));
    let eight_days_ago = micros_now() - 8 * 86_400 * 1_000_000;
    let filed = filing::file_batch(
        &pool,
        &[message(buffered(
            "stripe",
            &late.headers,
            &late.body,
            "late-1",
            eight_days_ago,
        ))],
    )
    .await
    .unwrap();
    assert!(matches!(&filed[0], Filed::Stored(u) if u.outcome == DeliveryOutcome::Accepted));
    let drainer = pipeline_tests::drain::standard_drainer(&pool);
    pipeline_tests::drain::drain_all(&drainer, &pool, std::time::Duration::from_secs(10)).await;

    shared::retention::run_once(&pool, &Default::default(), "test")
        .await
        .unwrap();
    let row = event(&pool, TENANT, "evt_redriven_late").await.unwrap();
    assert_eq!(row.status, "processed");
    assert!(
        row.payload.is_none(),
        "the payload of an event received 8 days ago is purged (horizon 7 days)"
    );
}
