//! Retention at a steady rate (issue 26, point 4): a run takes everything past its horizons,
//! however many batches that is, as long as its time allows; each statement stays one bounded
//! batch.

use std::time::{Duration, Instant};

use pipeline_tests::drain::scalar;
use shared::retention::RetentionSettings;
use sqlx::PgPool;

/// Batches of ten: the old cap of a run (`max_batches` 20) was 200 identities and 200 payloads,
/// as the defaults' 5000 x 20 was 100 000 a run, 2.4 M a day at the hourly schedule.
fn small_batches() -> RetentionSettings {
    RetentionSettings {
        batch_size: 10,
        ..Default::default()
    }
}

async fn source(pool: &PgPool) {
    sqlx::query(
        "INSERT INTO sources (source_id, tenant_id, scheme, secret_ref, external_id_from, event_type_from) \
         VALUES ('steady', 'acme', 'stripe', 'steady', 'json:/id', 'json:/type')",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// `count` processed events named `<prefix>-<n>`, the first received `age` ago and one a second
/// after it, each with a 1 KiB payload or none (purged already, or never copied: a held replay).
async fn processed(pool: &PgPool, prefix: &str, count: i64, age: &str, payload: bool) {
    sqlx::query(
        "INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, payload, payload_sha256, \
             verified_with, received_at, first_received_at, last_seen_at, status, attempts, processed_at, expects) \
         SELECT 'acme', $1 || '-' || i, 'steady', 'thing.updated', \
                CASE WHEN $4 THEN convert_to(repeat(md5($1 || i), 32), 'UTF8') END, \
                sha256(convert_to($1 || i, 'UTF8')), 'current', t, t, t, 'processed', 1, t, 'nothing' \
         FROM (SELECT i, now() - $3::interval + make_interval(secs => i) AS t \
               FROM generate_series(1, $2) AS i) AS g",
    )
    .bind(prefix)
    .bind(count)
    .bind(age)
    .bind(payload)
    .execute(pool)
    .await
    .unwrap();
}

/// More events past each horizon than one run could take under the old cap: one run, with
/// time to spare, takes them all (retention at 100 events/s needs 360 000 a run of each).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn one_run_purges_everything_past_its_horizons_however_many_batches_it_takes(pool: PgPool) {
    source(&pool).await;
    // 450 events past the identity horizon (30 days) that still have their payloads (retention
    // fell behind on both), 350 past the payload horizon (7 days) only, 50 of the last hour.
    processed(&pool, "old", 450, "40 days", true).await;
    processed(&pool, "week", 350, "10 days", true).await;
    processed(&pool, "fresh", 50, "1 hour", true).await;

    let run = shared::retention::run_once(&pool, &small_batches(), "test")
        .await
        .unwrap();

    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM webhook_events WHERE first_received_at < now() - interval '30 days'"
        )
        .await,
        0,
        "every event past the identity horizon is purged: {run:?}"
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM webhook_events WHERE payload IS NOT NULL \
             AND first_received_at < now() - interval '7 days'"
        )
        .await,
        0,
        "every payload past the payload horizon is purged: {run:?}"
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM webhook_events WHERE external_id LIKE 'week-%' OR external_id LIKE 'fresh-%'"
        )
        .await,
        400,
        "the events within the identity horizon are kept"
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM webhook_events WHERE external_id LIKE 'fresh-%' AND payload IS NOT NULL"
        )
        .await,
        50,
        "the last hour's payloads are kept"
    );
    assert_eq!(run.identities_purged, 450, "{run:?}");
    assert!(
        (350..=800).contains(&run.payloads_purged),
        "the 350 of the week, and those of the 450 older the identity purge had not reached yet: {run:?}"
    );
}

/// A run whose time is up starts no batch: it says which purges it cut short (in its outcome
/// and its run row, completed), and the next run goes on from there.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_run_out_of_time_starts_no_batch_and_the_next_goes_on(pool: PgPool) {
    source(&pool).await;
    processed(&pool, "old", 450, "40 days", false).await;

    let late = shared::retention::run_until(&pool, &small_batches(), "test", Instant::now())
        .await
        .unwrap();
    assert_eq!(
        (late.payloads_purged, late.identities_purged),
        (0, 0),
        "{late:?}"
    );
    assert!(late.cut_short.contains(&"identities"), "{late:?}");
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM webhook_events").await,
        450
    );
    let (status, cut_short): (String, serde_json::Value) = sqlx::query_as(
        "SELECT status, found->'cut_short' FROM maintenance_runs WHERE job = 'retention'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(status, "completed");
    assert!(
        cut_short
            .as_array()
            .is_some_and(|a| a.contains(&"identities".into())),
        "{cut_short}"
    );

    let next = shared::retention::run_until(
        &pool,
        &small_batches(),
        "test",
        Instant::now() + Duration::from_secs(60),
    )
    .await
    .unwrap();
    assert_eq!(next.identities_purged, 450, "{next:?}");
    assert!(next.cut_short.is_empty(), "{next:?}");
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM webhook_events").await,
        0
    );
}

