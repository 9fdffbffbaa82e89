//! The verdict in bounded time (issue 26): every statement `hookctl status` and the operator
//! actions run is planned against a table of realistic size (production's shape, see
//! `pipeline_tests::scale`), and no plan reads `webhook_events` by a scan: each read of it is
//! bounded by an index condition, and no index is walked filtering on the source (the quiet
//! sources' `max(first_received_at)` walked the whole time index backwards).
//!
//! The plans are the ones the server really chose for the statements as executed, with their
//! bound parameters: `auto_explain` on the test's own connection sends each as a notice.

use std::sync::{Arc, Mutex};

use shared::operator::{self, OperatorRequest};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tracing_subscriber::layer::SubscriberExt;

/// Enough events that the planner prefers an index wherever one bounds the read.
const ROWS: i64 = 200_000;

/// Collects the `message` of every notice sqlx receives.
#[derive(Clone, Default)]
struct Notices(Arc<Mutex<Vec<String>>>);

struct Message<'a>(&'a mut Option<String>);

impl tracing::field::Visit for Message<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            *self.0 = Some(value.to_owned());
        }
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" && self.0.is_none() {
            *self.0 = Some(format!("{value:?}"));
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Notices {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if event.metadata().target() == "sqlx::postgres::notice" {
            let mut message = None;
            event.record(&mut Message(&mut message));
            if let Some(m) = message {
                self.0.lock().unwrap().push(m);
            }
        }
    }
}

/// A plan auto_explain sent: the statement and its plan tree.
struct Explained {
    query: String,
    plan: serde_json::Value,
    /// The statement was JIT-compiled.
    jit: bool,
}

/// One connection on which every statement is explained (auto_explain, as JSON notices), and
/// the notices it raises while the guard lives. Its plans are made as for a table far larger
/// than the memory the server assumes it can cache (`effective_cache_size` 8 kB), as a
/// production table that outgrows its server's memory is: at 20 M rows (23 GB against the default 4 GB) the rollup's aggregation
/// was planned as a sequential scan of the whole table, where the test's 200 000 rows planned
/// it by the index.
async fn explaining(pool: &PgPool) -> (PgPool, Notices, tracing::subscriber::DefaultGuard) {
    let explaining = PgPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                use sqlx::Executor;
                conn.execute(
                    "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0; \
                     SET auto_explain.log_format = json; SET auto_explain.log_level = notice; \
                     SET client_min_messages = notice",
                )
                .await?;
                conn.execute("SET effective_cache_size = '8kB'").await?;
                Ok(())
            })
        })
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    let notices = Notices::default();
    let guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(notices.clone()));
    (explaining, notices, guard)
}

/// [`explaining`], each plan with the rows its nodes really returned (auto_explain's
/// `log_analyze`).
async fn explaining_analyzed(
    pool: &PgPool,
) -> (PgPool, Notices, tracing::subscriber::DefaultGuard) {
    let (explaining, notices, guard) = explaining(pool).await;
    sqlx::query("SET auto_explain.log_analyze = on")
        .execute(&explaining)
        .await
        .unwrap();
    (explaining, notices, guard)
}

fn explained(notices: &Notices) -> Vec<Explained> {
    notices
        .0
        .lock()
        .unwrap()
        .iter()
        .filter_map(|m| {
            let json: serde_json::Value = serde_json::from_str(&m[m.find('{')?..]).ok()?;
            Some(Explained {
                query: json["Query Text"].as_str().unwrap_or_default().to_owned(),
                plan: json["Plan"].clone(),
                jit: json.get("JIT").is_some(),
            })
        })
        .collect()
}

/// The reads of `webhook_events` in every plan, and what is wrong with each, naming the
/// statement.
fn unbounded_reads_of(plans: &[Explained]) -> (usize, Vec<String>) {
    let mut reads = 0;
    let mut wrong = Vec::new();
    for p in plans {
        let mut found = Vec::new();
        unbounded_reads(&p.plan, &mut reads, &mut found);
        wrong.extend(
            found
                .into_iter()
                .map(|f| format!("{f}\n    in: {}", p.query)),
        );
    }
    (reads, wrong)
}

