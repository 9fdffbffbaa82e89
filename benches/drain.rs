//! Drain throughput with 1, 2 and 4 concurrent drainers, sustained for BENCH_MINUTES (default
//! 5) while ingestion keeps adding events, beside a raw claim-and-complete pgbench script on a
//! copy of the queue table in the same run. Prints each minute's rate, the first minute beside
//! the last (the drain must hold its rate: no decay from dead index entries), the ratio to the
//! raw rate, and the ratio to the drain's own writes done in plain SQL on the same backlog.
//! Each limit is measured twice, just before the drainers and just after, with the same
//! ingestion running beside it as beside the drainers: the ratios are to the mean of the two,
//! and both are printed, so a limit that moved during the run shows as a spread.
//!
//! Run: `./scripts/bench drain` (needs DATABASE_URL with the right to create a database).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::HeaderMap;
use shared::domain::{FieldLocator, Scheme};
use shared::drain::Drainer;
use shared::effects::EffectRegistry;
use shared::extract::FieldMap;
use shared::ingest::{Delivery, IngestLimits, Ingestor};
use shared::secrets::{SecretSet, SecretStore, SigningSecret};
use shared::sources::{self, Source, SourceRegistry};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Executor, PgPool};

const SECRET: &str = "whsec_YmVuY2gtZHJhaW4tc2lnbmluZy1rZXk=";
/// Events per second the ingestion task adds while the drainers run.
const INGEST_PER_SECOND: u64 = 200;

fn source() -> Source {
    let mut fields = FieldMap::defaults_for(Scheme::StandardWebhooks);
    fields.entity_id = Some(FieldLocator::json("/data/id"));
    fields.entity_version = Some(FieldLocator::json("/data/version"));
    Source {
        fields,
        ..benchmarks::source(Scheme::StandardWebhooks, Duration::from_secs(3600))
    }
}

async fn exec(pool: &PgPool, sql: String) {
    pool.execute(sqlx::AssertSqlSafe(sql)).await.unwrap();
}

/// A clean slate: no events, nothing queued.
async fn clear(pool: &PgPool) {
    exec(
        pool,
        "TRUNCATE event_queue, outbox, entities, dead_letters, webhook_events".into(),
    )
    .await;
}

/// Queues more entity events (version 1 of as many distinct entities, ids `<tag>-1`, ...)
/// until at least `depth` wait, then [`settle`]s: every limit's run and the drainers start on a
/// backlog deep enough for them, however fast the run before them drained it.
async fn fill_queue(pool: &PgPool, depth: u64, tag: &str) {
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM event_queue")
        .fetch_one(pool)
        .await
        .unwrap();
    let n = depth.saturating_sub(queued as u64);
    exec(
        pool,
        format!(
            "WITH e AS (INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, entity_id, entity_version, \
                 payload, payload_sha256, verified_with, received_at, first_received_at, last_seen_at) \
             SELECT 'bench', '{tag}-' || g, 'bench', 'item.updated', 'item-{tag}-' || g, 1, \
                 convert_to(json_build_object('type', 'item.updated', 'data', json_build_object('id', 'item-{tag}-' || g, 'version', 1, 'name', repeat('x', 64)))::text, 'UTF8'), \
                 sha256(convert_to('{tag}-' || g, 'UTF8')), 'current', now(), now(), now() \
             FROM generate_series(1, {n}) AS g RETURNING tenant_id, external_id, received_at) \
             INSERT INTO event_queue (tenant_id, external_id, ready_at, enqueued_at) SELECT tenant_id, external_id, received_at, received_at FROM e"
        ),
    )
    .await;
    settle(pool).await;
}

/// The queue and the event rows vacuumed and analyzed: the state each limit's run and the
/// drainers start from, so the runs before the drainers and after them start alike.
async fn settle(pool: &PgPool) {
    exec(pool, "VACUUM ANALYZE event_queue".into()).await;
    exec(pool, "VACUUM ANALYZE webhook_events".into()).await;
}