/// The payload purge walks events in the order they arrived, from where its last batch
/// stopped: a batch in which it clears nothing (events without a payload to clear: held
/// replays, whose bytes are never copied) is not the end of the events past the horizon.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_batch_with_no_payload_to_clear_does_not_end_the_payload_purge(pool: PgPool) {
    source(&pool).await;
    processed(&pool, "held", 20, "10 days", false).await;
    processed(&pool, "kept", 30, "9 days", true).await;

    let run = shared::retention::run_once(&pool, &small_batches(), "test")
        .await
        .unwrap();

    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM webhook_events WHERE payload IS NOT NULL"
        )
        .await,
        0,
        "the payloads after the 20 without one are purged in the same run: {run:?}"
    );
    assert_eq!(run.payloads_purged, 30, "{run:?}");
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM webhook_events").await,
        50,
        "no identity is past its horizon"
    );
}

/// `count` processed events with payloads, all first received at one instant ten days ago.
async fn burst(pool: &PgPool, count: i64) {
    processed(pool, "burst", count, "10 days", true).await;
    sqlx::query(
        "UPDATE webhook_events SET received_at = now() - interval '10 days', \
         first_received_at = now() - interval '10 days', last_seen_at = now() - interval '10 days' \
         WHERE external_id LIKE 'burst-%'",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// One retention run in batches of 10, with 20 s to spare.
async fn run_with_time_to_spare(pool: &PgPool) -> shared::retention::RetentionOutcome {
    shared::retention::run_until(
        pool,
        &small_batches(),
        "test",
        Instant::now() + Duration::from_secs(20),
    )
    .await
    .unwrap()
}

/// More events received at one instant than a batch: the run walks past them (the payload
/// cursor names the last event examined at its instant), never the same batch again until its
/// time is up.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn events_received_at_one_instant_do_not_hold_the_run_to_its_deadline(pool: PgPool) {
    source(&pool).await;
    burst(&pool, 25).await;

    let run = run_with_time_to_spare(&pool).await;

    assert!(run.cut_short.is_empty(), "{run:?}");
    assert!(run.payloads_purged >= 10, "{run:?}");
}

/// More events received at one instant than a batch, past the payload horizon: one run clears
/// every one of their payloads, and the events after that instant too. A cursor that names only
/// an instant stands at it, and left them to the identity purge (30 days, not 7).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn every_payload_of_an_instant_busier_than_a_batch_is_purged(pool: PgPool) {
    source(&pool).await;
    burst(&pool, 25).await;
    processed(&pool, "after", 5, "9 days", true).await;

    let run = run_with_time_to_spare(&pool).await;

    let kept: Vec<String> = sqlx::query_scalar(
        "SELECT external_id FROM webhook_events WHERE payload IS NOT NULL ORDER BY external_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(kept, Vec::<String>::new(), "{run:?}");
    assert_eq!(run.payloads_purged, 30, "{run:?}");
    assert!(run.cut_short.is_empty(), "{run:?}");
}

/// A payload cursor a previous build moved (its `through` alone, the last event's columns left
/// from another instant) is read as that build reads it: every event at its instant is examined
/// again, none skipped.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_cursor_a_previous_build_moved_skips_no_event_at_its_instant(pool: PgPool) {
    source(&pool).await;
    burst(&pool, 5).await;
    sqlx::query(
        "INSERT INTO retention_cursors (name, through, after_at, after_tenant_id, after_external_id) \
         SELECT 'payloads', first_received_at, first_received_at - interval '1 day', 'zzz', 'zzz' \
         FROM webhook_events LIMIT 1",
    )
    .execute(&pool)
    .await
    .unwrap();

    let run = run_with_time_to_spare(&pool).await;

    assert_eq!(run.payloads_purged, 5, "{run:?}");
}

