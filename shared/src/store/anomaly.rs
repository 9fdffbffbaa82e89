//! The anomaly checks' reads: one statement per check, each returning one number (NULL when
//! there is nothing to measure), bounded by an index or by a small table; the materialized
//! view they read (the hourly delivery figures are [`super::delivery_hours`]); and the results
//! table.

use sqlx::PgPool;

use super::StoreError;

/// A check over the whole system, with its expected range (`None`: unbounded on that side).
#[derive(Debug, Clone, Copy)]
pub struct GlobalCheck {
    pub name: &'static str,
    pub family: &'static str,
    pub sql: &'static str,
    pub low: Option<f64>,
    pub high: Option<f64>,
}

const fn check(
    name: &'static str,
    family: &'static str,
    sql: &'static str,
    low: Option<f64>,
    high: Option<f64>,
) -> GlobalCheck {
    GlobalCheck {
        name,
        family,
        sql,
        low,
        high,
    }
}

const ZERO: (Option<f64>, Option<f64>) = (Some(0.0), Some(0.0));

/// Measured before the views are refreshed.
pub const VIEW_REFRESH_AGE: GlobalCheck = check(
    "views_refresh_age_seconds",
    "machinery",
    "SELECT EXTRACT(EPOCH FROM now() - min(refreshed_at))::float8 FROM view_refreshes",
    Some(0.0),
    Some(1800.0),
);