/// The rollup over the fill's 29 days, as a deployed system's first runs leave it.
async fn fill_the_rollup(pool: &PgPool) {
    while shared::store::delivery_hours::roll(pool)
        .await
        .unwrap()
        .missing
        > 0
    {}
}

/// What is wrong with each node of `plan` that reads `webhook_events` (or one of its indexes);
/// counts those nodes in `reads`.
fn unbounded_reads(plan: &serde_json::Value, reads: &mut usize, out: &mut Vec<String>) {
    let text = |k: &str| plan[k].as_str().unwrap_or_default();
    let on_events = text("Relation Name") == "webhook_events"
        || text("Index Name").starts_with("webhook_events_");
    if on_events {
        *reads += 1;
        let node = text("Node Type");
        let cond = text("Index Cond");
        match node {
            "Seq Scan" => out.push("a sequential scan of webhook_events".into()),
            "Index Scan" | "Index Only Scan" | "Bitmap Index Scan" => {
                let bounded = cond
                    .split(" AND ")
                    .any(|c| !c.trim_matches(['(', ')', ' ']).ends_with("IS NOT NULL"));
                if cond.is_empty() || !bounded {
                    out.push(format!(
                        "{node} of {} bounded by nothing (Index Cond: {cond:?})",
                        text("Index Name")
                    ));
                }
            }
            _ => {}
        }
        if text("Filter").contains("source_id") {
            out.push(format!(
                "{node} of {} filters on the source instead of bounding by it (Filter: {})",
                text("Index Name"),
                text("Filter")
            ));
        }
    }
    for child in plan["Plans"].as_array().into_iter().flatten() {
        unbounded_reads(child, reads, out);
    }
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn status_and_the_operator_actions_read_webhook_events_only_through_bounding_indexes(
    pool: PgPool,
) {
    pipeline_tests::scale::fill(&pool, ROWS).await;
    let (dead_letter_id, outbox_id): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT min(dead_letter_id) FROM dead_letters), (SELECT min(outbox_id) FROM outbox)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let second_letter: i64 = sqlx::query_scalar("SELECT max(dead_letter_id) FROM dead_letters")
        .fetch_one(&pool)
        .await
        .unwrap();

    let (explaining, notices, _guard) = explaining(&pool).await;

    let registry = shared::effects::EffectRegistry::standard();
    let requests = serde_json::json!([
        {"action": "status"},
        {"action": "list_dead_letters"},
        {"action": "show_dead_letter", "dead_letter_id": dead_letter_id},
        {"action": "list_runs"},
        {"action": "list_checks"},
        {"action": "list_gaps"},
        {"action": "list_tombstones", "source_id": "busy-1"},
        {"action": "list_failed_outbox", "filter": {"ids": [outbox_id]}},
        {"action": "list_actions"},
        {"action": "tombstone", "tenant_id": "scale", "source_id": "busy-2",
         "external_id": "never_sent_1", "reason": "the provider says so", "actor": "test"},
        {"action": "set_dead_letter_status", "dead_letter_id": second_letter,
         "status": "investigating", "reason": "looking", "actor": "test"},
        {"action": "replay", "filter": {"ids": [dead_letter_id]}, "reason": "fixed", "actor": "test"},
        {"action": "resend_outbox", "filter": {"ids": [outbox_id]}, "reason": "again", "actor": "test"},
    ]);
    let mut answered = Vec::new();
    for json in requests.as_array().unwrap() {
        let request: OperatorRequest = operator::parse(json.clone()).unwrap();
        let response = operator::handle(&explaining, &registry, request).await;
        answered.push((
            json["action"].clone(),
            response.map(|_| ()).map_err(|e| e.to_string()),
        ));
    }
    drop(_guard);
    // The reads answer; the actions may refuse (the replayed event's effect, the outbox row
    // that did not fail), but each ran its statements.
    for (action, result) in &answered[..9] {
        assert!(result.is_ok(), "{action}: {result:?}");
    }

    let plans = explained(&notices);
    let (reads, wrong) = unbounded_reads_of(&plans);
    assert!(
        plans.iter().any(|p| p.query.contains("last_received_at")),
        "status's per-source activity was explained ({} plans)",
        plans.len()
    );
    assert!(
        reads >= 4,
        "the statements read webhook_events ({reads} reads in {} plans)",
        plans.len()
    );
    assert!(wrong.is_empty(), "unbounded reads:\n{}", wrong.join("\n"));
}

