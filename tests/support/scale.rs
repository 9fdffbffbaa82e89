//! `webhook_events` and what hangs off it filled in production's shape with `generate_series`,
//! for the scale benchmark and the plan tests (issue 26): processed events inserted in time
//! order, spread evenly over 29 days, 1 KiB payloads for the last 7 (older ones purged), three
//! busy sources and four quiet ones (three that stopped 20 days ago, one that never sent);
//! entities, delivered outbox rows, open dead letters, tombstones, gap watermarks and the
//! drain's record of its last two hours' completions beside them, and a fixed backlog of
//! pending events in the queue.

use sqlx::PgPool;

/// The sources [`fill`] creates, busy first.
pub const BUSY_SOURCES: [&str; 3] = ["busy-1", "busy-2", "busy-3"];
pub const QUIET_SOURCES: [&str; 4] = ["quiet-1", "quiet-2", "quiet-3", "quiet-4"];
/// The tenant of every source [`fill`] creates.
pub const TENANT: &str = "scale";
/// Pending events queued by [`fill`], whatever the table's size.
pub const BACKLOG: i64 = 10_000;
/// Open dead letters [`fill`] leaves.
pub const DEAD_LETTERS: i64 = 100;

/// The source [`fill`] gives a provider sequence: `busy-1`'s events carry `provider_sequence`
/// 1, 2, 3, … in time order, every 1000th missing (0.1%), and its gap watermark stands
/// [`SEQUENCE_NEW_GROUND`] numbers below the highest, so a gap detection pass has that much new
/// ground to examine at every size.
pub const SEQUENCE_SOURCE: &str = "busy-1";
/// How far below `busy-1`'s highest sequence number [`fill`] leaves its watermark: one window
/// of the default gap settings.
pub const SEQUENCE_NEW_GROUND: i64 = 100_000;