/// Every other global check, measured after the refresh. Ranges are the defaults; flow per
/// source is judged against the source's own history instead (see [`source_flow`]).
pub const GLOBAL_CHECKS: &[GlobalCheck] = &[
    // Latency.
    check(
        "processing_p50_seconds",
        "latency",
        "SELECT p50_seconds::float8 FROM processing_latency",
        Some(0.0),
        Some(60.0),
    ),
    check(
        "processing_p95_seconds",
        "latency",
        "SELECT p95_seconds::float8 FROM processing_latency",
        Some(0.0),
        Some(300.0),
    ),
    check(
        "processing_p99_seconds",
        "latency",
        "SELECT p99_seconds::float8 FROM processing_latency",
        Some(0.0),
        Some(900.0),
    ),
    check(
        "oldest_pending_age_seconds",
        "latency",
        "SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(enqueued_at)), 0)::float8 FROM event_queue WHERE ready_at <= now()",
        Some(0.0),
        Some(900.0),
    ),
    check(
        "backlog_events",
        "latency",
        "SELECT count(*)::float8 FROM event_queue",
        Some(0.0),
        Some(50_000.0),
    ),
    check(
        "backlog_growth_events",
        "latency",
        "SELECT ((SELECT count(*) FROM event_queue) - r.value)::float8 FROM anomaly_results AS r \
         WHERE r.check_name = 'backlog_events' ORDER BY r.run_id DESC LIMIT 1",
        None,
        Some(10_000.0),
    ),
    // Referential.
    check(
        "pending_outbox_without_event",
        "referential",
        "SELECT count(*)::float8 FROM outbox AS o WHERE o.status = 'pending' AND NOT EXISTS \
         (SELECT 1 FROM webhook_events AS e WHERE e.tenant_id = o.tenant_id AND e.external_id = o.external_id)",
        ZERO.0,
        ZERO.1,
    ),
    check(
        "open_dead_letters_for_live_events",
        "referential",
        "SELECT count(*)::float8 FROM dead_letters AS d JOIN webhook_events AS e USING (tenant_id, external_id) \
         WHERE d.status IN ('new', 'investigating') AND e.status <> 'dead_lettered'",
        ZERO.0,
        ZERO.1,
    ),
    check(
        "tombstoned_but_stored",
        "referential",
        "SELECT count(*)::float8 FROM tombstones AS t WHERE EXISTS \
         (SELECT 1 FROM webhook_events AS e WHERE e.tenant_id = t.tenant_id AND e.external_id = t.external_id)",
        ZERO.0,
        ZERO.1,
    ),
    check(
        "queued_but_not_pending",
        "referential",
        // Each queue row's event looked up by its key (LATERAL ... LIMIT 1 keeps it a lookup):
        // as a plain join, a table larger than the server's cache was planned as a hash join
        // over a sequential scan of webhook_events (tests/scale_plans.rs).
        "SELECT count(*)::float8 FROM event_queue AS q \
         CROSS JOIN LATERAL (SELECT e.status FROM webhook_events AS e \
             WHERE e.tenant_id = q.tenant_id AND e.external_id = q.external_id LIMIT 1) AS e \
         WHERE e.status <> 'pending' AND NOT (q.repair AND e.status = 'processed')",
        ZERO.0,
        ZERO.1,
    ),
    // Issue 26: these two are counted by the anomaly run's sweep of the last day's events, a
    // bounded window per run (super::consistency_sweep says how): the faulty events it found
    // and has not found repaired since.
    check(
        "pending_without_queue_row",
        "referential",
        super::consistency_sweep::COUNT_PENDING_WITHOUT_QUEUE_ROW,
        ZERO.0,
        ZERO.1,
    ),
    check(
        "processed_without_projection",
        "referential",
        super::consistency_sweep::COUNT_PROCESSED_WITHOUT_PROJECTION,
        ZERO.0,
        ZERO.1,
    ),
    check(
        "paid_orders_without_fulfilment",
        "referential",
        "SELECT count(*)::float8 FROM orders AS p WHERE p.state = 'paid' AND p.paid_at < now() - interval '10 minutes' \
         AND EXISTS (SELECT 1 FROM webhook_events AS e WHERE e.tenant_id = p.tenant_id AND e.external_id = p.paid_by_event \
                     AND e.first_received_at <= p.paid_at) \
         AND NOT EXISTS (SELECT 1 FROM outbox AS o WHERE o.tenant_id = p.tenant_id AND o.external_id = p.paid_by_event \
                         AND o.action = 'fulfil_order')",
        ZERO.0,
        ZERO.1,
    ),
    check(
        "stale_gap_candidates",
        "referential",
        "SELECT count(*)::float8 FROM gap_candidates WHERE status = 'open' AND first_seen_at < now() - interval '1 day'",
        ZERO.0,
        ZERO.1,
    ),
    // Integrity and security.
    check(
        "digest_conflicts_last_hour",
        "integrity",
        "SELECT count(*)::float8 FROM ingest_anomalies WHERE kind = 'digest_conflict' AND COALESCE(last_seen_at, detected_at) > now() - interval '1 hour'",
        ZERO.0,
        ZERO.1,
    ),
    check(
        "unreadable_deliveries_last_hour",
        "integrity",
        "SELECT count(*)::float8 FROM ingest_anomalies WHERE kind IN ('unparseable_payload', 'missing_field', 'invalid_field') \
         AND detail NOT LIKE 'buffered delivery %' AND detected_at > now() - interval '1 hour'",
        ZERO.0,
        ZERO.1,
    ),
    // A delivery the SQS buffer took (answered 200 `buffered`) that the consumer could not
    // file: its fields unreadable by the source's field map by then (`FROM_THE_BUFFER`), or,
    // recorded by releases before such deliveries were filed, its source disabled meanwhile.
    // The provider will not send it again: `hookctl buffer file-kept` files it once fixed.
    check(
        "unfilable_buffered_deliveries_last_day",
        "integrity",
        "SELECT count(*)::float8 FROM ingest_anomalies \
         WHERE (kind = 'buffered_source_unavailable' \
                OR (kind IN ('unparseable_payload', 'missing_field', 'invalid_field') \
                    AND detail LIKE 'buffered delivery %')) \
           AND filed_at IS NULL AND detected_at > now() - interval '1 day'",
        ZERO.0,
        ZERO.1,
    ),
    // A provider said something about a subscription rather than sending an event of it
    // (Twitch's revocation: its events have stopped until it is created again).
    check(
        "provider_notices_last_day",
        "flow",
        "SELECT count(*)::float8 FROM provider_notices WHERE received_at > now() - interval '1 day'",
        ZERO.0,
        ZERO.1,
    ),
    // Issue 50: a signed delivery from outside its provider's published address ranges (a
    // source's secret used from elsewhere, or a provider sending from a range its list lacks):
    // the addresses seen in the last day, admitted (observe) or refused (enforce).
    check(
        "addresses_outside_provider_ranges_last_day",
        "integrity",
        "SELECT count(*)::float8 FROM deliveries_outside_ranges WHERE last_seen_at > now() - interval '1 day'",
        ZERO.0,
        ZERO.1,
    ),
    check(
        "redelivered_after_purge_last_day",
        "integrity",
        "SELECT count(*)::float8 FROM ingest_anomalies WHERE kind = 'redelivered_after_purge' AND detected_at > now() - interval '1 day'",
        ZERO.0,
        ZERO.1,
    ),
    check(
        "replayed_bodies_last_day",
        "integrity",
        "SELECT count(*)::float8 FROM ingest_anomalies WHERE kind = 'replayed_body' AND COALESCE(last_seen_at, detected_at) > now() - interval '1 day'",
        ZERO.0,
        ZERO.1,
    ),
    check(
        "source_collisions_last_day",
        "integrity",
        "SELECT count(*)::float8 FROM ingest_anomalies WHERE kind = 'source_collision' AND COALESCE(last_seen_at, detected_at) > now() - interval '1 day'",
        ZERO.0,
        ZERO.1,
    ),
    check(
        "ambiguous_versions_last_day",
        "integrity",
        "SELECT count(*)::float8 FROM ingest_anomalies WHERE kind = 'ambiguous_version' AND detected_at > now() - interval '1 day'",
        ZERO.0,
        ZERO.1,
    ),
    check(
        "amount_mismatches_last_day",
        "integrity",
        "SELECT count(*)::float8 FROM payment_exceptions WHERE kind IN ('amount_mismatch', 'currency_mismatch') \
         AND detected_at > now() - interval '1 day'",
        ZERO.0,
        ZERO.1,
    ),
    check(
        "reference_mismatches_last_day",
        "integrity",
        "SELECT count(*)::float8 FROM payment_exceptions WHERE kind IN ('reference_mismatch', 'gateway_mismatch', 'unmappable_event') \
         AND detected_at > now() - interval '1 day'",
        ZERO.0,
        ZERO.1,
    ),
    check(
        "unknown_orders_last_day",
        "integrity",
        "SELECT count(*)::float8 FROM payment_exceptions WHERE kind = 'unknown_order' AND detected_at > now() - interval '1 day'",
        ZERO.0,
        ZERO.1,
    ),
    check(
        "duplicate_payments_last_day",
        "integrity",
        "SELECT count(*)::float8 FROM payment_exceptions WHERE kind IN ('already_paid', 'invalid_state') \
         AND detected_at > now() - interval '1 day'",
        ZERO.0,
        ZERO.1,
    ),
    check(
        "semantic_duplicates_last_day",
        "integrity",
        // Changes (tenant, source, event type, entity, version, tie-break) with two or more
        // events first received in the last day, as of the pass's rollup: each such change's
        // second event in the day, kept by the rollup (super::recent_changes says how).
        "SELECT count(*)::float8 FROM recent_changes WHERE previous_at > now() - interval '1 day' \
           AND (before_previous_at IS NULL OR before_previous_at <= now() - interval '1 day')",
        ZERO.0,
        ZERO.1,
    ),
    // Flow, over all sources.
    check(
        "duplicate_rate_last_day",
        "flow",
        "SELECT (sum(redeliveries)::float8 / NULLIF(sum(events), 0)) FROM delivery_hours WHERE hour >= now() - interval '1 day'",
        Some(0.0),
        Some(0.5),
    ),
    check(
        "retry_rate_last_day",
        "flow",
        "SELECT (sum(retried)::float8 / NULLIF(sum(events), 0)) FROM delivery_hours WHERE hour >= now() - interval '1 day'",
        Some(0.0),
        Some(0.05),
    ),
    check(
        "provider_retry_rate_last_day",
        "flow",
        "SELECT (sum(provider_retries)::float8 / NULLIF(sum(events), 0)) FROM delivery_hours WHERE hour >= now() - interval '1 day'",
        Some(0.0),
        Some(0.05),
    ),
    check(
        "backfill_rate_last_day",
        "flow",
        "SELECT (sum(backfilled)::float8 / NULLIF(sum(events), 0)) FROM delivery_hours WHERE hour >= now() - interval '1 day'",
        Some(0.0),
        Some(0.02),
    ),
    check(
        "conflict_rate_last_day",
        "flow",
        "SELECT (sum(conflicts)::float8 / NULLIF(sum(events), 0)) FROM delivery_hours WHERE hour >= now() - interval '1 day'",
        Some(0.0),
        Some(0.001),
    ),
    check(
        "dead_letters_last_hour",
        "flow",
        "SELECT count(*)::float8 FROM dead_letters WHERE created_at > now() - interval '1 hour'",
        ZERO.0,
        ZERO.1,
    ),
    // Machinery.
    check(
        "last_reconcile_age_seconds",
        "machinery",
        "SELECT EXTRACT(EPOCH FROM now() - max(finished_at))::float8 FROM maintenance_runs WHERE job = 'reconcile' AND status = 'completed'",
        Some(0.0),
        Some(2700.0),
    ),
    check(
        "last_backfill_age_seconds",
        "machinery",
        "SELECT EXTRACT(EPOCH FROM now() - max(finished_at))::float8 FROM maintenance_runs WHERE job = 'backfill' AND status = 'completed' \
         AND EXISTS (SELECT 1 FROM sources WHERE gap_strategy IS NOT NULL AND enabled)",
        Some(0.0),
        Some(1800.0),
    ),
    check(
        "last_retention_age_seconds",
        "machinery",
        "SELECT EXTRACT(EPOCH FROM now() - max(finished_at))::float8 FROM maintenance_runs WHERE job = 'retention' AND status = 'completed'",
        Some(0.0),
        Some(3.0 * 3600.0),
    ),
    // Issue 26: retention falling behind. How long the oldest event the identity purge may
    // delete has been past the horizon (the horizon the latest completed retention run purged
    // to, from its run row): an hourly run leaves at most about an hour's, so three hours mean
    // runs cut short by their time, failing, or not running. A walk of the time index from the
    // oldest event, over those retention keeps (open dead letters, undecided outbox rows,
    // queued or pending events: few) to the first it may delete.
    check(
        "identity_purge_lag_seconds",
        "machinery",
        concat!(
            "WITH h AS (SELECT (found->>'identity_horizon_seconds')::float8 AS secs FROM maintenance_runs \
                 WHERE job = 'retention' AND status = 'completed' AND found->>'identity_horizon_seconds' IS NOT NULL \
                 ORDER BY run_id DESC LIMIT 1) \
             SELECT COALESCE((SELECT EXTRACT(EPOCH FROM now() - make_interval(secs => h.secs) - e.first_received_at)::float8 \
                 FROM webhook_events AS e WHERE ",
            super::retention::identity_purgeable!("h.secs"),
            " ORDER BY e.first_received_at LIMIT 1), 0)::float8 FROM h"
        ),
        Some(0.0),
        Some(3.0 * 3600.0),
    ),
    check(
        "maintenance_lock_held_seconds",
        "machinery",
        "SELECT COALESCE(max(EXTRACT(EPOCH FROM now() - a.query_start)), 0)::float8 \
         FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid) \
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND ((l.classid::bigint << 32) | l.objid::bigint) IN (8243104023216089452, 7089056601388706924)",
        Some(0.0),
        Some(1800.0),
    ),
    // The events above a watermark are read through the sequence index, per watermark, newest
    // number first (the first to have arrived after the watermark stopped): the `OFFSET 0`
    // subquery keeps the time condition out of the index's choice, and its order makes the
    // index the plan that answers at its first row. As one EXISTS it was planned, for a table
    // larger than the cache, as a bitmap of every sequence source's events (a read that grows
    // with history), as the time index filtered on the source, or as a sequential scan
    // (tests/scale_plans.rs).
    check(
        "stalled_gap_watermarks",
        "machinery",
        "SELECT count(*)::float8 FROM gap_watermarks AS w JOIN sources AS s USING (source_id) \
         WHERE s.enabled AND s.gap_strategy = 'sequence' \
           AND w.advanced_at < now() - make_interval(secs => s.gap_grace_seconds) - interval '1 hour' \
           AND EXISTS (SELECT 1 FROM ( \
                           SELECT e.first_received_at FROM webhook_events AS e \
                           WHERE e.source_id = w.source_id AND e.provider_sequence > w.contiguous_through \
                           ORDER BY e.provider_sequence DESC OFFSET 0) AS above \
                       WHERE above.first_received_at > w.advanced_at)",
        ZERO.0,
        ZERO.1,
    ),
    check(
        "truncated_gap_listings",
        "machinery",
        "SELECT COALESCE(jsonb_array_length(found->'truncated_listings'), 0)::float8 FROM maintenance_runs \
         WHERE job = 'backfill' AND status = 'completed' ORDER BY run_id DESC LIMIT 1",
        ZERO.0,
        ZERO.1,
    ),
    // Issue 50: a provider's published address list that a checking source needs and the
    // ranges pass has not read for longer than the staleness limit (or never, though it
    // tried): no delivery of it is judged, so `enforce` refuses nothing and `observe` counts
    // nothing. A list the pass never tried has no row (`hookctl providers ranges` says so).
    check(
        "provider_ranges_stale",
        "machinery",
        concat!(
            "SELECT count(*)::float8 FROM provider_address_ranges AS r \
             WHERE (r.fetched_at IS NULL OR r.fetched_at < now() - make_interval(secs => ",
            super::provider_address_ranges::stale_after_seconds!(),
            ")) AND EXISTS (SELECT 1 FROM sources AS s WHERE s.enabled AND s.scheme = r.provider \
                 AND s.address_check IS DISTINCT FROM 'off')"
        ),
        ZERO.0,
        ZERO.1,
    ),
    check(
        "queue_dead_tuples",
        "machinery",
        "SELECT n_dead_tup::float8 FROM pg_stat_user_tables WHERE relname = 'event_queue' AND schemaname = current_schema()",
        Some(0.0),
        Some(500_000.0),
    ),
    // Dead rows beyond autovacuum's own base threshold (50), per live row: above 0.2 exactly
    // when autovacuum's trigger (50 + 20% of live rows) has been passed and it has not run. A
    // young table's few dozen completions and redeliveries are no breach.
    check(
        "events_dead_tuple_ratio",
        "machinery",
        "SELECT (GREATEST(n_dead_tup - 50, 0)::float8 / GREATEST(n_live_tup, 1)) FROM pg_stat_user_tables \
         WHERE relname = 'webhook_events' AND schemaname = current_schema()",
        Some(0.0),
        Some(0.2),
    ),
    check(
        "longest_open_transaction_seconds",
        "machinery",
        "SELECT COALESCE(max(EXTRACT(EPOCH FROM now() - xact_start)), 0)::float8 FROM pg_stat_activity \
         WHERE datname = current_database() AND xact_start IS NOT NULL AND state <> 'idle' AND pid <> pg_backend_pid()",
        Some(0.0),
        Some(300.0),
    ),
    check(
        "outbox_failed_rows",
        "machinery",
        "SELECT count(*)::float8 FROM outbox WHERE status = 'failed'",
        ZERO.0,
        ZERO.1,
    ),
    check(
        "outbox_overdue_rows",
        "machinery",
        "SELECT count(*)::float8 FROM outbox WHERE status = 'pending' AND created_at < now() - interval '1 hour'",
        ZERO.0,
        ZERO.1,
    ),
    // Issue 23: every fault seen by two layers.
    // What reconcile re-queued in the last day because something was lost (a queue row, an
    // effect, an outbox row): reconcile repairs it, and without this check nobody would hear
    // of the bug that keeps losing it. Counted from the runs' own records, failed runs too (a
    // pass records its repairs before it drains them). Reading it pages on-call only (see
    // `anomaly::ON_CALL_ONLY`): reconcile just made the repair.
    check(
        "reconcile_repairs_last_day",
        "referential",
        "SELECT COALESCE(sum(CASE WHEN jsonb_typeof(repaired->'requeued') = 'number' \
            THEN (repaired->>'requeued')::float8 END), 0)::float8 \
         FROM maintenance_runs WHERE job = 'reconcile' AND started_at > now() - interval '1 day'",
        ZERO.0,
        ZERO.1,
    ),
    // Delivery trouble before it is final: messages whose last two tries or more failed (a
    // target down fails every message at its first two tries within two minutes), and the age of
    // the oldest undelivered message (the outbox runs every minute, so a healthy one is under a
    // minute or two old). A message tried 10 times fails for good, at the earliest about 9
    // minutes after its first try (one try per 1-minute run), typically 15 to 25.
    check(
        "outbox_retrying_messages",
        "latency",
        "SELECT count(*)::float8 FROM outbox WHERE status = 'pending' AND attempts >= 2",
        ZERO.0,
        ZERO.1,
    ),
    // A paused subscription's messages (parked: due never) wait by an operator's decision or
    // its subscriber's 410; they are counted below, not as late.
    check(
        "outbox_oldest_undelivered_seconds",
        "latency",
        "SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8 FROM outbox \
         WHERE status = 'pending' AND next_attempt_at < 'infinity'",
        Some(0.0),
        Some(OUTBOX_OLDEST_UNDELIVERED_LIMIT_SECONDS),
    ),
    // Subscriptions: the oldest message a running subscription has not delivered (its
    // subscriber down, slow, or refusing), and the subscriptions their subscriber paused by
    // answering 410 Gone: someone must ask it and resume or remove the subscription.
    check(
        "subscription_oldest_undelivered_seconds",
        "latency",
        "SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8 FROM outbox \
         WHERE status = 'pending' AND action LIKE 'event:%' AND next_attempt_at < 'infinity'",
        Some(0.0),
        Some(OUTBOX_OLDEST_UNDELIVERED_LIMIT_SECONDS),
    ),
    check(
        "subscriptions_paused_by_gone",
        "machinery",
        "SELECT count(*)::float8 FROM subscription_pauses WHERE actor = 'outbox:410-gone'",
        ZERO.0,
        ZERO.1,
    ),
    // Pinned client certificates of partners, seen in their requests, that expire within 30
    // days: after that the partner's requests fail TLS or are refused.
    check(
        "partner_certificates_expiring",
        "machinery",
        "SELECT count(*)::float8 FROM partner_certificates AS c JOIN sources AS s USING (source_id) \
         WHERE s.enabled AND c.not_after < now() + interval '30 days' \
           AND EXISTS (SELECT 1 FROM jsonb_array_elements_text(s.partner -> 'client_certificates') AS p \
                       WHERE p = encode(c.sha256, 'hex'))",
        ZERO.0,
        ZERO.1,
    ),
];

