//! `semantic_duplicates_last_day` counted from the changes the anomaly pass keeps
//! (`shared::store::recent_changes`, issue 26) instead of grouping the last day of
//! `webhook_events` on every run: the check reads the number the grouping reads, on the first
//! run (the whole day), after new events, after a conflicting delivery gives an older pending
//! event another entity version (ingest's statement and the buffer consumer's batch statement),
//! after the buffer files events hours late, and as time takes changes out of the day; and a
//! run reads the events received since the last one, not the day.

use pipeline_tests::*;
use serde_json::json;
use shared::anomaly::{self, AnomalySettings};
use shared::buffer::filing::{self, Filed, Message};
use shared::domain::Scheme;
use shared::sources;
use shared::store::delivery_hours::{self, NEW_EVENTS_MARGIN_SECONDS};
use shared::store::webhook_events::{self, BatchedEvent, DeliveryOutcome, NewEvent};
use sqlx::PgPool;

/// What the check counted before issue 26: changes with two or more events first received in
/// the last day, grouped from `webhook_events`.
const GROUPED: &str = "SELECT count(*)::float8 FROM (SELECT 1 FROM webhook_events \
     WHERE first_received_at > now() - interval '1 day' \
       AND entity_id IS NOT NULL AND entity_version IS NOT NULL \
     GROUP BY tenant_id, source_id, event_type, entity_id, entity_version, version_tiebreak \
     HAVING count(*) > 1) AS same_change";

/// One anomaly pass: what the check stored, beside the grouping over the same events.
async fn counted(pool: &PgPool) -> (f64, f64) {
    let report = anomaly::run_once(pool, &AnomalySettings::default(), "test")
        .await
        .unwrap();
    let check: Option<f64> = sqlx::query_scalar(
        "SELECT value FROM anomaly_results WHERE run_id = $1 \
         AND check_name = 'semantic_duplicates_last_day'",
    )
    .bind(report.run_id)
    .fetch_one(pool)
    .await
    .unwrap();
    let grouped: f64 = sqlx::query_scalar(GROUPED).fetch_one(pool).await.unwrap();
    (check.expect("the check measured a number"), grouped)
}

/// A change: source, event type, entity, version, tie-break.
type Change = (&'static str, &'static str, String, i64, Option<i64>);

fn event<'a>(id: &'a str, change: &'a Change, body: &'a [u8], sha: [u8; 32]) -> NewEvent<'a> {
    NewEvent {
        tenant_id: TENANT,
        external_id: id,
        source_id: change.0,
        event_type: change.1,
        entity_id: Some(&change.2),
        entity_version: Some(change.3),
        version_tiebreak: change.4,
        sequence: None,
        payload: body,
        payload_sha256: sha,
        headers: json!({}),
        verified_with: "current",
        provider_retries: 0,
        id_outside_signature: false,
        signed_digest: None,
        verified_layout: None,
    }
}

