//! The hourly delivery figures behind the anomaly checks, kept incrementally
//! (`shared::store::delivery_hours`, issue 26): the rollup holds what the materialized view
//! `delivery_hourly` holds for the same data, from the first run; the rest of the 29 days is
//! filled a bounded step per run; a late event (buffered, filed days later with its received
//! time) is counted in its old hour, and source flow sees it; hours past 29 days are removed; a
//! previous build's run makes the older hours computed again.

use std::collections::BTreeMap;

use pipeline_tests::*;
use serde_json::json;
use shared::anomaly::{self, AnomalySettings};
use shared::buffer::filing::{self, Filed, Message};
use shared::domain::Scheme;
use shared::sources;
use shared::store::anomaly::source_flow;
use shared::store::delivery_hours::{self, FILL_HOURS_PER_RUN};
use shared::store::webhook_events::{self, DeliveryOutcome, NewEvent};
use shared::store::{dead_letters, event_queue};
use sqlx::PgPool;

/// (source, hour as text) → (events, redeliveries, conflicts, backfilled, retried, provider retries)
type Figures = BTreeMap<(String, String), [i64; 6]>;

/// Of `inner`'s rows (source_id, hour and the six figures), every figure of the hours since a
/// day ago, and `events` of every hour of the 29 days after the first (which the view holds
/// only in part): what the checks can read.
async fn figures(pool: &PgPool, inner: &str) -> (Figures, Figures) {
    type Row = (String, String, bool, bool, i64, i64, i64, i64, i64, i64);
    let rows: Vec<Row> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT t.source_id, t.hour::text, t.hour >= now() - interval '1 day', \
                t.hour >= date_trunc('hour', now() - interval '29 days') + interval '1 hour', \
                t.events::int8, t.redeliveries::int8, t.conflicts::int8, t.backfilled::int8, \
                t.retried::int8, t.provider_retries::int8 \
         FROM ({inner}) AS t"
    )))
    .fetch_all(pool)
    .await
    .unwrap();
    let mut day = Figures::new();
    let mut events = Figures::new();
    for (source, hour, in_day, in_days, a, b, c, d, e, f) in rows {
        if in_day {
            day.insert((source.clone(), hour.clone()), [a, b, c, d, e, f]);
        }
        if in_days {
            events.insert((source, hour), [a, 0, 0, 0, 0, 0]);
        }
    }
    (day, events)
}

/// What the checks can read from the rollup.
async fn rollup(pool: &PgPool) -> (Figures, Figures) {
    figures(pool, "SELECT * FROM delivery_hours").await
}

/// The same, from the view `delivery_hourly`, refreshed now, as a previous build reads it.
async fn view(pool: &PgPool) -> (Figures, Figures) {
    sqlx::query("REFRESH MATERIALIZED VIEW delivery_hourly")
        .execute(pool)
        .await
        .unwrap();
    figures(pool, "SELECT * FROM delivery_hourly").await
}

/// The same, aggregated from webhook_events now.
async fn truth(pool: &PgPool) -> (Figures, Figures) {
    figures(
        pool,
        "SELECT source_id, date_trunc('hour', first_received_at) AS hour, count(*) AS events, \
                sum(delivery_count - 1) AS redeliveries, sum(conflict_count) AS conflicts, \
                count(*) FILTER (WHERE verified_with = 'provider_api') AS backfilled, \
                count(*) FILTER (WHERE attempts > 1) AS retried, sum(provider_retries) AS provider_retries \
         FROM webhook_events GROUP BY 1, 2",
    )
    .await
}

/// Sources created 40 days ago, and 31 days of events of `stripe` and `github`: one every 17
/// minutes each, some delivered again, some conflicting, retried, backfilled or provider
/// retries, the last day's among them.
async fn history(pool: &PgPool) {
    sources::apply(pool, &sources_for_every_scheme())
        .await
        .unwrap();
    sqlx::query("UPDATE sources SET created_at = now() - interval '40 days'")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, payload_sha256, verified_with, \
             received_at, first_received_at, last_seen_at, status, processed_at, delivery_count, conflict_count, \
             attempts, provider_retries) \
         SELECT $1, src || '-h-' || i, src, 'ping', sha256(convert_to(src || i, 'UTF8')), \
                CASE WHEN i % 11 = 0 THEN 'provider_api' ELSE 'current' END, t, t, t, 'processed', t, \
                1 + (i % 5 = 0)::int, (i % 13 = 0)::int, 1 + (i % 7 = 0)::int, (i % 9 = 0)::int \
         FROM unnest(ARRAY['stripe', 'github']) AS src, generate_series(1, 31 * 24 * 60 / 17) AS i, \
              LATERAL (SELECT now() - interval '31 days' + interval '17 minutes' * i \
                       + CASE WHEN src = 'github' THEN interval '3 minutes' ELSE interval '0' END AS t) AS at",
    )
    .bind(TENANT)
    .execute(pool)
    .await
    .unwrap();
}