// Issue 23.
/// The oldest undelivered outbox message's expected age at most: four missed 1-minute outbox
/// runs. The `outbox-delivery-delayed` alarm in template.yaml has the same threshold.
pub const OUTBOX_OLDEST_UNDELIVERED_LIMIT_SECONDS: f64 = 240.0;

pub async fn measure(pool: &PgPool, check: &GlobalCheck) -> Result<Option<f64>, StoreError> {
    Ok(sqlx::query_scalar::<_, Option<f64>>(check.sql)
        .fetch_optional(pool)
        .await?
        .flatten())
}

/// Refreshes the checks' view without blocking its readers, and records when. The hourly
/// delivery figures are a rollup kept by [`super::delivery_hours::roll`], which records its own
/// refresh under the view's old name, `delivery_hourly`.
///
/// `processing_latency` reads the latencies the drain recorded in `processing_completions`
/// over the last hour ([`super::processing_completions`]); older rows are forgotten here first.
pub async fn refresh_views(pool: &PgPool) -> Result<(), StoreError> {
    super::processing_completions::forget_old(
        pool,
        super::processing_completions::ANOMALY_RUN_FORGETS_AT_MOST,
    )
    .await?;
    sqlx::query("REFRESH MATERIALIZED VIEW CONCURRENTLY processing_latency")
        .execute(pool)
        .await?;
    sqlx::query(
        "INSERT INTO view_refreshes (view_name, refreshed_at) VALUES ('processing_latency', now()) \
         ON CONFLICT (view_name) DO UPDATE SET refreshed_at = EXCLUDED.refreshed_at",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// A source's events in the last complete hour beside the same hour of the week in the (up to)
/// four weeks before, counting only weeks after the source was created.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct SourceFlow {
    pub source_id: String,
    pub last_hour: f64,
    pub mean: Option<f64>,
    pub stddev: Option<f64>,
    pub weeks: i64,
}

pub async fn source_flow(pool: &PgPool) -> Result<Vec<SourceFlow>, StoreError> {
    const SQL: &str = "WITH last AS (SELECT date_trunc('hour', now()) - interval '1 hour' AS hour), \
         history AS ( \
             SELECT s.source_id, COALESCE(d.events, 0) AS events \
             FROM sources AS s CROSS JOIN last CROSS JOIN generate_series(1, 4) AS w \
             LEFT JOIN delivery_hours AS d ON d.source_id = s.source_id AND d.hour = last.hour - make_interval(weeks => w) \
             WHERE s.enabled AND s.created_at <= last.hour - make_interval(weeks => w)) \
         SELECT s.source_id, COALESCE(c.events, 0)::float8 AS last_hour, \
                avg(h.events)::float8 AS mean, stddev_samp(h.events)::float8 AS stddev, count(h.events) AS weeks \
         FROM sources AS s CROSS JOIN last \
         LEFT JOIN delivery_hours AS c ON c.source_id = s.source_id AND c.hour = last.hour \
         LEFT JOIN history AS h ON h.source_id = s.source_id \
         WHERE s.enabled \
         GROUP BY s.source_id, c.events ORDER BY s.source_id";
    Ok(sqlx::query_as(SQL).fetch_all(pool).await?)
}

/// One check's outcome, as stored in `anomaly_results`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CheckResult {
    pub check_name: String,
    pub family: &'static str,
    pub subject: String,
    pub value: Option<f64>,
    pub expected_low: Option<f64>,
    pub expected_high: Option<f64>,
    pub breached: bool,
    pub detail: String,
}