/// The anomaly run's rollup of the hourly delivery figures (`delivery_hours`, issue 26) reads
/// `webhook_events` only through bounding indexes too: the hours it computes (a marked one, and
/// those with new events), each a range of the time index, and its look for new events in
/// every hour of the 29 days, a probe of the same index. As a plain join, the aggregation over the hours' array was
/// planned at 20 M rows as a parallel sequential scan of the whole table, joined to the hours
/// by a filter: 25 s a run on this machine (`./scripts/bench scale`, 2026-12-03).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_delivery_hours_rollup_reads_webhook_events_only_through_bounding_indexes(
    pool: PgPool,
) {
    pipeline_tests::scale::fill(&pool, ROWS).await;
    fill_the_rollup(&pool).await;
    // A late delivery marked a week-old hour.
    sqlx::query(
        "INSERT INTO delivery_hours_dirty (source_id, hour) \
         VALUES ('busy-1', date_trunc('hour', now() - interval '7 days 3 hours'))",
    )
    .execute(&pool)
    .await
    .unwrap();

    let (explaining, notices, _guard) = explaining(&pool).await;
    let rolled = shared::store::delivery_hours::roll(&explaining)
        .await
        .unwrap();
    drop(_guard);
    assert_eq!((rolled.marks, rolled.missing), (1, 0), "{rolled:?}");
    // Filled, a run computes the marked hour and the hours with events received since 15
    // minutes before their computation (the backlog's newest): not the rest of the last day.
    assert!(
        (2..=3).contains(&rolled.hours),
        "the marked hour and the newest events' hours: {rolled:?}"
    );
    // The changes behind semantic_duplicates_last_day are read again for the events received
    // since 15 minutes before the last run: none that name an entity version (the fill's newest
    // are 30 minutes old, the backlog's name none), where the day holds about 6 900.
    assert_eq!(rolled.changes, 0, "{rolled:?}");

    let plans = explained(&notices);
    let (reads, wrong) = unbounded_reads_of(&plans);
    assert!(
        plans
            .iter()
            .any(|p| p.query.contains("INSERT INTO delivery_hours ")),
        "the rollup's aggregation was explained ({} plans)",
        plans.len()
    );
    assert!(reads >= 1, "the rollup read webhook_events ({reads} reads)");
    assert!(wrong.is_empty(), "unbounded reads:\n{}", wrong.join("\n"));
}