/// Ingests at a steady rate until `stop`, through the real ingest path.
async fn ingest_steadily(
    ingestor: Arc<Ingestor>,
    stop: Arc<AtomicBool>,
    tag: String,
    counted: Arc<AtomicU64>,
) -> u64 {
    let mut sent = 0u64;
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / 20));
    let at = shared::ingest::unix_now();
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        for _ in 0..INGEST_PER_SECOND / 20 {
            sent += 1;
            let id = format!("{tag}-live-{sent}");
            let body = serde_json::to_vec(&serde_json::json!({"type": "item.updated", "data": {"id": format!("live-{tag}-{}", sent % 5000), "version": sent}})).unwrap();
            let headers: HeaderMap = shared::signature::sign(
                Scheme::StandardWebhooks,
                &SigningSecret::new(SECRET),
                &id,
                at,
                &body,
            )
            .unwrap()
            .into_iter()
            .collect();
            ingestor
                .receive(Delivery {
                    source_id: "bench",
                    headers: &headers,
                    body: &body,
                    method: "POST",
                    url: None,
                    source_ip: None,
                    client_certificate: None,
                })
                .await
                .unwrap();
            counted.store(sent, Ordering::Relaxed);
        }
    }
    sent
}

/// A one-connection pool built as the functions build theirs (no ping before every acquire).
fn product_pool(options: PgConnectOptions) -> PgPool {
    let settings = shared::store::PoolSettings {
        max_connections: 1,
        ..shared::store::PoolSettings::default()
    };
    shared::store::lazy_pool(options, &settings)
}

/// The [`INGEST_PER_SECOND`] events a second that run beside the drainers, started for each
/// limit's run too: every figure of a run is measured on a machine doing the same ingestion.
struct IngestBeside {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
    /// The events ingested so far.
    sent: Arc<AtomicU64>,
    /// The ingestion's own connection, also used to read the queue's depth.
    pool: PgPool,
}

impl IngestBeside {
    /// Starts ingesting events `<tag>-live-1`, `<tag>-live-2`, …
    fn start(options: &PgConnectOptions, tag: &str) -> Self {
        let pool = product_pool(options.clone());
        let registry = Arc::new(SourceRegistry::new(pool.clone(), Duration::from_secs(3600)));
        let secrets = SecretStore::memory([("bench".to_owned(), SecretSet::new(SECRET, None))]);
        let ingestor = Arc::new(Ingestor::new(
            pool.clone(),
            registry,
            Arc::new(secrets),
            IngestLimits {
                max_body_bytes: 1 << 20,
            },
        ));
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(ingest_steadily(
            ingestor,
            stop.clone(),
            tag.to_owned(),
            sent.clone(),
        ));
        Self {
            stop,
            task,
            sent,
            pool,
        }
    }

    async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap()
    }
}

/// pgbench's run of `script`, with the ingestion beside it; the events ingested meanwhile.
async fn pgbench_beside_ingest(
    options: &PgConnectOptions,
    clients: usize,
    seconds: u64,
    script: &str,
    tag: &str,
) -> u64 {
    let beside = IngestBeside::start(options, tag);
    let (bench_options, script) = (options.clone(), script.to_owned());
    tokio::task::spawn_blocking(move || {
        benchmarks::pgbench_tps(&bench_options, clients, seconds, &script)
    })
    .await
    .unwrap();
    beside.stop().await
}