pub async fn record(pool: &PgPool, run_id: i64, results: &[CheckResult]) -> Result<(), StoreError> {
    const SQL: &str = "INSERT INTO anomaly_results (run_id, check_name, family, subject, value, expected_low, expected_high, breached, detail) \
         SELECT $1, * FROM unnest($2::text[], $3::text[], $4::text[], $5::float8[], $6::float8[], $7::float8[], $8::bool[], $9::text[])";
    let col = |f: fn(&CheckResult) -> String| results.iter().map(f).collect::<Vec<_>>();
    let num = |f: fn(&CheckResult) -> Option<f64>| results.iter().map(f).collect::<Vec<_>>();
    sqlx::query(SQL)
        .bind(run_id)
        .bind(col(|r| r.check_name.clone()))
        .bind(col(|r| r.family.to_owned()))
        .bind(col(|r| r.subject.clone()))
        .bind(num(|r| r.value))
        .bind(num(|r| r.expected_low))
        .bind(num(|r| r.expected_high))
        .bind(results.iter().map(|r| r.breached).collect::<Vec<_>>())
        .bind(col(|r| r.detail.clone()))
        .execute(pool)
        .await?;
    Ok(())
}

/// A stored check result of the latest anomaly run.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct StoredResult {
    pub run_id: i64,
    pub measured_at: chrono::DateTime<chrono::Utc>,
    pub check_name: String,
    pub family: String,
    pub subject: String,
    pub value: Option<f64>,
    pub expected_low: Option<f64>,
    pub expected_high: Option<f64>,
    pub breached: bool,
    pub detail: String,
}