/// `hookctl status`'s per-source figures of the last day come from the hourly rollup the anomaly
/// pass keeps (`delivery_hours`, as of each hour's computation) and, from `webhook_events`, only
/// what the rollup has not counted: events received since it last ran, and hours it has not
/// computed. Reading the day itself (a 29th of this table, 8.6 M wide rows a day at 100
/// events/s) made status grow with the traffic kept: 14.6x from 1 M to 20 M rows in
/// `./scripts/bench scale`. The last hour's count is read off the `(source_id,
/// first_received_at)` index alone.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn status_reads_the_rows_of_the_last_day_only_where_the_rollup_has_not_counted_them(
    pool: PgPool,
) {
    pipeline_tests::scale::fill(&pool, ROWS).await;
    fill_the_rollup(&pool).await;
    // Events received since the rollup last ran.
    const SINCE: i64 = 25;
    sqlx::query(
        "INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, payload_sha256, verified_with, \
             received_at, first_received_at, last_seen_at, status, processed_at) \
         SELECT 'scale', 'late_' || i, 'busy-1', 'thing.updated', sha256(convert_to('late_' || i, 'UTF8')), 'current', \
                now(), now(), now(), 'processed', now() \
         FROM generate_series(1, $1) AS i",
    )
    .bind(SINCE)
    .execute(&pool)
    .await
    .unwrap();

    let (explaining, notices, _guard) = explaining_analyzed(&pool).await;
    let report = shared::status::report(&explaining, &Default::default())
        .await
        .unwrap();
    drop(_guard);
    let day: i64 = report
        .sources
        .iter()
        .map(|s| s.activity.events_last_day)
        .sum();
    let truth: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_events WHERE first_received_at >= date_trunc('hour', now() - interval '1 day')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(day, truth, "the last day's events, every source");

    let reads = event_reads_in(
        &explained(&notices),
        "last_received_at",
        "status's per-source activity",
    );
    // Rows of the table itself: every node but the index-only ones.
    let heap: f64 = reads
        .iter()
        .filter(|(node, _)| !node.starts_with("Index Only Scan"))
        .map(|(_, rows)| rows)
        .sum();
    assert!(
        heap <= SINCE as f64,
        "status read {heap} rows of webhook_events for {SINCE} events received since the rollup ran \
         (a day holds {truth}): {reads:?}"
    );
}

/// The nodes of `plan` (and below) that read `relation` by a sequential scan.
fn sequential_scans_of(plan: &serde_json::Value, relation: &str, out: &mut usize) {
    if plan["Node Type"] == "Seq Scan" && plan["Relation Name"] == relation {
        *out += 1;
    }
    for child in plan["Plans"].as_array().into_iter().flatten() {
        sequential_scans_of(child, relation, out);
    }
}

/// `hookctl status` counts the outbox's pending, overdue and failed messages through the
/// partial indexes that hold only those (`outbox_due`, `outbox_failed`): the delivered
/// ones are nearly all of the table and grow with the traffic kept (one for every tenth event
/// in this fill). Counted as one filter over both states, no index matched and status read the
/// whole outbox: 60 ms of its 140 ms at 5 M events.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn status_counts_the_outbox_through_its_pending_and_failed_indexes(pool: PgPool) {
    pipeline_tests::scale::fill(&pool, ROWS).await;
    sqlx::query(
        "UPDATE outbox SET status = CASE WHEN outbox_id % 2 = 0 THEN 'pending' ELSE 'failed' END, \
             next_attempt_at = now() \
         WHERE outbox_id IN (SELECT outbox_id FROM outbox ORDER BY outbox_id DESC LIMIT 10)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE outbox").execute(&pool).await.unwrap();

    let (explaining, notices, _guard) = explaining(&pool).await;
    let report = shared::status::report(&explaining, &Default::default())
        .await
        .unwrap();
    drop(_guard);
    assert_eq!((report.outbox.pending, report.outbox.failed), (5, 5));

    let plans = explained(&notices);
    let outbox: Vec<_> = plans
        .iter()
        .filter(|p| p.query.contains("FROM outbox"))
        .collect();
    assert!(!outbox.is_empty(), "status's outbox counts were explained");
    let mut scans = 0;
    for p in &outbox {
        sequential_scans_of(&p.plan, "outbox", &mut scans);
    }
    assert_eq!(
        scans,
        0,
        "status read the outbox by a sequential scan: {:?}",
        outbox.iter().map(|p| &p.query).collect::<Vec<_>>()
    );
}

/// Every node of `plan` (and below) that reads `webhook_events` or one of its indexes, with the
/// rows it really returned (auto_explain's `log_analyze`).
fn event_reads(plan: &serde_json::Value, out: &mut Vec<(String, f64)>) {
    let text = |k: &str| plan[k].as_str().unwrap_or_default();
    if text("Relation Name") == "webhook_events"
        || text("Index Name").starts_with("webhook_events_")
    {
        let name = format!("{} {}", text("Node Type"), text("Index Name"));
        let rows = plan["Actual Rows"].as_f64().unwrap_or_default()
            * plan["Actual Loops"].as_f64().unwrap_or(1.0);
        out.push((name, rows));
    }
    for child in plan["Plans"].as_array().into_iter().flatten() {
        event_reads(child, out);
    }
}