/// The drain records its latencies in `processing_completions`, a row per batch, and the
/// anomaly pass forgets them after two hours. With the anomaly function stopped (disabled,
/// failing) the table would grow a row a batch until it ran again, about 3 600 an hour at 100
/// events/s: retention forgets them too, in its bounded batches, and keeps the last two hours'.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn latency_records_past_two_hours_are_purged_without_the_anomaly_pass(pool: PgPool) {
    // 25 records of the three days the anomaly pass did not run, 3 of the last hour.
    sqlx::query(
        "INSERT INTO processing_completions (completed_at, seconds) \
         SELECT now() - interval '3 hours' - make_interval(hours => i), ARRAY[0.2, 0.3]::float8[] \
         FROM generate_series(0, 24) AS i \
         UNION ALL \
         SELECT now() - make_interval(mins => 10 * i), ARRAY[0.1]::float8[] FROM generate_series(1, 3) AS i",
    )
    .execute(&pool)
    .await
    .unwrap();

    let run = run_with_time_to_spare(&pool).await;

    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM processing_completions WHERE completed_at < now() - interval '2 hours'"
        )
        .await,
        0,
        "every record past two hours is purged, in batches of 10: {run:?}"
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processing_completions").await,
        3,
        "the last hour's records are kept: {run:?}"
    );
    assert_eq!(run.latency_records_purged, 25, "{run:?}");
    assert!(run.cut_short.is_empty(), "{run:?}");
}

/// Day 60: what an event's page says of its filing (the layout that verified it, the
/// deliveries the buffer filed) goes with its identity, and stays for the events kept.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_events_filing_is_purged_with_its_identity(pool: PgPool) {
    source(&pool).await;
    processed(&pool, "old", 3, "40 days", false).await;
    processed(&pool, "fresh", 2, "1 hour", true).await;
    sqlx::query(
        "INSERT INTO event_filings (tenant_id, external_id, verified_layout, buffered_deliveries) \
         SELECT tenant_id, external_id, 'v3', 1 FROM webhook_events",
    )
    .execute(&pool)
    .await
    .unwrap();

    let run = shared::retention::run_once(&pool, &small_batches(), "test")
        .await
        .unwrap();
    assert_eq!(run.identities_purged, 3, "{run:?}");
    let kept: Vec<String> =
        sqlx::query_scalar("SELECT external_id FROM event_filings ORDER BY external_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(kept, ["fresh-1", "fresh-2"]);
}

/// What only describes the past goes once it is older than the history horizon (90 days):
/// maintenance runs started, and operator jobs and replays to a subscription finished, before
/// it (their operator actions keep what they did). A job or a replay still running stays
/// whatever its age, and so does everything younger.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn finished_jobs_and_runs_past_the_history_horizon_are_purged_and_running_ones_stay(
    pool: PgPool,
) {
    sqlx::query(
        "INSERT INTO maintenance_runs (job, trigger, status, started_at, finished_at) VALUES \
         ('reconcile', 'schedule', 'completed', now() - interval '100 days', now() - interval '100 days'), \
         ('reconcile', 'schedule', 'completed', now() - interval '10 days', now() - interval '10 days')",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO operator_jobs (kind, filter, actor, reason, action_id, estimate, status, \
             created_at, updated_at, finished_at) \
         SELECT kind, '{}', 'ops@example.com', reason, 1, 0, status, \
                now() - created, now() - created, now() - finished \
         FROM (VALUES ('replay_dead_letters', 'old, finished', 'finished', interval '100 days', interval '100 days'), \
                      ('discard_dead_letters', 'old, aborted', 'aborted', interval '100 days', interval '99 days'), \
                      ('replay_dead_letters', 'recent', 'finished', interval '10 days', interval '10 days'), \
                      ('replay_dead_letters', 'old, running', 'running', interval '100 days', NULL)) \
              AS j(kind, reason, status, created, finished)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO subscription_replays (tenant_id, name, since, until, rate, status, actor, \
             reason, started_at, updated_at, finished_at) \
         SELECT 'acme', 'crm', now() - interval '200 days', now() - interval '150 days', 10, status, \
                'ops@example.com', reason, now() - started, now() - started, now() - finished \
         FROM (VALUES ('old, finished', 'finished', interval '100 days', interval '100 days'), \
                      ('recent', 'finished', interval '10 days', interval '10 days'), \
                      ('old, running', 'running', interval '100 days', NULL::interval)) \
              AS r(reason, status, started, finished)",
    )
    .execute(&pool)
    .await
    .unwrap();

    let outcome = run_with_time_to_spare(&pool).await;

    let runs: Vec<String> = sqlx::query_scalar(
        "SELECT to_char(now() - started_at, 'DD') FROM maintenance_runs \
         WHERE job = 'reconcile' ORDER BY started_at",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        runs,
        ["10"],
        "the run of 100 days ago is gone, the recent one stays"
    );
    let jobs: Vec<String> = sqlx::query_scalar("SELECT reason FROM operator_jobs ORDER BY job_id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(jobs, ["recent", "old, running"]);
    let replays: Vec<String> =
        sqlx::query_scalar("SELECT reason FROM subscription_replays ORDER BY replay_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(replays, ["recent", "old, running"]);
    assert_eq!(
        outcome.history_purged, 4,
        "one run, two operator jobs and one replay past the horizon"
    );
}