/// One check's results over its latest `runs` anomaly runs, newest first: its history (the
/// console's chart). Walks the newest runs by `maintenance_runs_by_job` and reads each one's
/// result by the primary key.
pub async fn check_history(
    executor: impl sqlx::PgExecutor<'_>,
    check_name: &str,
    subject: &str,
    runs: i64,
) -> Result<Vec<StoredResult>, StoreError> {
    const SQL: &str = "SELECT r.run_id, COALESCE(m.finished_at, m.started_at) AS measured_at, r.check_name, \
                r.family, r.subject, r.value, r.expected_low, r.expected_high, r.breached, r.detail \
         FROM (SELECT run_id, started_at, finished_at FROM maintenance_runs WHERE job = 'anomaly' \
               ORDER BY started_at DESC LIMIT $3) AS m \
         JOIN anomaly_results AS r ON r.run_id = m.run_id AND r.check_name = $1 AND r.subject = $2 \
         ORDER BY m.started_at DESC";
    Ok(sqlx::query_as(SQL)
        .bind(check_name)
        .bind(subject)
        .bind(runs.clamp(1, 1000))
        .fetch_all(executor)
        .await?)
}

/// Every result of the latest anomaly run that stored results: breaching first, then by family
/// and name.
pub async fn latest_results(
    executor: impl sqlx::PgExecutor<'_>,
) -> Result<Vec<StoredResult>, StoreError> {
    const SQL: &str = "WITH latest AS ( \
             SELECT m.run_id, COALESCE(m.finished_at, m.started_at) AS measured_at FROM maintenance_runs AS m \
             WHERE m.job = 'anomaly' AND EXISTS (SELECT 1 FROM anomaly_results AS r WHERE r.run_id = m.run_id) \
             ORDER BY m.started_at DESC LIMIT 1) \
         SELECT r.run_id, l.measured_at, r.check_name, r.family, r.subject, r.value, r.expected_low, \
                r.expected_high, r.breached, r.detail \
         FROM anomaly_results AS r JOIN latest AS l USING (run_id) \
         ORDER BY r.breached DESC, r.family, r.check_name, r.subject";
    Ok(sqlx::query_as(SQL).fetch_all(executor).await?)
}