/// The reads of `webhook_events`, with their rows, in the plan of the one statement of `plans`
/// whose text holds `statement` (`what` names it in the failure).
fn event_reads_in(plans: &[Explained], statement: &str, what: &str) -> Vec<(String, f64)> {
    let plan = plans
        .iter()
        .find(|p| p.query.contains(statement))
        .unwrap_or_else(|| panic!("{what} was explained ({} plans)", plans.len()));
    let mut reads = Vec::new();
    event_reads(&plan.plan, &mut reads);
    reads
}

/// Retention's payload purge resumes where its cursor stopped: a batch reads the events from the
/// cursor on, not every event from the oldest kept (three weeks of them at the default horizons,
/// 180 M rows at 100 events/s) to filter out those before it.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_payload_purge_reads_webhook_events_from_its_cursor(pool: PgPool) {
    pipeline_tests::scale::fill(&pool, ROWS).await;
    // The purge has walked every event older than eight days.
    sqlx::query(
        "INSERT INTO retention_cursors (name, through) VALUES ('payloads', now() - interval '8 days')",
    )
    .execute(&pool)
    .await
    .unwrap();
    const LIMIT: i64 = 1000;

    let (explaining, notices, _guard) = explaining_analyzed(&pool).await;
    let batch = shared::store::retention::purge_payloads(&explaining, 7.0 * 24.0 * 3600.0, LIMIT)
        .await
        .unwrap();
    drop(_guard);
    assert_eq!(batch.examined, LIMIT as u64, "{batch:?}");

    let reads = event_reads_in(
        &explained(&notices),
        "retention_cursors",
        "the payload purge",
    );
    assert!(!reads.is_empty(), "the purge read webhook_events");
    let walked: Vec<_> = reads
        .iter()
        .filter(|(_, rows)| *rows > (LIMIT + 1) as f64)
        .collect();
    assert!(
        walked.is_empty(),
        "a batch of {LIMIT} read more rows of webhook_events than it examined: {walked:?}"
    );
}

/// The anomaly check on retention's lag (`identity_purge_lag_seconds`) reads webhook_events
/// through the time index, from the oldest event to the first the identity purge may delete:
/// here the oldest itself, one row, nine days of the fill past a 20-day horizon.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_identity_purge_lag_check_reads_one_row_of_the_time_index(pool: PgPool) {
    pipeline_tests::scale::fill(&pool, ROWS).await;
    sqlx::query(
        "INSERT INTO maintenance_runs (job, trigger, status, finished_at, found) \
         VALUES ('retention', 'test', 'completed', now(), '{\"identity_horizon_seconds\": 1728000}')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let check = shared::store::anomaly::GLOBAL_CHECKS
        .iter()
        .find(|c| c.name == "identity_purge_lag_seconds")
        .unwrap();

    let (explaining, notices, _guard) = explaining_analyzed(&pool).await;
    let lag = shared::store::anomaly::measure(&explaining, check)
        .await
        .unwrap()
        .unwrap();
    drop(_guard);
    // The oldest event was 29 days old when the fill wrote it, a few seconds or minutes ago.
    assert!(
        (9.0 * 86400.0 - 60.0..9.0 * 86400.0 + 3600.0).contains(&lag),
        "the oldest event is 29 days old: {lag}"
    );

    let plans = explained(&notices);
    let plan = plans
        .iter()
        .find(|p| p.query.contains("identity_horizon_seconds"))
        .expect("the check was explained");
    let (mut count, mut wrong) = (0, Vec::new());
    unbounded_reads(&plan.plan, &mut count, &mut wrong);
    assert!(wrong.is_empty(), "unbounded reads: {wrong:?}");
    let mut reads = Vec::new();
    event_reads(&plan.plan, &mut reads);
    assert!(
        !reads.is_empty() && reads.iter().all(|(_, rows)| *rows <= 1.0),
        "{reads:?}"
    );
}