/// Runs the rollup until no hour of the 29 days is missing; returns the runs it took.
async fn fill(pool: &PgPool) -> usize {
    for run in 1..=40 {
        if delivery_hours::roll(pool).await.unwrap().missing == 0 {
            return run;
        }
    }
    panic!("the rollup was not filled in 40 runs");
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_first_run_reads_what_the_view_holds_and_the_rest_fills_a_day_a_run(pool: PgPool) {
    history(&pool).await;
    let (view_day, view_events) = view(&pool).await;
    // Two sources, each with every hour of the last day but perhaps the current one, which has
    // no event yet in its first quarter hour (the fixture's newest events are 15 and 12 minutes old).
    assert!(view_day.len() >= 2 * 23, "{}", view_day.len());

    // The first run after deploy: the last day's figures, and the hours source flow compares
    // the last complete one with, are complete.
    let report = anomaly::run_once(&pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();
    let (day, events) = rollup(&pool).await;
    assert_eq!(day, view_day);
    let flow = source_flow(&pool).await.unwrap();
    let stripe = flow.iter().find(|f| f.source_id == "stripe").unwrap();
    assert_eq!(stripe.weeks, 4);
    assert!(stripe.mean.unwrap() >= 3.0, "{stripe:?}");
    // The same numbers the view gives the same statement.
    let judged: Vec<(String, f64, f64)> = sqlx::query_as(
        "SELECT s.source_id, COALESCE(c.events, 0)::float8, \
                (SELECT avg(COALESCE(d.events, 0))::float8 FROM generate_series(1, 4) AS w \
                 LEFT JOIN delivery_hourly AS d ON d.source_id = s.source_id \
                  AND d.hour = date_trunc('hour', now()) - interval '1 hour' - make_interval(weeks => w)) \
         FROM sources AS s LEFT JOIN delivery_hourly AS c ON c.source_id = s.source_id \
          AND c.hour = date_trunc('hour', now()) - interval '1 hour' WHERE s.enabled ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let ours: Vec<(String, f64, f64)> = flow
        .iter()
        .map(|f| (f.source_id.clone(), f.last_hour, f.mean.unwrap_or(0.0)))
        .collect();
    assert_eq!(ours, judged);
    let rates: Vec<(String, Option<f64>)> = sqlx::query_as(
        "SELECT check_name, value FROM anomaly_results WHERE run_id = $1 AND check_name LIKE '%rate_last_day' \
         ORDER BY check_name",
    )
    .bind(report.run_id)
    .fetch_all(&pool)
    .await
    .unwrap();
    let from_view: Vec<(String, Option<f64>)> = sqlx::query_as(
        "SELECT n, v FROM (SELECT \
            sum(backfilled)::float8 / NULLIF(sum(events), 0) AS backfill_rate_last_day, \
            sum(conflicts)::float8 / NULLIF(sum(events), 0) AS conflict_rate_last_day, \
            sum(redeliveries)::float8 / NULLIF(sum(events), 0) AS duplicate_rate_last_day, \
            sum(provider_retries)::float8 / NULLIF(sum(events), 0) AS provider_retry_rate_last_day, \
            sum(retried)::float8 / NULLIF(sum(events), 0) AS retry_rate_last_day \
          FROM delivery_hourly WHERE hour >= now() - interval '1 day') AS r, \
         LATERAL (VALUES ('backfill_rate_last_day', backfill_rate_last_day), \
                         ('conflict_rate_last_day', conflict_rate_last_day), \
                         ('duplicate_rate_last_day', duplicate_rate_last_day), \
                         ('provider_retry_rate_last_day', provider_retry_rate_last_day), \
                         ('retry_rate_last_day', retry_rate_last_day)) AS x(n, v) ORDER BY n",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rates.len(), 5);
    assert!(
        rates.iter().all(|(_, v)| v.is_some_and(|v| v > 0.0)),
        "{rates:?}"
    );
    assert_eq!(rates, from_view);
    // Not the 29 days yet: the older hours come a day per run.
    assert!(
        events.len() < view_events.len() / 2,
        "{} of {}",
        events.len(),
        view_events.len()
    );

    // Each further run computes the last day again and at most FILL_HOURS_PER_RUN others.
    let mut missing = u64::MAX;
    let mut runs = 1;
    loop {
        let rolled = delivery_hours::roll(&pool).await.unwrap();
        assert!(
            rolled.hours <= 26 + 8 + FILL_HOURS_PER_RUN as u64,
            "{rolled:?}"
        );
        assert!(rolled.missing < missing, "{rolled:?}");
        missing = rolled.missing;
        runs += 1;
        if missing == 0 {
            break;
        }
        assert!(runs < 40, "{rolled:?}");
    }
    // 28 days before the last: 672 hours, 24 a run.
    assert!((25..=30).contains(&runs), "{runs}");
    assert_eq!(rollup(&pool).await, view(&pool).await);
    assert_eq!(rollup(&pool).await, truth(&pool).await);

    // Filled, a run computes only the hours with events received since the margin before
    // their last computation: the hour (or two) of the fixture's newest events, 12 and 15
    // minutes old. Nothing of the rest of the last day is read again.
    let recent: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM delivery_hours_computed AS c WHERE EXISTS (SELECT 1 FROM webhook_events AS e \
             WHERE e.first_received_at >= greatest(c.hour, c.computed_at - make_interval(secs => $1::int)) \
               AND e.first_received_at < c.hour + interval '1 hour')",
    )
    .bind(delivery_hours::NEW_EVENTS_MARGIN_SECONDS)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!((1..=2).contains(&recent), "{recent}");
    let steady = delivery_hours::roll(&pool).await.unwrap();
    assert_eq!(steady.hours, recent as u64, "{steady:?}");
    assert_eq!(steady.missing, 0);
    assert_eq!(rollup(&pool).await, truth(&pool).await);
    // Nothing of the events older than 29 days (the history starts 31 days ago).
    let old: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM delivery_hours WHERE hour < date_trunc('hour', now() - interval '29 days')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(old, 0);
}

/// The buffer's consumer files `id`, received at `received_at` (seconds since the epoch).
async fn file_late(pool: &PgPool, id: &str, received_at: i64) {
    file_delivery_late(pool, id, id, received_at).await
}

/// The same for event `id` delivered as `delivery_id` (the buffer files each delivery once).
async fn file_delivery_late(pool: &PgPool, id: &str, delivery_id: &str, received_at: i64) {
    let d = delivery(
        Scheme::Stripe,
        &secret_of(Scheme::Stripe),
        id,
        now(),
        json!({}),
    );
    let message = Message {
        message_id: format!("m-{delivery_id}"),
        delivery: Ok(buffered(
            &source("stripe", TENANT, Scheme::Stripe, "secret/stripe"),
            &d.headers,
            &d.body,
            delivery_id,
            received_at * 1_000_000,
        )),
    };
    let filed = filing::file_batch(pool, &[message]).await.unwrap();
    assert!(matches!(filed[..], [Filed::Stored(_)]), "{filed:?}");
}

/// Hours marked for the rollup's next run.
async fn marks_waiting(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM delivery_hours_dirty")
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn stripe_events_at(pool: &PgPool, hour: i64) -> i64 {
    sqlx::query_scalar(
        "SELECT COALESCE((SELECT events FROM delivery_hours WHERE source_id = 'stripe' \
                          AND hour = to_timestamp($1)), 0)",
    )
    .bind(hour as f64)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Waits out the last minute of an hour, so that a test which reads "the current hour" more
/// than once reads one hour throughout.
async fn away_from_the_turn_of_the_hour() {
    let into_hour = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        % 3600;
    if into_hour >= 3540 {
        tokio::time::sleep(std::time::Duration::from_secs(3600 - into_hour + 1)).await;
    }
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_late_event_filed_days_later_is_counted_in_its_old_hour_and_source_flow_sees_it(
    pool: PgPool,
) {
    // The test places events by the current hour and judges the last complete one: started
    // in the seconds before an hour turns, the two are an hour apart (it failed so at 20:00).
    away_from_the_turn_of_the_hour().await;
    // Created 22 days ago: three weeks of history. 20 stripe events at this hour of the week
    // in each of the three weeks before, 20 in the last complete hour.
    sources::apply(&pool, &sources_for_every_scheme())
        .await
        .unwrap();
    sqlx::query("UPDATE sources SET created_at = now() - interval '22 days'")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, payload_sha256, verified_with, \
             received_at, first_received_at, last_seen_at, status, processed_at) \
         SELECT $1, 'stripe-w' || w || '-' || n, 'stripe', 'ping', sha256(convert_to(w || '-' || n, 'UTF8')), 'current', t, t, t, 'processed', t \
         FROM generate_series(0, 3) AS w, generate_series(1, 20) AS n, \
              LATERAL (SELECT date_trunc('hour', now()) - interval '1 hour' - make_interval(weeks => w) + interval '10 minutes' AS t) AS at",
    )
    .bind(TENANT)
    .execute(&pool)
    .await
    .unwrap();
    fill(&pool).await;
    let judged: i64 = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM date_trunc('hour', now()) - interval '1 hour')::int8",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let two_weeks_before = judged - 14 * 24 * 3600;
    let ten_days_ago = judged - 10 * 24 * 3600;
    assert_eq!(stripe_events_at(&pool, two_weeks_before).await, 20);
    let before = &source_flow(&pool).await.unwrap();
    let before = before.iter().find(|f| f.source_id == "stripe").unwrap();
    assert_eq!(
        (before.mean, before.stddev, before.weeks),
        (Some(20.0), Some(0.0), 3)
    );

    // The buffer held two deliveries through an outage; the consumer files them days later
    // with the times ingest received them: two weeks before the judged hour, and ten days ago.
    file_late(&pool, "evt_late_1", two_weeks_before + 25 * 60).await;
    file_late(&pool, "evt_late_2", ten_days_ago + 5 * 60).await;
    assert_eq!(marks_waiting(&pool).await, 2);
    // Both hours were final: until the next run, the rollup still has them as they were.
    assert_eq!(stripe_events_at(&pool, two_weeks_before).await, 20);
    assert_eq!(stripe_events_at(&pool, ten_days_ago).await, 0);

    let report = anomaly::run_once(&pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();
    assert_eq!(stripe_events_at(&pool, two_weeks_before).await, 21);
    assert_eq!(stripe_events_at(&pool, ten_days_ago).await, 1);
    assert_eq!(marks_waiting(&pool).await, 0);
    let detail: String = sqlx::query_scalar(
        "SELECT detail FROM anomaly_results WHERE run_id = $1 AND check_name = 'source_spike' AND subject = 'stripe'",
    )
    .bind(report.run_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(detail, "last hour 20 vs 20.3 ± 0.6 over 3 weeks");
    assert_eq!(rollup(&pool).await, truth(&pool).await);
    assert_eq!(rollup(&pool).await, view(&pool).await);

    // A delivery received within MARK_AFTER_SECONDS marks nothing: its hour has events
    // received since the margin before its last computation, and is computed again for them.
    file_late(&pool, "evt_recent", now() - 60).await;
    assert_eq!(marks_waiting(&pool).await, 0);
    delivery_hours::roll(&pool).await.unwrap();
    assert_eq!(rollup(&pool).await, truth(&pool).await);
    // One received 20 minutes ago is marked: the rollup may have computed its hour for good.
    file_late(&pool, "evt_older", now() - 20 * 60).await;
    assert_eq!(marks_waiting(&pool).await, 1);
    delivery_hours::roll(&pool).await.unwrap();
    assert_eq!(rollup(&pool).await, truth(&pool).await);
}

/// Pending events received `hours_ago`, each with its queue row, tried `attempts` times before.
async fn pending_events(pool: &PgPool, ids: &[&str], hours_ago: i32, attempts: i32) {
    sqlx::query(
        "WITH e AS (INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, payload, payload_sha256, \
             verified_with, received_at, first_received_at, last_seen_at, status, attempts) \
         SELECT $1, id, 'stripe', 'ping', '{}', sha256(convert_to(id, 'UTF8')), 'current', t, t, t, 'pending', $4 \
         FROM unnest($2::text[]) AS id, LATERAL (SELECT now() - make_interval(hours => $3) AS t) AS at \
         RETURNING tenant_id, external_id, first_received_at) \
         INSERT INTO event_queue (tenant_id, external_id, ready_at, enqueued_at) \
         SELECT tenant_id, external_id, first_received_at, first_received_at FROM e",
    )
    .bind(TENANT)
    .bind(ids)
    .bind(hours_ago)
    .bind(attempts)
    .execute(pool)
    .await
    .unwrap();
}

/// Filled, the rollup computes again only the hours whose figures changed (issue 26), and
/// counts each change, whichever writer made it: a redelivery of an older event through ingest,
/// a retry and the completion after it through the drain's statements, a dead-lettering that
/// takes `attempts` to 2. Before each run the rollup differs from the events (so the change is
/// one the rollup has to see); after it, they agree, and the run computed the changed hour and
/// at most the hours of the newest events.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_rollup_computes_again_only_the_hours_that_changed_and_counts_every_change(
    pool: PgPool,
) {
    history(&pool).await;
    pending_events(&pool, &["retried-later"], 3, 0).await;
    pending_events(&pool, &["buried"], 4, 1).await;
    fill(&pool).await;
    // The fixture's newest events are under 15 minutes old: their hours are computed again
    // while they are within the margin. Every run below computes at most those and one more.
    let newest = 2;
    let steady = delivery_hours::roll(&pool).await.unwrap();
    assert!(steady.hours <= newest, "{steady:?}");
    assert_eq!(rollup(&pool).await, truth(&pool).await);

    let ran = |what: &'static str, marks: u64| {
        let pool = pool.clone();
        async move {
            assert_ne!(
                rollup(&pool).await,
                truth(&pool).await,
                "{what}: not yet counted"
            );
            let rolled = delivery_hours::roll(&pool).await.unwrap();
            assert_eq!(rolled.marks, marks, "{what}: {rolled:?}");
            assert!(rolled.hours <= newest + 1, "{what}: {rolled:?}");
            assert_eq!(rollup(&pool).await, truth(&pool).await, "{what}");
        }
    };

    // A redelivery of a 5-hour-old event, with another body: a conflict.
    let outcome = redeliver_with_another_body(&pool, "github", "5 hours").await;
    assert_eq!(outcome, DeliveryOutcome::Conflict);
    ran("the redelivery", 1).await;

    // A first failure: attempts 0 to 1, not yet retried in the figures. The run after it
    // marks the hour of the event waiting for its next try.
    let tenants = vec![TENANT.to_owned()];
    let retried = event_queue::retry_later(
        &pool,
        &tenants,
        &["retried-later".to_owned()],
        &[0],
        &["try again".to_owned()],
    )
    .await
    .unwrap();
    assert_eq!(retried, 1);
    delivery_hours::roll(&pool).await.unwrap();
    assert_eq!(rollup(&pool).await, truth(&pool).await);
    // Its completion takes attempts to 2 in the drain's complete, which marks nothing: the
    // mark the last run left for it makes the next run count it.
    let completed =
        event_queue::complete(&pool, &tenants, &["retried-later".to_owned()], &["nothing"])
            .await
            .unwrap();
    assert_eq!(completed, 1);
    ran("the completion after a retry", 1).await;

    // Dead-lettered after its second try: attempts 1 to 2.
    let buried = dead_letters::bury(
        &pool,
        &tenants,
        &["buried".to_owned()],
        &["refused".to_owned()],
        &["fatal"],
    )
    .await
    .unwrap();
    assert_eq!(buried, 1);
    ran("the dead-lettering", 1).await;

    // The buffer's consumer files a delivery received 3 hours ago (marked as late), then the
    // same event again, received 2 hours ago: the second repeats a stored event of 3 hours ago
    // (marked by the batch statement) and is late itself (marked by the consumer).
    file_late(&pool, "filed-twice", now() - 3 * 3600).await;
    ran("a late filing", 1).await;
    file_delivery_late(&pool, "filed-twice", "filed-twice-again", now() - 2 * 3600).await;
    ran("a late filing of a stored event", 2).await;
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn hours_past_29_days_are_removed_as_time_goes_by(pool: PgPool) {
    history(&pool).await;
    fill(&pool).await;
    // Three days go by without a run (the anomaly function was down): the hours that were the
    // last day's when it last ran were computed before they ended, and are computed again.
    age(&pool, "3 days").await;
    let past: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM delivery_hours WHERE hour < date_trunc('hour', now() - interval '29 days')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(past >= 2 * 2 * 24, "{past}");
    let rolled = delivery_hours::roll(&pool).await.unwrap();
    assert_eq!(rolled.forgotten, 0, "{rolled:?}");
    for table in ["delivery_hours", "delivery_hours_computed"] {
        let past: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {table} WHERE hour < date_trunc('hour', now() - interval '29 days')"
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(past, 0, "{table}");
    }
    fill(&pool).await;
    assert_eq!(rollup(&pool).await, truth(&pool).await);
    assert_eq!(rollup(&pool).await, view(&pool).await);
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_run_of_a_previous_build_makes_the_older_hours_computed_again(pool: PgPool) {
    history(&pool).await;
    fill(&pool).await;
    // Rolled back: the previous build's consumer files an event received a week and a half ago
    // without marking it, and its anomaly run refreshes the view.
    sqlx::query(
        "INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, payload_sha256, verified_with, \
             received_at, first_received_at, last_seen_at, status, processed_at) \
         SELECT $1, 'old-build', 'stripe', 'ping', sha256('old-build'), 'current', t, t, t, 'processed', t \
         FROM (SELECT now() - interval '10 days 5 hours' AS t) AS at",
    )
    .bind(TENANT)
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("REFRESH MATERIALIZED VIEW CONCURRENTLY delivery_hourly")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO view_refreshes (view_name, refreshed_at) VALUES ('delivery_hourly', now()) \
         ON CONFLICT (view_name) DO UPDATE SET refreshed_at = EXCLUDED.refreshed_at",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_ne!(rollup(&pool).await, truth(&pool).await);

    // Rolled forward: the first run forgets every hour older than the last day.
    let rolled = delivery_hours::roll(&pool).await.unwrap();
    assert!(rolled.forgotten >= 27 * 24, "{rolled:?}");
    assert!(rolled.missing > 0, "{rolled:?}");
    fill(&pool).await;
    assert_eq!(rollup(&pool).await, truth(&pool).await);
    // And once it has run, it is this build's refresh again: nothing is forgotten.
    assert_eq!(delivery_hours::roll(&pool).await.unwrap().forgotten, 0);
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn identities_purged_within_the_29_days_leave_their_hours(pool: PgPool) {
    history(&pool).await;
    fill(&pool).await;
    // Identities kept 5 days: retention deletes the events of the 24 days before (and older).
    let settings = shared::retention::RetentionSettings {
        identity_after: std::time::Duration::from_secs(5 * 24 * 3600),
        payload_after: std::time::Duration::from_secs(24 * 3600),
        ..Default::default()
    };
    shared::retention::run_once(&pool, &settings, "test")
        .await
        .unwrap();
    let kept: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_events WHERE first_received_at < now() - interval '5 days 1 hour'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(kept, 0);
    let marked: i64 = sqlx::query_scalar("SELECT count(DISTINCT hour) FROM delivery_hours_dirty")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(marked >= 23 * 24, "{marked}");
    assert_ne!(rollup(&pool).await, truth(&pool).await);

    fill(&pool).await;
    assert_eq!(rollup(&pool).await, truth(&pool).await);
    assert_eq!(rollup(&pool).await, view(&pool).await);
}

/// A clock moved by less than an hour (the drill ages every timestamp by its cycle) leaves the
/// rollup's rows off the hour: the hours computed again replace whatever lies within them, so
/// no event is counted twice.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn time_moved_by_part_of_an_hour_counts_no_event_twice(pool: PgPool) {
    history(&pool).await;
    fill(&pool).await;
    for _ in 0..3 {
        age(&pool, "25 minutes").await;
        delivery_hours::roll(&pool).await.unwrap();
        assert_eq!(rollup(&pool).await.0, truth(&pool).await.0);
    }
    fill(&pool).await;
    assert_eq!(rollup(&pool).await, truth(&pool).await);
}

/// Per source, `hookctl status`'s events, duplicates and conflicts of the last day, beside the
/// same figures aggregated from `webhook_events` now; read again should an hour begin between
/// the two (the day starts at the hour a day ago).
async fn status_beside_the_events(
    pool: &PgPool,
) -> (Vec<(String, [i64; 3])>, Vec<(String, [i64; 3])>) {
    loop {
        let hour = || async {
            sqlx::query_scalar::<_, String>("SELECT date_trunc('hour', now())::text")
                .fetch_one(pool)
                .await
                .unwrap()
        };
        let before = hour().await;
        let report = shared::status::report(pool, &Default::default())
            .await
            .unwrap();
        let truth: Vec<(String, i64, i64, i64)> = sqlx::query_as(
            "SELECT s.source_id, count(e.source_id), COALESCE(sum(e.delivery_count - 1), 0)::int8, \
                    COALESCE(sum(e.conflict_count), 0)::int8 \
             FROM sources AS s LEFT JOIN webhook_events AS e ON e.source_id = s.source_id \
              AND e.first_received_at >= date_trunc('hour', now() - interval '1 day') \
             GROUP BY s.source_id ORDER BY s.source_id",
        )
        .fetch_all(pool)
        .await
        .unwrap();
        if hour().await != before {
            continue;
        }
        let status = report
            .sources
            .iter()
            .map(|s| {
                let a = &s.activity;
                (
                    a.source_id.clone(),
                    [
                        a.events_last_day,
                        a.duplicates_last_day,
                        a.conflicts_last_day,
                    ],
                )
            })
            .collect();
        let truth = truth
            .into_iter()
            .map(|(s, a, b, c)| (s, [a, b, c]))
            .collect();
        return (status, truth);
    }
}

/// The newest event of `source` received more than `older_than` ago, delivered again with
/// another body through ingest's statement; what ingest made of it.
async fn redeliver_with_another_body(
    pool: &PgPool,
    source: &str,
    older_than: &str,
) -> DeliveryOutcome {
    let (external_id, event_type): (String, String) = sqlx::query_as(
        "SELECT external_id, event_type FROM webhook_events \
         WHERE source_id = $1 AND first_received_at < now() - $2::interval \
         ORDER BY first_received_at DESC LIMIT 1",
    )
    .bind(source)
    .bind(older_than)
    .fetch_one(pool)
    .await
    .unwrap();
    let event = NewEvent {
        tenant_id: TENANT,
        external_id: &external_id,
        source_id: source,
        event_type: &event_type,
        entity_id: None,
        entity_version: None,
        version_tiebreak: None,
        sequence: None,
        payload: b"{\"another\":\"body\"}",
        payload_sha256: [7; 32],
        headers: json!({}),
        verified_with: "current",
        provider_retries: 0,
        id_outside_signature: false,
        signed_digest: None,
        verified_layout: None,
    };
    webhook_events::upsert(pool, &event).await.unwrap().outcome
}

/// `hookctl status` reads the last day's figures from the rollup where it has computed the hour
/// and from `webhook_events` where it has not (issue 26): before any run, once filled, events
/// received since the last run, and a redelivery of an older event once the rollup has run again.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn status_counts_the_last_day_as_the_events_hold_before_and_after_the_rollup_runs(
    pool: PgPool,
) {
    history(&pool).await;
    let (status, truth) = status_beside_the_events(&pool).await;
    assert!(
        truth.iter().any(|(_, f)| f[0] > 50 && f[1] > 0 && f[2] > 0),
        "{truth:?}"
    );
    assert_eq!(status, truth, "before the rollup's first run");

    fill(&pool).await;
    let (status, truth) = status_beside_the_events(&pool).await;
    assert_eq!(status, truth, "the rollup filled");

    // Since the last run: five new stripe events, and an older event delivered again with
    // another payload.
    sqlx::query(
        "INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, payload_sha256, verified_with, \
             received_at, first_received_at, last_seen_at, status, processed_at) \
         SELECT $1, 'stripe-new-' || i, 'stripe', 'ping', sha256(convert_to('new' || i, 'UTF8')), 'current', \
                now(), now(), now(), 'processed', now() FROM generate_series(1, 5) AS i",
    )
    .bind(TENANT)
    .execute(&pool)
    .await
    .unwrap();
    let redelivered = redeliver_with_another_body(&pool, "github", "5 hours").await;
    assert_eq!(redelivered, DeliveryOutcome::Conflict);
    let (status, truth) = status_beside_the_events(&pool).await;
    let events =
        |v: &[(String, [i64; 3])]| v.iter().map(|(s, f)| (s.clone(), f[0])).collect::<Vec<_>>();
    assert_eq!(
        events(&status),
        events(&truth),
        "events received since the last run"
    );

    delivery_hours::roll(&pool).await.unwrap();
    let (status, truth) = status_beside_the_events(&pool).await;
    assert_eq!(status, truth, "the redelivery, once the rollup ran again");
}

// Ingest's two statements write the rollup's MARK_AFTER_SECONDS as an interval literal (the
// pgbench scripts run the same text with the same parameters), and the functions' longest
// writer that marks by age (the buffer's consumer: 30 s in template.yaml) stays well inside the
// rollup's margin for new events. Checked when this file compiles.
const _: () = {
    assert!(delivery_hours::MARK_AFTER_SECONDS == 5 * 60);
    assert!(
        delivery_hours::MARK_AFTER_SECONDS + 5 * 60 <= delivery_hours::NEW_EVENTS_MARGIN_SECONDS
    );
};

/// Ingest's two statements mark a repeated event older than the rollup's `MARK_AFTER_SECONDS`.
#[test]
fn ingest_marks_repeated_events_after_the_rollups_own_interval() {
    for sql in [
        webhook_events::upsert_sql(),
        webhook_events::upsert_batch_sql(),
    ] {
        assert!(
            sql.contains(
                "INSERT INTO delivery_hours_dirty (source_id, hour, rereads_changes)\n    SELECT"
            ) && sql.contains("AND j.first_received_at < now() - interval '5 minutes'"),
            "{sql}"
        );
    }
}

/// The marks that make the anomaly rollup compute an hour again are one per (source, hour),
/// not one per delivery: while the anomaly pass is down, a provider redelivering one old event
/// a hundred times, or the buffer filing a hundred late deliveries of one hour, adds one mark,
/// so the table grows with hours and sources, not with traffic.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn repeated_deliveries_of_an_old_hour_leave_one_mark(pool: PgPool) {
    let app = TestApp::new(
        pool.clone(),
        &sources_for_every_scheme(),
        secrets_for_every_scheme(),
    )
    .await;
    let d = delivery(
        Scheme::Stripe,
        &secret_of(Scheme::Stripe),
        "evt_redelivered_often",
        now(),
        json!({}),
    );
    assert_eq!(
        app.post("stripe", d.headers.clone(), &d.body)
            .await
            .outcome(),
        "accepted"
    );
    age(&pool, "2 hours").await;
    for _ in 0..100 {
        let reply = app.post("stripe", d.headers.clone(), &d.body).await;
        assert_eq!(reply.outcome(), "duplicate");
    }
    // And late buffered deliveries of one hour, filed in several batches.
    let received = shared::ingest::unix_now_micros() - 3 * 3600 * 1_000_000;
    for batch in 0..5 {
        let messages: Vec<Message> = (0..20)
            .map(|i| {
                let e = delivery(
                    Scheme::Stripe,
                    &secret_of(Scheme::Stripe),
                    &format!("evt_late_{batch}_{i}"),
                    now(),
                    json!({}),
                );
                let source = sources_for_every_scheme().remove(0);
                Message {
                    message_id: format!("m-{batch}-{i}"),
                    delivery: Ok(buffered(
                        &source,
                        &e.headers,
                        &e.body,
                        &format!("late-{batch}-{i}"),
                        received,
                    )),
                }
            })
            .collect();
        let filed = filing::file_batch(&pool, &messages).await.unwrap();
        assert!(filed.iter().all(|f| matches!(f, Filed::Stored(_))));
    }
    let marks: Vec<(String, i64)> = sqlx::query_as(
        "SELECT source_id, count(*) FROM delivery_hours_dirty GROUP BY source_id, hour ORDER BY 1, 2",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        marks,
        vec![("stripe".to_owned(), 1), ("stripe".to_owned(), 1)],
        "one mark per hour"
    );
}

/// A delivery the buffer files late, into an hour the anomaly pass already rolled up, is
/// counted by `status` at once: an hour with a mark is counted from its events, not from its
/// rollup, until the next pass computes it again (before, it was missing from the day's
/// figures until then).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn status_counts_a_late_filing_before_the_next_rollup(pool: PgPool) {
    let app = TestApp::new(
        pool.clone(),
        &sources_for_every_scheme(),
        secrets_for_every_scheme(),
    )
    .await;
    let first = delivery(
        Scheme::Stripe,
        &secret_of(Scheme::Stripe),
        "evt_on_time",
        now(),
        json!({}),
    );
    assert_eq!(
        app.post("stripe", first.headers, &first.body)
            .await
            .outcome(),
        "accepted"
    );
    age(&pool, "3 hours").await;
    anomaly::run_once(&pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();
    let day = |pool: PgPool| async move {
        webhook_events::activity_by_source(&pool)
            .await
            .unwrap()
            .into_iter()
            .find(|a| a.source_id == "stripe")
            .unwrap()
            .events_last_day
    };
    assert_eq!(day(pool.clone()).await, 1);

    let late = delivery(
        Scheme::Stripe,
        &secret_of(Scheme::Stripe),
        "evt_filed_late",
        now(),
        json!({}),
    );
    let source = sources_for_every_scheme().remove(0);
    let received: i64 = sqlx::query_scalar(
        "SELECT (EXTRACT(EPOCH FROM first_received_at) * 1000000)::int8 FROM webhook_events",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let filed = filing::file_batch(
        &pool,
        &[Message {
            message_id: "m-late".into(),
            delivery: Ok(buffered(
                &source,
                &late.headers,
                &late.body,
                "late",
                received,
            )),
        }],
    )
    .await
    .unwrap();
    assert!(matches!(&filed[0], Filed::Stored(u) if u.outcome == DeliveryOutcome::Accepted));
    assert_eq!(day(pool.clone()).await, 2, "counted before the next rollup");
    anomaly::run_once(&pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();
    assert_eq!(day(pool.clone()).await, 2, "and after it");
}