fn sha(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

/// Stores event `id` of `change` through ingest's statement, first received `seconds_ago`.
async fn stored(pool: &PgPool, id: &str, change: &Change, seconds_ago: i64) {
    let sha = sha(id.as_bytes());
    let upserted = webhook_events::upsert(pool, &event(id, change, id.as_bytes(), sha))
        .await
        .unwrap();
    assert_eq!(upserted.outcome, DeliveryOutcome::Accepted, "{id}");
    sqlx::query(
        "UPDATE webhook_events SET first_received_at = now() - make_interval(secs => $2), \
         received_at = now() - make_interval(secs => $2), last_seen_at = now() - make_interval(secs => $2) \
         WHERE tenant_id = $1 AND external_id = $3",
    )
    .bind(TENANT)
    .bind(seconds_ago as f64)
    .bind(id)
    .execute(pool)
    .await
    .unwrap();
}

/// A small deterministic generator (xorshift64), so the history is the same on every run.
struct Draw(u64);
impl Draw {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
    fn change(&mut self) -> Change {
        (
            ["shopify", "standard_webhooks"][self.below(2) as usize],
            ["orders/updated", "orders/paid"][self.below(2) as usize],
            format!("entity-{}", self.below(12)),
            1 + self.below(3) as i64,
            [None, Some(1)][self.below(2) as usize],
        )
    }
}

/// Seconds ago, drawn over 30 hours, each a minute and a half off any whole minute: two
/// minutes apart at least, so neither the day's edge nor the margin's falls within a second of
/// an event while the test runs.
fn seconds_ago(draw: &mut Draw) -> i64 {
    (draw.below(900) * 120 + 90) as i64
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_check_counts_what_grouping_the_day_counts_and_a_run_reads_what_came_since(
    pool: PgPool,
) {
    sources::apply(&pool, &sources_for_every_scheme())
        .await
        .unwrap();
    let mut draw = Draw(0x5eed_cafe_f00d_0001);

    // 300 events of 30 hours over 96 changes (about 240 of them in the last day), some without
    // a change at all; and pairs whose change the steps below move.
    for n in 0..300 {
        let change = draw.change();
        let ago = seconds_ago(&mut draw);
        stored(&pool, &format!("h-{n}"), &change, ago).await;
    }
    let unchanged = ("shopify", "orders/create", "lone".to_owned(), 1, None);
    let keyless = NewEvent {
        entity_id: None,
        entity_version: None,
        ..event("keyless", &unchanged, b"{}", [1; 32])
    };
    webhook_events::upsert(&pool, &keyless).await.unwrap();
    let pair = |name: &str| ("shopify", "orders/create", name.to_owned(), 1, None);
    for (id, ago) in [("x-1", 3 * 3600 + 90), ("x-2", 2 * 3600 + 90)] {
        stored(&pool, id, &pair("x"), ago).await;
    }
    for (id, ago) in [("y-1", 5 * 3600 + 90), ("y-2", 4 * 3600 + 90)] {
        stored(&pool, id, &pair("y"), ago).await;
    }

    // The first run reads the whole day.
    let (check, grouped) = counted(&pool).await;
    assert_eq!(check, grouped, "first run");
    assert!(
        grouped >= 20.0,
        "the history has duplicated changes: {grouped}"
    );

    // New events, some repeating changes of the day: the next run reads those received since
    // the margin before the last run, not the day.
    for n in 0..40 {
        let change = draw.change();
        let ago = draw.below(5) * 20 + 10;
        stored(&pool, &format!("n-{n}"), &change, ago as i64).await;
    }
    let read_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT read_at FROM recent_changes_state")
            .fetch_one(&pool)
            .await
            .unwrap();
    let since_margin: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_events WHERE entity_id IS NOT NULL \
         AND first_received_at >= $1 - make_interval(secs => $2::int)",
    )
    .bind(read_at)
    .bind(NEW_EVENTS_MARGIN_SECONDS)
    .fetch_one(&pool)
    .await
    .unwrap();
    let rolled = delivery_hours::roll(&pool).await.unwrap();
    assert_eq!(rolled.changes, since_margin as u64);
    assert!(
        (40..100).contains(&rolled.changes),
        "read {} events, not the day's 240",
        rolled.changes
    );
    let (check, grouped) = counted(&pool).await;
    assert_eq!(check, grouped, "after new events");

    // A conflicting delivery of x-1 (pending, received 3 hours ago) with a newer version: the
    // row takes it, x's change has one event left in the day, and the check sees it.
    let before = grouped;
    let newer = ("shopify", "orders/create", "x".to_owned(), 2, None);
    let taken = webhook_events::upsert(&pool, &event("x-1", &newer, b"newer", sha(b"newer")))
        .await
        .unwrap();
    assert_eq!(taken.outcome, DeliveryOutcome::Conflict);
    assert!(
        taken.holds_delivery,
        "the pending row took the newer payload"
    );
    let (check, grouped) = counted(&pool).await;
    assert_eq!(grouped, before - 1.0);
    assert_eq!(check, grouped, "after ingest's statement took a conflict");

    // The same through the buffer consumer's batch statement, for y-1 (received 5 hours ago).
    let before = grouped;
    let newer = ("shopify", "orders/create", "y".to_owned(), 2, None);
    let mut conn = pool.acquire().await.unwrap();
    let taken = webhook_events::upsert_batch(
        &mut conn,
        &[BatchedEvent {
            event: event("y-1", &newer, b"newer-y", sha(b"newer-y")),
            received_at: chrono::Utc::now(),
            buffered: false,
        }],
    )
    .await
    .unwrap();
    drop(conn);
    assert_eq!(taken[0].outcome, DeliveryOutcome::Conflict);
    assert!(taken[0].holds_delivery);
    let (check, grouped) = counted(&pool).await;
    assert_eq!(grouped, before - 1.0);
    assert_eq!(check, grouped, "after the batch statement took a conflict");

    // A provider's plain redelivery of x-2 (received 2 hours ago, same body) marks its hour for
    // the rollup's figures, not for the changes: the next run reads what came since the margin
    // before its last run, not the two hours since x-2.
    let again = webhook_events::upsert(&pool, &event("x-2", &pair("x"), b"x-2", sha(b"x-2")))
        .await
        .unwrap();
    assert_eq!(again.outcome, DeliveryOutcome::Duplicate);
    let since_margin: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_events WHERE entity_id IS NOT NULL \
         AND first_received_at >= (SELECT read_at FROM recent_changes_state) - make_interval(secs => $1::int)",
    )
    .bind(NEW_EVENTS_MARGIN_SECONDS)
    .fetch_one(&pool)
    .await
    .unwrap();
    let rolled = delivery_hours::roll(&pool).await.unwrap();
    assert_eq!(rolled.marks, 1, "{rolled:?}");
    assert_eq!(rolled.changes, since_margin as u64, "{rolled:?}");

    // The buffer files two deliveries of one change 6 and 5 hours late (an outage of the
    // database): a duplicated change in the past of the last run.
    let before = grouped;
    let shopify = source("shopify", TENANT, Scheme::Shopify, "secret/shopify");
    let mut messages = Vec::new();
    for (id, hours) in [("late-1", 6), ("late-2", 5)] {
        let d = delivery(
            Scheme::Shopify,
            &secret_of(Scheme::Shopify),
            id,
            now(),
            json!({"id": 7_001, "note": id}),
        );
        let received = (now() - hours * 3600 - 90) * 1_000_000;
        messages.push(Message {
            message_id: format!("m-{id}"),
            delivery: Ok(buffered(&shopify, &d.headers, &d.body, id, received)),
        });
    }
    let filed = filing::file_batch(&pool, &messages).await.unwrap();
    assert!(
        matches!(filed[..], [Filed::Stored(_), Filed::Stored(_)]),
        "{filed:?}"
    );
    let (check, grouped) = counted(&pool).await;
    assert_eq!(
        grouped,
        before + 1.0,
        "the late pair is one duplicated change"
    );
    assert_eq!(check, grouped, "after late filings");

    // Time goes by: ten hours, then ten more. Changes leave the day, pairs split at its edge.
    let mut before = grouped;
    for step in ["10 hours", "10 hours"] {
        age(&pool, step).await;
        let (check, grouped) = counted(&pool).await;
        assert!(grouped < before, "{step}: some change left the day");
        assert_eq!(check, grouped, "after {step}");
        before = grouped;
        // The table keeps the last day and the margin, whatever the history: a row per keyed
        // event received since, none older.
        let (kept, keyed): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM recent_changes), \
                    (SELECT count(*) FROM webhook_events WHERE entity_id IS NOT NULL \
                     AND entity_version IS NOT NULL \
                     AND first_received_at >= (SELECT read_at FROM recent_changes_state) \
                         - interval '1 day' - make_interval(secs => $1::int))",
        )
        .bind(NEW_EVENTS_MARGIN_SECONDS)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(kept, keyed, "after {step}: the day and the margin kept");
    }
}

