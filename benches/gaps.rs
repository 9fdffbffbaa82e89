//! Gap detection for windows of 10k, 100k and 1M expected IDs with 0.1% missing, over tables of
//! 1M and 5M events, beside the textbook anti-join on the same data in the same run. The
//! design reads one source's sequence index above its watermark (gaps-and-islands over the
//! rows present in the window); the textbook query left-joins every expected ID against the
//! whole primary key. Prints each time (best of 3) and the ratio textbook/design.
//!
//! Run: `./scripts/bench gaps` (needs DATABASE_URL with the right to create a database; builds
//! a 5M-row table, a few minutes and ~2 GB).

use std::time::{Duration, Instant};

use shared::domain::{FieldLocator, Scheme};
use shared::extract::FieldMap;
use shared::sources::{self, Source};
use shared::store::gaps;
use sqlx::{Executor, PgPool};

const TEMPLATE: &str = "evt_{seq}";
/// Every 1000th sequence number is missing: 0.1%.
const MISSING_EVERY: i64 = 1000;

fn source() -> Source {
    let mut fields = FieldMap::defaults_for(Scheme::Stripe);
    fields.sequence = Some(FieldLocator::json("/sequence"));
    Source {
        fields,
        ..benchmarks::source(Scheme::Stripe, Duration::from_secs(300))
    }
}

/// Grows the table to `rows` stored events (sequence numbers 1.. with every 1000th missing).
async fn grow_to(pool: &PgPool, rows: i64) {
    let have: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_events")
        .fetch_one(pool)
        .await
        .unwrap();
    let from_seq: i64 =
        sqlx::query_scalar("SELECT COALESCE(max(provider_sequence), 0) FROM webhook_events")
            .fetch_one(pool)
            .await
            .unwrap();
    let wanted = rows - have;
    if wanted <= 0 {
        return;
    }
    // Enough sequence numbers to store `wanted` rows with every 1000th skipped.
    let to_seq = from_seq + wanted + wanted / (MISSING_EVERY - 1) + 1;
    pool.execute(sqlx::AssertSqlSafe(format!(
        "INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, provider_sequence, payload_sha256, \
             verified_with, received_at, first_received_at, last_seen_at, status, processed_at) \
         SELECT 'bench', 'evt_' || s, 'bench', 'item.updated', s, sha256(convert_to(s::text, 'UTF8')), 'current', now(), now(), now(), 'processed', now() \
         FROM generate_series({}, {to_seq}) AS s WHERE s % {MISSING_EVERY} <> 0 LIMIT {wanted}",
        from_seq + 1
    )))
    .await
    .unwrap();
    pool.execute("VACUUM ANALYZE webhook_events").await.unwrap();
}

async fn best_of_3<F, Fut>(mut f: F) -> (Duration, usize)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = usize>,
{
    let mut best = Duration::MAX;
    let mut found = 0;
    for _ in 0..3 {
        let start = Instant::now();
        found = f().await;
        best = best.min(start.elapsed());
    }
    (best, found)
}

#[tokio::main]
async fn main() {
    let db = benchmarks::BenchDatabase::create("bench_gaps").await;
    let pool = db.pool.clone();
    sources::apply(&pool, &[source()]).await.unwrap();

    println!("gap detection: newest window of W expected IDs, 0.1% missing; best of 3");
    println!(
        "{:>10} {:>9} {:>8} {:>14} {:>14} {:>8}",
        "table", "window", "missing", "design ms", "textbook ms", "ratio"
    );
    for rows in [1_000_000i64, 5_000_000] {
        grow_to(&pool, rows).await;
        let top: i64 = sqlx::query_scalar("SELECT max(provider_sequence) FROM webhook_events")
            .fetch_one(&pool)
            .await
            .unwrap();
        for window in [10_000i64, 100_000, 1_000_000] {
            let after = top - window;
            let (design, found) = best_of_3(|| async {
                let g = gaps::sequence_gaps(&pool, "bench", after, top)
                    .await
                    .unwrap();
                g.gaps
                    .iter()
                    .map(|g| (g.gap_to - g.gap_from + 1) as usize)
                    .sum()
            })
            .await;
            let (textbook, textbook_found) = best_of_3(|| async {
                gaps::textbook_missing(&pool, "bench", TEMPLATE, after + 1, top)
                    .await
                    .unwrap()
                    .len()
            })
            .await;
            assert_eq!(found, textbook_found, "both must find the same gaps");
            println!(
                "{rows:>10} {window:>9} {found:>8} {:>14.1} {:>14.1} {:>7.1}x",
                design.as_secs_f64() * 1e3,
                textbook.as_secs_f64() * 1e3,
                textbook.as_secs_f64() / design.as_secs_f64()
            );
        }
    }
    db.drop().await;
}
