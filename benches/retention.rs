//! Retention at a steady rate (issue 26, point 4): `webhook_events` ingests a fixed number of
//! events per simulated day, retention runs every simulated hour, and the table's heap, TOAST
//! and index sizes are printed at the end of each day. Once the identity horizon is reached,
//! as many events leave a day as arrive, so the sizes must level off: the run prints the last
//! day's size over the size on the day the horizon was reached (limit 1.10x), over the size ten
//! days before (the steady state: limit 1.02x), and what each day ingested beside what
//! retention purged.
//!
//! The heap takes one more step after the horizon (measured: days 34 to 39, about 10%), then
//! holds flat. Our reading, not measured page by page: at fillfactor 50 (45 since migration
//! 20261210000100) an insert goes only to a page with about half of it free besides the new
//! row, so pages keeping the payload-less rows of the month take new rows only once the
//! identity purge has emptied them.
//!
//! Time is compressed, not simulated: every timestamp is the server's real `now()`, and a day
//! lasts `BENCH_DAY_SECONDS` (4) real seconds, so the horizons are production's in days, made
//! seconds (payloads 7 days, identities 30: 28 s and 120 s of the run). The settings are built
//! directly: `RetentionSettings::validate` refuses an identity horizon under 4 days, which is
//! right for a deployment and would forbid this. No timestamp is rewritten (shifting every
//! row's times a day back, as `tests/lifecycle.rs` does, would itself rewrite the table a day
//! and measure that).
//!
//! Each simulated hour (a tick) inserts the events due since the last one at the fixed rate,
//! set-wise, received evenly over that interval: `BENCH_EVENTS_PER_DAY` (5 000) a day across
//! three sources, Stripe-like random ids, 1 KiB payloads, a small headers document; then
//! completes them as the drain would (status, attempts, `processed_at`: the second version of
//! each row, HOT on its page as in production); then runs one retention pass
//! (`retention::run_once`, with the 297 s an invocation has: it stops when nothing is past its
//! horizons, long before). Retention's batches are the default 5000 rows. A tick that overruns
//! delays the next; the events due are counted from the clock, so the rate holds. A day that
//! overran (`day s` above `BENCH_DAY_SECONDS`: the machine was busy) ingests more and is
//! vacuumed late, with more freed space to fill at once: the heap's high-water mark rises.
//!
//! Autovacuum is turned off on the table and an explicit `VACUUM (ANALYZE) webhook_events` runs
//! once at the end of each simulated day in its place: autovacuum looks at a database at most
//! once a minute (`autovacuum_naptime`), 15 simulated days at 4 s a day, so it could not keep
//! pace with compressed time, and whether it happened to run before a measurement would decide
//! the figures. In production it runs several times a day on this table (the
//! `events_dead_tuple_ratio` check breaches when it falls behind).
//!
//! The rate in real time is `BENCH_EVENTS_PER_DAY / BENCH_DAY_SECONDS` events a second (1 250
//! by default), retention purging as many once the horizon is reached: 12.5 times the issue's
//! 100 events/s. What one hourly run needs at 100 events/s is estimated from the share of the
//! run retention was busy, scaled from this rate to 100 events/s: printed beside the 297 s an
//! invocation has. It is an estimate: it counts each run's fixed cost (bookkeeping, one look
//! per purge) 24 times a simulated day, which overstates, on a table of 150 000 rows, where
//! production's at 100 events/s holds 259 M and its indexes are a level or two deeper.
//!
//! Run: `./scripts/bench retention` (`BENCH_DAYS`, default 50: twenty days past the horizon,
//! ten past that step; about 3.5 minutes; needs DATABASE_URL with the right to create a
//! database, dropped after).

use std::time::{Duration, Instant};

use shared::retention::{RetentionOutcome, RetentionSettings};
use sqlx::PgPool;