/// The anomaly pass's checks read `webhook_events` only through bounding indexes too, planned
/// as for a table larger than the server's cache: every check that looks at events looks at a
/// range of the time index or at the events a smaller table names.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_anomaly_checks_read_webhook_events_only_through_bounding_indexes(pool: PgPool) {
    pipeline_tests::scale::fill(&pool, ROWS).await;
    fill_the_rollup(&pool).await;
    let (explaining, notices, _guard) = explaining(&pool).await;
    shared::anomaly::run_once(&explaining, &Default::default(), "test")
        .await
        .unwrap();
    drop(_guard);

    let plans = explained(&notices);
    let (reads, wrong) = unbounded_reads_of(&plans);
    assert!(reads >= 5, "the checks read webhook_events ({reads} reads)");
    assert!(wrong.is_empty(), "unbounded reads:\n{}", wrong.join("\n"));
}

/// The two statements of the anomaly pass that read a day of webhook_events until issue 26's
/// last step: the consistency sweep reads at most its window of the time index, from its
/// cursor back (where the whole-day checks read the day, about 6 900 events here and 8.6 M a day
/// at 100 events/s), and `processing_latency`'s refresh reads the drain's recorded completions,
/// not webhook_events at all.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_consistency_sweep_reads_its_window_and_the_latency_view_no_event(pool: PgPool) {
    pipeline_tests::scale::fill(&pool, ROWS).await;
    const WINDOW: i64 = 1000;

    let (explaining, notices, _guard) = explaining_analyzed(&pool).await;
    shared::store::anomaly::refresh_views(&explaining)
        .await
        .unwrap();
    let first = shared::store::consistency_sweep::sweep(&explaining, WINDOW)
        .await
        .unwrap();
    let second = shared::store::consistency_sweep::sweep(&explaining, WINDOW)
        .await
        .unwrap();
    // The default window: the rest of the day's 6 900 events and the backlog's 10 000.
    let whole = shared::store::consistency_sweep::sweep(&explaining, 50_000)
        .await
        .unwrap();
    drop(_guard);
    assert!(whole.cycle_ended && whole.events > 10_000, "{whole:?}");
    assert_eq!((first.events, second.events), (WINDOW, WINDOW));
    assert!(first.new_cycle && !second.new_cycle && second.through < first.from);
    let latency: i64 = sqlx::query_scalar("SELECT events FROM processing_latency")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        latency > 0,
        "the fill's completions of the last hour: {latency}"
    );

    let plans = explained(&notices);
    let refresh = plans
        .iter()
        .filter(|p| p.query.contains("processing_completions"))
        .collect::<Vec<_>>();
    assert!(!refresh.is_empty(), "the view's refresh was explained");
    for p in refresh {
        let mut reads = Vec::new();
        event_reads(&p.plan, &mut reads);
        assert!(reads.is_empty(), "{reads:?}\n    in: {}", p.query);
    }
    let windows: Vec<&Explained> = plans
        .iter()
        .filter(|p| p.query.contains("WITH w AS MATERIALIZED"))
        .collect();
    assert_eq!(windows.len(), 3, "every window was explained");
    // The planner prices a window's per-event checks past the JIT's thresholds: compiling them
    // took 590 ms of a 730 ms window at the 1 M fill.
    for p in &windows {
        assert!(!p.jit, "the window was JIT-compiled: {}", p.query);
    }
    for p in windows.into_iter().take(2) {
        let (mut count, mut wrong) = (0, Vec::new());
        unbounded_reads(&p.plan, &mut count, &mut wrong);
        assert!(
            count >= 1 && wrong.is_empty(),
            "{wrong:?}\n    in: {}",
            p.query
        );
        let mut reads = Vec::new();
        event_reads(&p.plan, &mut reads);
        let rows: f64 = reads.iter().map(|(_, rows)| rows).sum();
        assert!(
            rows <= (WINDOW + 1) as f64,
            "a window of {WINDOW} read {rows} rows of webhook_events: {reads:?}"
        );
    }
}