/// Fills an empty, migrated database with `rows` processed events (plus [`BACKLOG`] pending and
/// [`DEAD_LETTERS`] dead-lettered ones) and analyzes it.
pub async fn fill(pool: &PgPool, rows: i64) {
    let statements: [&str; 8] = [
        "INSERT INTO sources (source_id, tenant_id, scheme, secret_ref, external_id_from, event_type_from, created_at) \
         SELECT s, 'scale', 'stripe', 'scale', 'json:/id', 'json:/type', now() - interval '60 days' \
         FROM unnest(ARRAY['busy-1','busy-2','busy-3','quiet-1','quiet-2','quiet-3','quiet-4']) AS s",
        // Processed events, one every 29 days / rows, oldest first; every 100th is a quiet
        // source's until 20 days ago. Every 20th was delivered twice, every 50th took two tries.
        // busy-1's events (every third) carry its sequence, i / 3, every 1000th number missing.
        "INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, entity_id, entity_version, payload, \
             payload_sha256, verified_with, received_at, first_received_at, last_seen_at, delivery_count, status, \
             attempts, processed_at, expects, provider_sequence) \
         SELECT 'scale', 'evt_' || i, \
                CASE WHEN i % 100 = 0 AND t < now() - interval '20 days' THEN 'quiet-' || (1 + (i / 100) % 3) \
                     ELSE 'busy-' || (1 + i % 3) END, \
                'thing.updated', 'ent-' || (i % 100000), i, \
                CASE WHEN t > now() - interval '7 days' THEN convert_to(repeat(md5(i::text), 32), 'UTF8') END, \
                sha256(convert_to(i::text, 'UTF8')), 'current', t, t, t, 1 + (i % 20 = 0)::int, 'processed', \
                1 + (i % 50 = 0)::int, t + interval '200 milliseconds', 'nothing', \
                CASE WHEN i % 3 = 0 AND NOT (i % 100 = 0 AND t < now() - interval '20 days') AND (i / 3) % 1000 <> 7 \
                     THEN i / 3 END \
         FROM (SELECT i, now() - interval '29 days' + (interval '29 days' - interval '30 minutes') * i / $1 AS t \
               FROM generate_series(1, $1) AS i) AS g",
        // Dead letters of the last day, open.
        "WITH e AS (UPDATE webhook_events SET status = 'dead_lettered', processed_at = NULL, last_error = 'effect refused' \
             WHERE tenant_id = 'scale' AND external_id IN \
               (SELECT 'evt_' || ($1 - i * 97) FROM generate_series(1, 100) AS i) \
             RETURNING tenant_id, external_id, source_id, event_type, payload, headers, attempts) \
         INSERT INTO dead_letters (tenant_id, external_id, source_id, event_type, payload, headers, error, reason, attempts) \
         SELECT tenant_id, external_id, source_id, event_type, payload, headers, 'effect refused', 'fatal', attempts FROM e",
        "INSERT INTO entities (tenant_id, entity_type, entity_id, version, state, last_event_id) \
         SELECT 'scale', 'thing', 'ent-' || i, $1 - 100000 + i, '{}'::jsonb, 'evt_' || ($1 - 100000 + i) \
         FROM generate_series(0, LEAST($1, 100000) - 1) AS i",
        // One delivered side effect for every tenth event.
        "INSERT INTO outbox (tenant_id, external_id, action, payload, idempotency_key, status, created_at, delivered_at) \
         SELECT 'scale', 'evt_' || i, 'notify', '{}'::jsonb, 'evt_' || i || ':notify', 'delivered', \
                now() - interval '29 days' + interval '29 days' * i / $1, \
                now() - interval '29 days' + interval '29 days' * i / $1 + interval '1 second' \
         FROM generate_series(10, $1, 10) AS i",
        // The drain's record of the last two hours' completions (what the anomaly pass keeps),
        // one row per 100 events, as its batches write them.
        "INSERT INTO processing_completions (completed_at, seconds) \
         SELECT max(processed_at), array_agg(EXTRACT(EPOCH FROM processed_at - received_at)::float8) \
         FROM (SELECT processed_at, received_at, row_number() OVER (ORDER BY first_received_at) AS n \
               FROM webhook_events WHERE first_received_at > now() - interval '2 hours' AND status = 'processed') AS p \
         GROUP BY n / 100",
        "INSERT INTO tombstones (tenant_id, external_id, source_id, reason, created_by) \
         SELECT 'scale', 'gone_' || i, 'busy-' || (1 + i % 3), 'never sent', 'backfill' FROM generate_series(1, 1000) AS i",
        "INSERT INTO gap_watermarks (source_id, contiguous_through, examined_through) \
         SELECT s, 0, 0 FROM unnest(ARRAY['busy-2','busy-3']) AS s",
    ];
    for sql in statements {
        let query = sqlx::query(sql);
        let query = if sql.contains("$1") {
            query.bind(rows)
        } else {
            query
        };
        query.execute(pool).await.expect("fill the scale database");
    }
    queue_backlog(pool, 0).await;
    let highest: i64 = sqlx::query_scalar(
        "SELECT max(provider_sequence) FROM webhook_events WHERE source_id = $1",
    )
    .bind(SEQUENCE_SOURCE)
    .fetch_one(pool)
    .await
    .expect("the sequence source's highest number");
    let watermark = shared::store::gaps::Watermark {
        contiguous_through: highest - SEQUENCE_NEW_GROUND,
        examined_through: highest - SEQUENCE_NEW_GROUND,
    };
    shared::store::gaps::raise_watermark(pool, SEQUENCE_SOURCE, watermark)
        .await
        .expect("the sequence source's watermark");
    sqlx::query("VACUUM ANALYZE")
        .execute(pool)
        .await
        .expect("vacuum analyze the scale database");
}

/// Queues [`BACKLOG`] more pending events of the last 20 minutes, each with its queue row:
/// round 0 is [`fill`]'s (`pending_1` …), each later round the next [`BACKLOG`] numbers, so the
/// drain of a backlog can be timed again on the same table.
pub async fn queue_backlog(pool: &PgPool, round: i64) {
    const SQL: &str = "WITH e AS ( \
             INSERT INTO webhook_events (tenant_id, external_id, source_id, event_type, payload, payload_sha256, \
                 verified_with, received_at, first_received_at, last_seen_at, status) \
             SELECT 'scale', 'pending_' || n, 'busy-' || (1 + i % 3), 'thing.updated', \
                    convert_to(repeat(md5(i::text), 32), 'UTF8'), sha256(convert_to('pending_' || n, 'UTF8')), 'current', \
                    now() - interval '20 minutes' + interval '120 milliseconds' * i, \
                    now() - interval '20 minutes' + interval '120 milliseconds' * i, \
                    now() - interval '20 minutes' + interval '120 milliseconds' * i, 'pending' \
             FROM generate_series(1, $1) AS i, LATERAL (SELECT $2 * $1 + i AS n) AS numbered \
             RETURNING tenant_id, external_id, first_received_at) \
         INSERT INTO event_queue (tenant_id, external_id, ready_at, enqueued_at) \
         SELECT tenant_id, external_id, first_received_at, first_received_at FROM e";
    sqlx::query(SQL)
        .bind(BACKLOG)
        .bind(round)
        .execute(pool)
        .await
        .expect("queue a backlog");
}