const PAYLOAD_DAYS: u64 = 7;
const IDENTITY_DAYS: u64 = 30;
const HOURS: u32 = 24;
/// The last day's size over the size when the horizon was reached, at most.
const LIMIT: f64 = 1.10;
/// The last day's size over the size ten days before, at most.
const STEADY_LIMIT: f64 = 1.02;
const STEADY_DAYS: usize = 10;

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn exec(pool: &PgPool, sql: &'static str) {
    sqlx::query(sql)
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Three Stripe sources of the tenant `bench`; no autovacuum on the events table.
async fn prepare(pool: &PgPool) {
    exec(
        pool,
        "INSERT INTO sources (source_id, tenant_id, scheme, secret_ref, external_id_from, event_type_from) \
         SELECT s, 'bench', 'stripe', 'bench', 'json:/id', 'json:/type' \
         FROM unnest(ARRAY['steady-1', 'steady-2', 'steady-3']) AS s",
    )
    .await;
    exec(
        pool,
        "ALTER TABLE webhook_events SET (autovacuum_enabled = false, toast.autovacuum_enabled = false)",
    )
    .await;
}

/// Inserts events `first + 1 ..= first + count`, received evenly over `(from, to]`, and
/// completes them as the drain does. Returns the server's `to`.
async fn ingest(
    pool: &PgPool,
    first: i64,
    count: i64,
    from: chrono::DateTime<chrono::Utc>,
) -> chrono::DateTime<chrono::Utc> {
    let to: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(pool)
        .await
        .unwrap();
    if count == 0 {
        return to;
    }
    sqlx::query(
        "INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, payload, payload_sha256, \
             headers, verified_with, received_at, first_received_at, last_seen_at, status, expects) \
         SELECT 'bench', 'evt_' || substr(md5(n::text), 1, 24), 'steady-' || (1 + n % 3), 'payment_intent.succeeded', \
                convert_to(repeat(md5(n::text), 32), 'UTF8'), sha256(convert_to(n::text, 'UTF8')), \
                jsonb_build_object('content-type', 'application/json', \
                    'stripe-signature', 't=1700000000,v1=' || encode(sha256(convert_to(n::text, 'UTF8')), 'hex')), \
                'current', t, t, t, 'pending', 'nothing' \
         FROM (SELECT $1 + i AS n, $3::timestamptz + ($4::timestamptz - $3::timestamptz) * i / $2 AS t \
               FROM generate_series(1, $2) AS i) AS g",
    )
    .bind(first)
    .bind(count)
    .bind(from)
    .bind(to)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE webhook_events SET status = 'processed', attempts = 1, \
             processed_at = first_received_at + interval '200 milliseconds' \
         WHERE first_received_at > $1 AND first_received_at <= $2 AND status = 'pending'",
    )
    .bind(from)
    .bind(to)
    .execute(pool)
    .await
    .unwrap();
    to
}

/// `webhook_events`' heap, TOAST (with its index) and index bytes, and its live rows.
async fn sizes(pool: &PgPool) -> [i64; 4] {
    let (heap, toast, indexes, rows): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT pg_relation_size(c.oid), COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0), \
             pg_indexes_size(c.oid), (SELECT count(*) FROM webhook_events) \
         FROM pg_class AS c WHERE c.oid = 'webhook_events'::regclass",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    [heap, toast, indexes, rows]
}

#[derive(Default)]
struct Day {
    ingested: i64,
    purged: RetentionOutcome,
    runs: u32,
    cut_short: u32,
    busy: Duration,
}

fn mb(bytes: i64) -> f64 {
    bytes as f64 / 1_048_576.0
}