/// Gap detection (the backfill's look at a sequence source's new ground) reads `webhook_events`
/// through the sequence index, the source and the window bounding it: a window of 10 000
/// numbers reads at most 10 000 events, and finds the fill's missing numbers in it (every
/// 1000th), whatever the source has stored below its watermark.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn gap_detection_reads_its_window_of_the_sequence_index(pool: PgPool) {
    use pipeline_tests::scale::SEQUENCE_SOURCE;
    pipeline_tests::scale::fill(&pool, ROWS).await;
    const WINDOW: i64 = 10_000;
    let highest: i64 = sqlx::query_scalar(
        "SELECT max(provider_sequence) FROM webhook_events WHERE source_id = $1",
    )
    .bind(SEQUENCE_SOURCE)
    .fetch_one(&pool)
    .await
    .unwrap();
    let from = highest - WINDOW;
    sqlx::query(
        "UPDATE gap_watermarks SET contiguous_through = $2, examined_through = $2 WHERE source_id = $1",
    )
    .bind(SEQUENCE_SOURCE)
    .bind(from)
    .execute(&pool)
    .await
    .unwrap();
    let sources = shared::sources::list(&pool).await.unwrap();
    let source = sources
        .iter()
        .find(|s| s.source_id.as_str() == SEQUENCE_SOURCE)
        .unwrap();

    let (explaining, notices, _guard) = explaining_analyzed(&pool).await;
    let new = shared::backfill::detect_sequence_gaps(&explaining, source, "evt_{seq}", WINDOW, 1)
        .await
        .unwrap();
    drop(_guard);
    let missing = (from + 1..=highest).filter(|n| n % 1000 == 7).count() as u64;
    assert_eq!(new, missing, "the window's missing numbers are candidates");

    let plans = explained(&notices);
    let (count, wrong) = unbounded_reads_of(&plans);
    assert!(count >= 1, "gap detection read webhook_events");
    assert!(wrong.is_empty(), "unbounded reads:\n{}", wrong.join("\n"));
    let reads = event_reads_in(&plans, "lead(provider_sequence)", "the sequence window");
    assert!(
        !reads.is_empty() && reads.iter().all(|(_, rows)| *rows <= WINDOW as f64),
        "a window of {WINDOW} numbers read more events: {reads:?}"
    );
}

/// The scans of `plan` (and below) that read `relation`, with the rows each really returned
/// (auto_explain's `log_analyze`).
fn reads_of(plan: &serde_json::Value, relation: &str, out: &mut Vec<(String, f64)>) {
    let text = |k: &str| plan[k].as_str().unwrap_or_default();
    if text("Relation Name") == relation && text("Node Type").contains("Scan") {
        let rows = plan["Actual Rows"].as_f64().unwrap_or_default()
            * plan["Actual Loops"].as_f64().unwrap_or(1.0);
        out.push((
            format!("{} {}", text("Node Type"), text("Index Name")),
            rows,
        ));
    }
    for child in plan["Plans"].as_array().into_iter().flatten() {
        reads_of(child, relation, out);
    }
}