/// A previous build ran since this build's last run (rolled back, then forward): its ingest
/// gave an event of the last day another entity version without marking it, and its anomaly
/// run either refreshed the old view (a build before the rollup) or rolled without keeping
/// `recent_changes` (a build before it). The next run reads the whole day again.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_previous_builds_run_makes_the_next_read_the_whole_day(pool: PgPool) {
    sources::apply(&pool, &sources_for_every_scheme())
        .await
        .unwrap();
    let change =
        |entity: &str, version| ("shopify", "orders/create", entity.to_owned(), version, None);
    for (n, hours) in [(1, 9), (2, 8), (3, 7), (4, 6)] {
        stored(&pool, &format!("a-{n}"), &change("a", 1), hours * 3600 + 90).await;
        stored(&pool, &format!("b-{n}"), &change("b", 1), hours * 3600 + 90).await;
    }
    let (check, grouped) = counted(&pool).await;
    assert_eq!((check, grouped), (2.0, 2.0));

    for previous_build in [
        "REFRESH MATERIALIZED VIEW CONCURRENTLY delivery_hourly",
        "UPDATE delivery_hours_state SET rolled_at = now()",
    ] {
        // Its ingest moves a change's events to versions of their own, one per event.
        let moved = if previous_build.starts_with("REFRESH") {
            "a"
        } else {
            "b"
        };
        sqlx::query(
            "UPDATE webhook_events SET entity_version = 100 + right(external_id, 1)::int \
             WHERE tenant_id = $1 AND entity_id = $2",
        )
        .bind(TENANT)
        .bind(moved)
        .execute(&pool)
        .await
        .unwrap();
        // Its run, in one transaction: the refresh time is its rollup's where it has one.
        let mut run = pool.begin().await.unwrap();
        sqlx::query(previous_build)
            .execute(&mut *run)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO view_refreshes (view_name, refreshed_at) VALUES ('delivery_hourly', now()) \
             ON CONFLICT (view_name) DO UPDATE SET refreshed_at = EXCLUDED.refreshed_at",
        )
        .execute(&mut *run)
        .await
        .unwrap();
        run.commit().await.unwrap();

        let rolled = delivery_hours::roll(&pool).await.unwrap();
        let day: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM webhook_events WHERE entity_id IS NOT NULL \
             AND first_received_at >= now() - interval '1 day 15 minutes'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            rolled.changes, day as u64,
            "{previous_build}: the whole day"
        );
        let (check, grouped) = counted(&pool).await;
        assert_eq!(check, grouped, "after {previous_build}");
    }
    assert_eq!(
        sqlx::query_scalar::<_, f64>(GROUPED)
            .fetch_one(&pool)
            .await
            .unwrap(),
        0.0
    );
}