#[tokio::main]
async fn main() {
    let day_seconds: f64 = env("BENCH_DAY_SECONDS", 4.0);
    let days: u64 = env("BENCH_DAYS", 50);
    let per_day: i64 = env("BENCH_EVENTS_PER_DAY", 5_000);
    assert!(
        days >= IDENTITY_DAYS + STEADY_DAYS as u64,
        "BENCH_DAYS must reach {STEADY_DAYS} days past the {IDENTITY_DAYS}-day identity horizon"
    );
    let day = Duration::from_secs_f64(day_seconds);
    let tick = day / HOURS;
    // Production's horizons in days, each day `day` long; `validate` would refuse them.
    let settings = RetentionSettings {
        payload_after: day * PAYLOAD_DAYS as u32,
        identity_after: day * IDENTITY_DAYS as u32,
        history_after: day * 90,
        replay_after: day * 400,
        ..Default::default()
    };

    let db = benchmarks::BenchDatabase::create("bench_retention").await;
    let pool = &db.pool;
    prepare(pool).await;
    println!(
        "{per_day} events a simulated day of {day_seconds} s ({:.0} events/s in real time), \
         retention every simulated hour ({} ms), payloads kept {PAYLOAD_DAYS} days, identities \
         {IDENTITY_DAYS}; VACUUM (ANALYZE) at the end of each day",
        per_day as f64 / day_seconds,
        tick.as_millis()
    );
    println!(
        "{:>4} {:>6} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>6} {:>8} {:>8}",
        "day",
        "day s",
        "ingested",
        "payloads",
        "purged",
        "rows",
        "heap MB",
        "toast MB",
        "index MB",
        "total MB",
        "runs",
        "busy ms",
        "vacuum ms"
    );

    let start = Instant::now();
    let mut from: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(pool)
        .await
        .unwrap();
    let mut inserted = 0i64;
    let mut totals = Day::default();
    let mut table: Vec<[i64; 4]> = Vec::new();
    let mut day_began = Instant::now();
    for d in 1..=days {
        let mut today = Day::default();
        for h in 1..=HOURS {
            let tick_end = start + day * (d as u32 - 1) + tick * h;
            tokio::time::sleep_until(tick_end.into()).await;
            // The events due at the fixed rate by now.
            let due = (per_day as f64 * start.elapsed().as_secs_f64() / day_seconds) as i64;
            let count = due - inserted;
            from = ingest(pool, inserted, count, from).await;
            inserted = due;
            today.ingested += count;
            let began = Instant::now();
            let run = shared::retention::run_once(pool, &settings, "bench")
                .await
                .unwrap();
            today.busy += began.elapsed();
            today.runs += 1;
            today.cut_short += u32::from(!run.cut_short.is_empty());
            today.purged.payloads_purged += run.payloads_purged;
            today.purged.identities_purged += run.identities_purged;
        }
        let began = Instant::now();
        exec(pool, "VACUUM (ANALYZE) webhook_events").await;
        let vacuum = began.elapsed();
        let size = sizes(pool).await;
        let length = day_began.elapsed();
        day_began = Instant::now();
        println!(
            "{d:>4} {:>6.1} {:>9} {:>9} {:>9} {:>9} {:>8.1} {:>8.2} {:>8.1} {:>8.1} {:>6} {:>8.0} {:>8.0}",
            length.as_secs_f64(),
            today.ingested,
            today.purged.payloads_purged,
            today.purged.identities_purged,
            size[3],
            mb(size[0]),
            mb(size[1]),
            mb(size[2]),
            mb(size[0] + size[1] + size[2]),
            format!(
                "{}{}",
                today.runs,
                if today.cut_short > 0 { "*" } else { "" }
            ),
            today.busy.as_secs_f64() * 1e3,
            vacuum.as_secs_f64() * 1e3
        );
        table.push(size);
        totals.ingested += today.ingested;
        totals.purged.payloads_purged += today.purged.payloads_purged;
        totals.purged.identities_purged += today.purged.identities_purged;
        totals.busy += today.busy;
        totals.cut_short += today.cut_short;
    }
    let elapsed = start.elapsed();

    let at_horizon = table[IDENTITY_DAYS as usize - 1];
    let last = table[table.len() - 1];
    let total = |s: [i64; 4]| s[0] + s[1] + s[2];
    println!(
        "\nday {days} against day {IDENTITY_DAYS} (the identity horizon): heap {:.3}x, indexes {:.3}x, \
         heap+TOAST+indexes {:.1} MB against {:.1} MB: {:.3}x (limit {LIMIT:.2}x)",
        last[0] as f64 / at_horizon[0] as f64,
        last[2] as f64 / at_horizon[2] as f64,
        mb(total(last)),
        mb(total(at_horizon)),
        total(last) as f64 / total(at_horizon) as f64
    );
    let before = table[table.len() - 1 - STEADY_DAYS];
    println!(
        "day {days} against day {} (steady): heap {:.3}x, indexes {:.3}x, heap+TOAST+indexes {:.3}x (limit {STEADY_LIMIT:.2}x)",
        days as usize - STEADY_DAYS,
        last[0] as f64 / before[0] as f64,
        last[2] as f64 / before[2] as f64,
        total(last) as f64 / total(before) as f64
    );
    let past = &table[IDENTITY_DAYS as usize..];
    let peak = past.iter().map(|s| total(*s)).max().unwrap_or(0);
    println!(
        "largest after the horizon: {:.1} MB ({:.3}x the horizon's); runs cut short by their time: {}",
        mb(peak),
        peak as f64 / total(at_horizon) as f64,
        totals.cut_short
    );
    println!(
        "ingested {} events, purged {} payloads and {} identities; {} events left, {} of {} days' worth",
        totals.ingested,
        totals.purged.payloads_purged,
        totals.purged.identities_purged,
        last[3],
        format_args!("{:.1}", last[3] as f64 / per_day as f64),
        IDENTITY_DAYS
    );
    // Retention's share of the run, at this rate in real time, scaled to 100 events/s.
    let share = totals.busy.as_secs_f64() / elapsed.as_secs_f64();
    let rate = per_day as f64 / day_seconds;
    let hourly = share * 3600.0 * 100.0 / rate;
    println!(
        "retention busy {:.1}% of the run at {rate:.0} events/s: at 100 events/s an hourly run would \
         need about {hourly:.0} s of the 297 s it has ({:.2}x)",
        share * 100.0,
        hourly / 297.0
    );
    db.drop().await;
}