/// A sender's lease takes the oldest due messages through the index that keeps them in that
/// order, reading about as many as it takes: after a destination's outage a backlog of every
/// message it missed is due at once, and a lease that sorted every pending message (the planner
/// chose a sequential scan and a sort once most of them were due) cost a read of the whole
/// backlog for every batch of fifty.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_lease_reads_the_due_messages_it_takes_not_the_whole_backlog(pool: PgPool) {
    pipeline_tests::scale::fill(&pool, ROWS).await;
    const BACKLOG: i64 = 10_000;
    sqlx::query(
        "UPDATE outbox SET status = 'pending', delivered_at = NULL, next_attempt_at = now() - interval '1 minute' \
         WHERE outbox_id IN (SELECT outbox_id FROM outbox ORDER BY outbox_id DESC LIMIT $1)",
    )
    .bind(BACKLOG)
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("VACUUM ANALYZE outbox")
        .execute(&pool)
        .await
        .unwrap();

    let (explaining, notices, _guard) = explaining_analyzed(&pool).await;
    let leased = shared::store::outbox::lease(&explaining, 50, 8 << 20, 60.0)
        .await
        .unwrap();
    drop(_guard);
    assert_eq!(leased.len(), 50);

    let plans = explained(&notices);
    let lease = plans
        .iter()
        .find(|p| p.query.contains("UPDATE outbox"))
        .expect("the lease was explained");
    let mut reads = Vec::new();
    reads_of(&lease.plan, "outbox", &mut reads);
    let read: f64 = reads.iter().map(|(_, rows)| rows).sum();
    assert!(
        !reads.iter().any(|(node, _)| node.starts_with("Seq Scan")),
        "the lease scanned the backlog: {reads:?}"
    );
    assert!(
        read <= 4.0 * 50.0,
        "the lease read {read} outbox rows to take 50 of {BACKLOG} due: {reads:?}"
    );
}

/// The rows of `webhook_events` a plan's nodes really read (auto_explain's `log_analyze`):
/// each scan node's rows times its loops.
fn rows_read_from_events(plan: &serde_json::Value) -> f64 {
    let text = |k: &str| plan[k].as_str().unwrap_or_default();
    let own = if text("Relation Name") == "webhook_events"
        || text("Index Name").starts_with("webhook_events_")
    {
        plan["Actual Rows"].as_f64().unwrap_or(0.0) * plan["Actual Loops"].as_f64().unwrap_or(1.0)
            + plan["Rows Removed by Filter"].as_f64().unwrap_or(0.0)
    } else {
        0.0
    };
    own + plan["Plans"]
        .as_array()
        .into_iter()
        .flatten()
        .map(rows_read_from_events)
        .sum::<f64>()
}

/// The console's event search reads about the rows it returns (200 000 events here), not the
/// table:
/// newest first with no filter (the time index backwards, stopped by the page), by source, by
/// source and time range, and by the provider's id alone (the primary key, for every tenant).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_event_search_reads_about_the_rows_it_returns(pool: PgPool) {
    pipeline_tests::scale::fill(&pool, ROWS).await;
    let (explaining, notices, _guard) = explaining_analyzed(&pool).await;
    let registry = shared::effects::EffectRegistry::standard();
    let days_ago = |days: i64| (chrono::Utc::now() - chrono::Duration::days(days)).to_rfc3339();
    let searches = [
        serde_json::json!({}),
        serde_json::json!({"source_id": "busy-2"}),
        serde_json::json!({"source_id": "quiet-1"}),
        serde_json::json!({"source_id": "busy-1", "since": days_ago(3), "until": days_ago(2)}),
        serde_json::json!({"external_id": format!("evt_{}", ROWS / 2)}),
    ];
    for search in &searches {
        let request = operator::parse(serde_json::json!({
            "action": "list_events", "search": search, "limit": 50
        }))
        .unwrap();
        let answer = operator::handle(&explaining, &registry, request)
            .await
            .unwrap();
        let answer = serde_json::to_value(answer).unwrap();
        assert!(answer["events"].is_array(), "{search}: {answer}");
    }
    drop(_guard);
    let plans: Vec<Explained> = explained(&notices)
        .into_iter()
        .filter(|p| p.query.contains("FROM webhook_events WHERE true"))
        .collect();
    assert_eq!(plans.len(), searches.len(), "one plan a search");
    // A source with a third of the events (busy-2) may be read through the time index, three
    // rows for each it returns; no search reads more than four pages' worth.
    for (search, plan) in searches.iter().zip(&plans) {
        let read = rows_read_from_events(&plan.plan);
        eprintln!("{search}: {read} rows of webhook_events read for a page of 50");
        assert!(
            read <= 200.0,
            "{search}: {read} rows of webhook_events read for a page of 50:\n{}",
            serde_json::to_string_pretty(&plan.plan).unwrap()
        );
    }
}