async fn run_drainers(
    options: &PgConnectOptions,
    drainers: usize,
    minutes: u64,
    tag: &str,
) -> Vec<f64> {
    let processed = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let registry = Arc::new(EffectRegistry::standard());
    let mut tasks = Vec::new();
    for i in 0..drainers {
        let (processed, stop, registry) = (processed.clone(), stop.clone(), registry.clone());
        let options = options
            .clone()
            .application_name(&format!("bench-drainer-{i}"));
        tasks.push(tokio::spawn(async move {
            let pool = product_pool(options);
            let settings = shared::config::Vars::process()
                .drain()
                .expect("DRAIN_* settings");
            let drainer = Drainer::new(pool.clone(), registry, settings);
            // As `drain_until` does: one connection for the whole run.
            let mut conn = pool.acquire().await.unwrap();
            while !stop.load(Ordering::Relaxed) {
                let batch = drainer.run_once_on(&mut conn).await.unwrap();
                processed.fetch_add(batch.processed, Ordering::Relaxed);
                if batch.claimed == 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }));
    }
    let ingest = IngestBeside::start(options, tag);

    let mut per_minute = Vec::new();
    let mut last = 0;
    for minute in 1..=minutes {
        let start = Instant::now();
        tokio::time::sleep(Duration::from_secs(60)).await;
        let now = processed.load(Ordering::Relaxed);
        let rate = (now - last) as f64 / start.elapsed().as_secs_f64();
        last = now;
        let (waiting, _): (i64, f64) = shared::store::event_queue::backlog(&ingest.pool)
            .await
            .unwrap();
        println!(
            "    drainers={drainers} minute {minute}: {rate:>8.0} events/s ({waiting} still queued)"
        );
        // The drainers claim the oldest first: while the prefilled backlog lasts, every event
        // ingested beside them is still queued, behind it.
        let ingested = ingest.sent.load(Ordering::Relaxed);
        assert!(
            waiting as u64 > ingested,
            "the prefilled backlog ran out ({waiting} queued, {ingested} ingested meanwhile): the rate measured ingestion, not the drain; raise BENCH_BACKLOG"
        );
        per_minute.push(rate);
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    ingest.stop().await;
    per_minute
}

/// The drain's own writes with nothing else: pgbench claiming 100 queued events and, in one
/// statement per batch, writing what the drain writes for them (the versioned entity, its
/// outbox row, the queue row deleted, the event marked processed, the batch's latencies
/// recorded for the anomaly pass). No Rust, no round trips, no
/// savepoints, no planning per batch, no anomaly or lock-ordering pass: a floor under the
/// drain's cost on the same tables and backlog, run just before the drainers and just after,
/// with the same ingestion beside it (`tag` names the events it ingests, `fill_tag` those it
/// queues first).
async fn same_writes_in_sql(
    pool: &PgPool,
    options: &PgConnectOptions,
    clients: usize,
    seconds: u64,
    batch: i64,
    tag: &str,
    fill_tag: &str,
) -> f64 {
    let queued = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM event_queue")
            .fetch_one(pool)
            .await
            .unwrap()
    };
    // Started on a backlog as deep as the run can drain, from vacuumed tables, after the
    // drainers as before them (after them the queue and the event rows hold the dead rows the
    // drainers left, and what is left of the backlog may be short).
    fill_queue(pool, sql_depth(seconds), fill_tag).await;
    let before = queued().await;
    let script = format!(
        "BEGIN;\n\
        WITH c AS (SELECT q.tenant_id, q.external_id, e.entity_id, e.entity_version, e.payload, s.scheme \
            FROM event_queue AS q JOIN webhook_events AS e USING (tenant_id, external_id) JOIN sources AS s USING (source_id) \
            WHERE q.ready_at <= now() ORDER BY q.ready_at LIMIT {batch} FOR UPDATE OF q, e SKIP LOCKED), \
        applied AS (INSERT INTO entities AS cur (tenant_id, entity_type, entity_id, version, state, last_event_id) \
            SELECT tenant_id, 'item', entity_id, entity_version, convert_from(payload, 'UTF8')::jsonb, external_id FROM c \
            ORDER BY tenant_id, entity_id \
            ON CONFLICT (tenant_id, entity_type, entity_id) DO UPDATE SET version = EXCLUDED.version, \
                state = EXCLUDED.state, last_event_id = EXCLUDED.last_event_id, updated_at = now() \
            WHERE (cur.version, cur.last_event_id) < (EXCLUDED.version, EXCLUDED.last_event_id) \
            RETURNING tenant_id, entity_type, entity_id, version, deleted, last_event_id), \
        announced AS (INSERT INTO outbox (tenant_id, external_id, action, payload, idempotency_key) \
            SELECT tenant_id, last_event_id, 'entity.changed', jsonb_build_object('entity_type', entity_type, \
                'entity_id', entity_id, 'version', version, 'deleted', deleted), \
                encode(sha256(convert_to(tenant_id || '/' || last_event_id, 'UTF8')), 'hex') FROM applied \
            ON CONFLICT (tenant_id, external_id, action) DO NOTHING), \
        done AS (DELETE FROM event_queue AS q USING c \
            WHERE q.tenant_id = c.tenant_id AND q.external_id = c.external_id RETURNING q.tenant_id, q.external_id), \
        processed AS (UPDATE webhook_events AS e SET status = 'processed', processed_at = now(), attempts = e.attempts + 1, \
            last_error = NULL, expects = 'projection' \
            FROM done WHERE e.tenant_id = done.tenant_id AND e.external_id = done.external_id AND e.status = 'pending' \
            RETURNING e.first_received_at, EXTRACT(EPOCH FROM e.processed_at - e.received_at)::float8 AS seconds) \
        INSERT INTO processing_completions (completed_at, seconds) SELECT now(), array_agg(seconds) FROM processed \
            WHERE first_received_at >= now() - interval '1 day' HAVING count(*) > 0;\n\
        COMMIT;\n"
    );
    // Each event ingested beside it is new and queued: claimed as the backlog is, and
    // counted as the drainers' are.
    let ingested = pgbench_beside_ingest(options, clients, seconds, &script, tag).await;
    let after = queued().await;
    // The statement claims the oldest first: the events ingested beside it wait behind the
    // backlog, so once it ran out fewer than they are left.
    assert!(
        after > ingested as i64,
        "the backlog ran out under plain SQL ({after} queued, {ingested} ingested meanwhile): raise sql_depth"
    );
    // The drainers start from a vacuumed queue, as they would without this run.
    exec(pool, "VACUUM ANALYZE event_queue".into()).await;
    (before + ingested as i64 - after) as f64 / seconds as f64
}

/// The backlog a plain-SQL run of `seconds` starts on: more than it drains at the 21 000-25 000
/// rows/s one or two clients reached here.
fn sql_depth(seconds: u64) -> u64 {
    40_000 * seconds
}

/// `webhook_events`' heap, TOAST and index bytes: what the run grew them by is printed.
async fn event_sizes(pool: &PgPool) -> (i64, i64, i64, i64, i64) {
    // The drainers' backends report their counts as they go idle or close.
    tokio::time::sleep(Duration::from_secs(2)).await;
    sqlx::query_as(
        "SELECT pg_relation_size(c.oid), COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0), \
             pg_indexes_size(c.oid), s.n_tup_upd, s.n_tup_hot_upd \
         FROM pg_class AS c JOIN pg_stat_user_tables AS s ON s.relid = c.oid \
         WHERE c.oid = 'webhook_events'::regclass",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The raw limit: pgbench claiming and completing batches of the drain's size on a copy of the
/// queue table, with the same ingestion beside it (`tag` names the events it ingests).
async fn raw_claim_and_complete(
    pool: &PgPool,
    options: &PgConnectOptions,
    clients: usize,
    seconds: u64,
    rows: u64,
    batch: i64,
    tag: &str,
) -> f64 {
    exec(pool, "DROP TABLE IF EXISTS queue_copy".into()).await;
    exec(pool, "CREATE TABLE queue_copy (LIKE event_queue INCLUDING ALL) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 2000, autovacuum_vacuum_cost_delay = 0)".into()).await;
    exec(pool, format!("INSERT INTO queue_copy (tenant_id, external_id, ready_at, enqueued_at) SELECT 'bench', 'raw-' || g, now() - interval '1 hour' + g * interval '1 microsecond', now() FROM generate_series(1, {rows}) AS g")).await;
    exec(pool, "VACUUM ANALYZE queue_copy".into()).await;
    let script = format!(
        "BEGIN;\nWITH c AS (SELECT tenant_id, external_id FROM queue_copy WHERE ready_at <= now() \
        ORDER BY ready_at LIMIT {batch} FOR UPDATE SKIP LOCKED) \
        DELETE FROM queue_copy AS q USING c WHERE q.tenant_id = c.tenant_id AND q.external_id = c.external_id;\nCOMMIT;\n"
    );
    pgbench_beside_ingest(options, clients, seconds, &script, tag).await;
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM queue_copy")
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(left > 0, "the copy ran dry: prefill more rows");
    exec(pool, "DROP TABLE queue_copy".into()).await;
    (rows as i64 - left) as f64 / seconds as f64
}

#[tokio::main]
async fn main() {
    let minutes: u64 = std::env::var("BENCH_MINUTES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5)
        .max(2);
    let backlog: u64 = std::env::var("BENCH_BACKLOG")
        .ok()
        .and_then(|s| s.parse().ok())
        // What the drainers start on: more than they drain at 30 000 events/s (two drainers
        // reached 23 800 here, and left 120 000 of 2.9 M queued after two minutes).
        .unwrap_or(500_000 + 1_800_000 * minutes);
    let raw_seconds: u64 = 30;
    // Both limits take batches of the drain's size (DRAIN_BATCH_SIZE, 100 by default), so a
    // batch's fixed costs weigh alike on all three.
    let batch = shared::config::Vars::process()
        .drain()
        .expect("DRAIN_* settings")
        .batch_size;
    let db = benchmarks::BenchDatabase::create("bench_drain").await;
    let (pool, options) = (db.pool.clone(), db.options.clone());
    sources::apply(&pool, &[source()]).await.unwrap();

    println!(
        "drain: {minutes} min per run over a {backlog}-event backlog while ingesting {INGEST_PER_SECOND}/s; batches of {batch}; raw: pgbench claim-and-complete on a copy of event_queue, {raw_seconds} s"
    );
    let mut rows = Vec::new();
    let counts: Vec<usize> = std::env::var("BENCH_DRAINERS")
        .unwrap_or_else(|_| "1,2,4".into())
        .split(',')
        .map(|n| {
            n.trim()
                .parse()
                .expect("BENCH_DRAINERS: comma-separated counts")
        })
        .collect();
    for drainers in counts {
        let tag = format!("d{drainers}");
        clear(&pool).await;
        // One client claimed up to about 45 000 rows/s here, two over 66 000: room for 30 s.
        let raw_rows = 2_000_000 * drainers as u64;
        let raw_before = raw_claim_and_complete(
            &pool,
            &options,
            drainers,
            raw_seconds,
            raw_rows,
            batch,
            &format!("{tag}-raw-before"),
        )
        .await;
        let sql_before = same_writes_in_sql(
            &pool,
            &options,
            drainers,
            raw_seconds,
            batch,
            &format!("{tag}-sql-before"),
            &format!("b{drainers}"),
        )
        .await;
        // Ids as long as the other fills' ("d1-123", "b1-123"): rows of one width, as many
        // to a page (with ten rows a page at fillfactor 50, ids a few bytes longer made 8.5%
        // of completions leave the page; the table's pages are filled to 45% since).
        fill_queue(&pool, backlog, &tag).await;
        let sizes_before = event_sizes(&pool).await;
        let per_minute = run_drainers(&options, drainers, minutes, &tag).await;
        let sizes_after = event_sizes(&pool).await;
        let sql_after = same_writes_in_sql(
            &pool,
            &options,
            drainers,
            raw_seconds,
            batch,
            &format!("{tag}-sql-after"),
            &format!("a{drainers}"),
        )
        .await;
        let raw_after = raw_claim_and_complete(
            &pool,
            &options,
            drainers,
            raw_seconds,
            raw_rows,
            batch,
            &format!("{tag}-raw-after"),
        )
        .await;
        let (raw, sql) = (
            (raw_before + raw_after) / 2.0,
            (sql_before + sql_after) / 2.0,
        );
        let mean = per_minute.iter().sum::<f64>() / per_minute.len() as f64;
        // Printed as each run ends too, so a later run that fails does not lose this one.
        println!(
            "    drainers={drainers}: {mean:.0} events/s, raw {raw_before:.0} before and {raw_after:.0} after, mean {raw:.0} rows/s ({:.3}x), same writes in SQL {sql_before:.0} before and {sql_after:.0} after, mean {sql:.0} rows/s ({:.3}x)",
            mean / raw,
            mean / sql
        );
        rows.push((
            drainers,
            per_minute,
            mean,
            raw,
            sql,
            sizes_before,
            sizes_after,
        ));
    }
    println!();
    println!(
        "{:>8} {:>10} {:>10} {:>10} {:>10} {:>11} {:>8} {:>11} {:>8}",
        "drainers",
        "events/s",
        "first min",
        "last min",
        "last/first",
        "raw rows/s",
        "ratio",
        "sql rows/s",
        "vs sql"
    );
    for (drainers, per_minute, mean, raw, sql, _, _) in &rows {
        let (first, last) = (per_minute[0], *per_minute.last().unwrap());
        println!(
            "{drainers:>8} {mean:>10.0} {first:>10.0} {last:>10.0} {:>9.2}x {raw:>11.0} {:>7.3}x {sql:>11.0} {:>7.3}x",
            last / first,
            mean / raw,
            mean / sql
        );
    }
    println!(
        "ratio: the drain to raw claim-and-complete (the queue alone); vs sql: the drain to the same writes done by one SQL statement per batch; each limit the mean of its runs just before and just after the drainers, all with the same ingestion beside them"
    );
    println!();
    println!(
        "webhook_events over each drainers run (MB, before -> after; the run also ingests {INGEST_PER_SECOND}/s), its rows updated and the share of them updated in place (HOT):"
    );
    println!(
        "{:>8} {:>18} {:>18} {:>18} {:>10} {:>6}",
        "drainers", "heap", "toast", "indexes", "updates", "HOT"
    );
    let mb = |b: i64| b as f64 / (1 << 20) as f64;
    for (drainers, _, _, _, _, before, after) in &rows {
        let show = |b: i64, a: i64| format!("{:.1} -> {:.1}", mb(b), mb(a));
        let updates = after.3 - before.3;
        let hot = (after.4 - before.4) as f64 / updates.max(1) as f64;
        println!(
            "{drainers:>8} {:>18} {:>18} {:>18} {updates:>10} {:>5.1}%",
            show(before.0, after.0),
            show(before.1, after.1),
            show(before.2, after.2),
            100.0 * hot
        );
    }
    db.drop().await;
}
