//! The `outbox` table: side effects written with the processing transaction, delivered after.

use sqlx::{PgExecutor, PgPool, Postgres, Transaction};

use super::StoreError;

/// A transaction for a sender's bookkeeping (a lease, a batch's outcomes) that commits without
/// waiting for its WAL to reach the disk (`synchronous_commit = off`, for this transaction
/// only: nothing else on the connection is relaxed). The wait was most of a small batch's
/// time. What a server crash can lose is the last fraction of a second of such commits, and each
/// loss is a message sent again with its idempotency key, never a message lost: a lost lease
/// lets another sender take it, a lost outcome leaves it pending. The message itself was
/// written, durably, by the drain.
pub async fn relaxed(pool: &PgPool) -> Result<Transaction<'static, Postgres>, StoreError> {
    // One round trip: the setting travels with the BEGIN.
    Ok(pool
        .begin_with("BEGIN; SET LOCAL synchronous_commit = off")
        .await?)
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct OutboxMessage {
    pub outbox_id: i64,
    pub tenant_id: String,
    pub external_id: String,
    pub action: String,
    pub payload: serde_json::Value,
    pub idempotency_key: String,
    /// Tries made before this lease (requests sent to the target).
    pub attempts: i32,
    /// The source of the event that wrote it (routes may be per source); `None` once retention
    /// took the event.
    pub source_id: Option<String>,
}

/// Leases up to `limit` due messages, oldest due first and, among those due at the same time
/// (written by one drain transaction), in the order written, so one entity's messages reach a
/// FIFO destination in order: holds them for `lease_seconds` (no other sender takes them,
/// reconcile does not make them due) and commits at once, so delivery happens outside any
/// transaction and a crashed sender's lease simply expires. A lease spends no attempt.
///
/// The batch stops once its payloads (as stored) pass `max_bytes`, the first message always
/// taken: a sender holds a batch in memory, and a batch of large events would not fit.
///
/// A message is due when its time has come and no lease holds it. The lease writes
/// `leased_until` alone, which no index holds, so the row's new version stays on its page (the
/// outbox keeps room for it) and no index gains an entry; the due messages are read in order
/// from `outbox_due`, skipping the few leased ones. Run it in a [`relaxed`] transaction: a
/// lease lost to a server crash is a message sent again with its key.
pub async fn lease(
    executor: impl PgExecutor<'_>,
    limit: i64,
    max_bytes: i64,
    lease_seconds: f64,
) -> Result<Vec<OutboxMessage>, StoreError> {
    const SQL: &str = "WITH due AS (SELECT outbox_id, next_attempt_at, pg_column_size(payload) AS bytes FROM outbox \
                 WHERE status = 'pending' AND next_attempt_at <= now() \
                   AND (leased_until IS NULL OR leased_until <= now()) \
                 ORDER BY next_attempt_at, outbox_id LIMIT $1 FOR UPDATE SKIP LOCKED), \
             taken AS (SELECT outbox_id FROM (SELECT outbox_id, \
                     sum(bytes) OVER (ORDER BY next_attempt_at, outbox_id) - bytes AS before FROM due) AS d \
                 WHERE before < $2), \
             leased AS (UPDATE outbox AS o SET leased_until = now() + make_interval(secs => $3) \
                 WHERE o.outbox_id = ANY(ARRAY(SELECT outbox_id FROM taken)) \
                 RETURNING o.outbox_id, o.tenant_id, o.external_id, o.action, o.payload, o.idempotency_key, \
                     o.attempts, o.next_attempt_at) \
         SELECT l.outbox_id, l.tenant_id, l.external_id, l.action, l.payload, l.idempotency_key, l.attempts, \
             (SELECT w.source_id FROM webhook_events AS w \
              WHERE w.tenant_id = l.tenant_id AND w.external_id = l.external_id) AS source_id \
         FROM leased AS l ORDER BY l.next_attempt_at, l.outbox_id";
    Ok(sqlx::query_as(SQL)
        .bind(limit)
        .bind(max_bytes)
        .bind(lease_seconds)
        .fetch_all(executor)
        .await?)
}

/// Hands leased messages back untried: due again at once, no attempt spent.
pub async fn release(executor: impl PgExecutor<'_>, outbox_ids: &[i64]) -> Result<u64, StoreError> {
    hand_back(executor, outbox_ids, false).await
}

/// Parks leased messages of a paused subscription: pending, due never, until a resume makes
/// them due. No attempt spent.
pub async fn park(executor: impl PgExecutor<'_>, outbox_ids: &[i64]) -> Result<u64, StoreError> {
    hand_back(executor, outbox_ids, true).await
}

/// Leased messages back, their lease ended: due now, or never (`parked`).
async fn hand_back(
    executor: impl PgExecutor<'_>,
    outbox_ids: &[i64],
    parked: bool,
) -> Result<u64, StoreError> {
    const SQL: &str = "UPDATE outbox SET leased_until = NULL, \
             next_attempt_at = CASE WHEN $2 THEN 'infinity'::timestamptz ELSE now() END \
         WHERE outbox_id = ANY($1) AND status = 'pending'";
    if outbox_ids.is_empty() {
        return Ok(0);
    }
    Ok(sqlx::query(SQL)
        .bind(outbox_ids)
        .bind(parked)
        .execute(executor)
        .await?
        .rows_affected())
}

/// Hands leased messages back, each due after its delay (a subscription's rate limit): no
/// attempt spent. One statement.
pub async fn defer(
    executor: impl PgExecutor<'_>,
    outbox_ids: &[i64],
    delays_ms: &[i64],
) -> Result<u64, StoreError> {
    const SQL: &str = "UPDATE outbox AS o SET next_attempt_at = now() + make_interval(secs => d.ms / 1000.0), \
             leased_until = NULL \
         FROM unnest($1::bigint[], $2::bigint[]) AS d(id, ms) \
         WHERE o.outbox_id = d.id AND o.status = 'pending'";
    if outbox_ids.is_empty() {
        return Ok(0);
    }
    Ok(sqlx::query(SQL)
        .bind(outbox_ids)
        .bind(delays_ms)
        .execute(executor)
        .await?
        .rows_affected())
}

/// Records where the rows of the `settled` CTE (their `outbox_id`) were tried: `$2` is the
/// destination. The `outbox_destinations` table is written only here, in the statement that
/// settles the outbox row, and deleted with it by retention.
macro_rules! record_destination {
    () => {
        " INSERT INTO outbox_destinations (outbox_id, destination) \
          SELECT outbox_id, $2 FROM settled \
          ON CONFLICT (outbox_id) DO UPDATE SET destination = EXCLUDED.destination, tried_at = now()"
    };
}

/// A try that the target accepted; `destination` says where it went.
pub async fn mark_delivered(
    executor: impl PgExecutor<'_>,
    outbox_id: i64,
    destination: &str,
) -> Result<(), StoreError> {
    const SQL: &str = concat!(
        "WITH settled AS (UPDATE outbox SET status = 'delivered', delivered_at = now(), last_error = NULL, \
             attempts = attempts + 1, leased_until = NULL \
         WHERE outbox_id = $1 AND status = 'pending' RETURNING outbox_id)",
        record_destination!()
    );
    sqlx::query(SQL)
        .bind(outbox_id)
        .bind(destination)
        .execute(executor)
        .await?;
    Ok(())
}

/// Tries that the destination accepted, one batch call's: one statement for all of them.
pub async fn mark_delivered_many(
    executor: impl PgExecutor<'_>,
    outbox_ids: &[i64],
    destination: &str,
) -> Result<u64, StoreError> {
    const SQL: &str = concat!(
        "WITH settled AS (UPDATE outbox SET status = 'delivered', delivered_at = now(), last_error = NULL, \
             attempts = attempts + 1, leased_until = NULL \
         WHERE outbox_id = ANY($1) AND status = 'pending' RETURNING outbox_id)",
        record_destination!()
    );
    if outbox_ids.is_empty() {
        return Ok(0);
    }
    Ok(sqlx::query(SQL)
        .bind(outbox_ids)
        .bind(destination)
        .execute(executor)
        .await?
        .rows_affected())
}

/// A try that failed and may succeed later: counted, and due again after `delay_ms`.
pub async fn retry_later(
    executor: impl PgExecutor<'_>,
    outbox_id: i64,
    delay_ms: i64,
    error: &str,
    destination: &str,
) -> Result<(), StoreError> {
    const SQL: &str = concat!(
        "WITH settled AS (UPDATE outbox SET next_attempt_at = now() + make_interval(secs => $3 / 1000.0), last_error = $4, \
             attempts = attempts + 1, leased_until = NULL \
         WHERE outbox_id = $1 AND status = 'pending' RETURNING outbox_id)",
        record_destination!()
    );
    sqlx::query(SQL)
        .bind(outbox_id)
        .bind(destination)
        .bind(delay_ms)
        .bind(error)
        .execute(executor)
        .await?;
    Ok(())
}

/// Gives up on a message after a try: the target refused it for good, or the attempt budget is
/// spent.
pub async fn mark_failed(
    executor: impl PgExecutor<'_>,
    outbox_id: i64,
    error: &str,
    destination: &str,
) -> Result<(), StoreError> {
    const SQL: &str = concat!(
        "WITH settled AS (UPDATE outbox SET status = 'failed', last_error = $3, attempts = attempts + 1, \
             leased_until = NULL \
         WHERE outbox_id = $1 AND status = 'pending' RETURNING outbox_id)",
        record_destination!()
    );
    sqlx::query(SQL)
        .bind(outbox_id)
        .bind(destination)
        .bind(error)
        .execute(executor)
        .await?;
    Ok(())
}

/// Fails a message no route sends anywhere: it waits, failed, for an operator who adds the
/// route and resends it. No try was made, so no attempt is spent.
pub async fn mark_unrouted(
    executor: impl PgExecutor<'_>,
    outbox_id: i64,
    error: &str,
) -> Result<(), StoreError> {
    const SQL: &str = "WITH settled AS (UPDATE outbox SET status = 'failed', last_error = $2, leased_until = NULL \
             WHERE outbox_id = $1 AND status = 'pending' RETURNING outbox_id) \
         DELETE FROM outbox_destinations AS d USING settled WHERE d.outbox_id = settled.outbox_id";
    sqlx::query(SQL)
        .bind(outbox_id)
        .bind(error)
        .execute(executor)
        .await?;
    Ok(())
}

/// Messages waiting, waiting longer than `overdue_seconds`, and failed for good.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, sqlx::FromRow, serde::Serialize, serde::Deserialize,
)]
pub struct OutboxCounts {
    pub pending: i64,
    pub overdue: i64,
    pub failed: i64,
}

pub async fn counts(
    executor: impl PgExecutor<'_>,
    overdue_seconds: f64,
) -> Result<OutboxCounts, StoreError> {
    // Each state counted on its own, so each count reads the partial index that holds only it
    // (`outbox_due`, `outbox_failed`): one filter over both states matched neither and
    // read the whole outbox, delivered messages and all (tests/scale_plans.rs).
    const SQL: &str = "SELECT p.pending, p.overdue, \
                (SELECT count(*) FROM outbox WHERE status = 'failed') AS failed \
         FROM (SELECT count(*) AS pending, \
                      count(*) FILTER (WHERE created_at < now() - make_interval(secs => $1)) AS overdue \
               FROM outbox WHERE status = 'pending') AS p";
    Ok(sqlx::query_as(SQL)
        .bind(overdue_seconds)
        .fetch_one(executor)
        .await?)
}

/// Seconds since the oldest undelivered (pending) message was written; 0 when none waits. Reads
/// the pending rows only (the `outbox_due` partial index). A paused subscription's
/// messages (parked) wait by decision, not late: they are shown per subscription instead.
pub async fn oldest_undelivered_age(executor: impl PgExecutor<'_>) -> Result<f64, StoreError> {
    const SQL: &str = "SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8 \
         FROM outbox WHERE status = 'pending' AND next_attempt_at < 'infinity'";
    Ok(sqlx::query_scalar(SQL).fetch_one(executor).await?)
}

/// Which failed messages: every field narrows; none matches every failed message (`limit` alone
/// is no filter).
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct FailedFilter {
    #[serde(default)]
    pub ids: Vec<i64>,
    pub tenant_id: Option<String>,
    pub action: Option<String>,
    /// Case-insensitive substring of the last error.
    pub error_contains: Option<String>,
    /// At most this many (default 1000).
    pub limit: Option<i64>,
}

impl FailedFilter {
    /// Whether it picks every failed message (up to its limit).
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
            && self.tenant_id.is_none()
            && self.action.is_none()
            && self.error_contains.is_none()
    }
}

/// A message that failed for good: what it was, and why it failed.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct FailedMessage {
    pub outbox_id: i64,
    pub tenant_id: String,
    pub external_id: String,
    pub action: String,
    pub idempotency_key: String,
    /// Tries spent since it was written or last resent.
    pub attempts: i32,
    pub last_error: Option<String>,
    pub created_at: chrono::DateTime<chrono::Utc>,
    /// How many times an operator resent it before.
    pub resent_count: i32,
    /// Where its last try went (`sqs <queue URL>`...); `None` when no route sent it anywhere.
    #[serde(default)]
    pub destination: Option<String>,
}

/// A message delivered: where it went and when (issue 24: `hookctl outbox sent`).
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct SentMessage {
    pub outbox_id: i64,
    pub tenant_id: String,
    pub external_id: String,
    pub action: String,
    pub idempotency_key: String,
    pub attempts: i32,
    pub destination: Option<String>,
    pub delivered_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// The latest delivered messages, newest written first, of a tenant and action when given.
/// Walks the primary key backwards and stops at `limit`: the outbox's newest rows are
/// delivered ones on a healthy stack, so it reads few rows beyond those it returns.
pub async fn select_sent(
    executor: impl PgExecutor<'_>,
    tenant_id: Option<&str>,
    action: Option<&str>,
    limit: i64,
) -> Result<Vec<SentMessage>, StoreError> {
    const SQL: &str = "SELECT o.outbox_id, o.tenant_id, o.external_id, o.action, o.idempotency_key, o.attempts, \
                d.destination, o.delivered_at \
         FROM outbox AS o LEFT JOIN outbox_destinations AS d USING (outbox_id) \
         WHERE o.status = 'delivered' AND ($1::text IS NULL OR o.tenant_id = $1) \
           AND ($2::text IS NULL OR o.action = $2) \
         ORDER BY o.outbox_id DESC LIMIT $3";
    Ok(sqlx::query_as(SQL)
        .bind(tenant_id)
        .bind(action)
        .bind(limit.clamp(1, 10_000))
        .fetch_all(executor)
        .await?)
}

/// The ids of the failed messages a [`FailedFilter`] picks, oldest first; bound by
/// [`bind_filter`].
macro_rules! failed_matching {
    () => {
        "SELECT outbox_id FROM outbox \
         WHERE status = 'failed' \
           AND (cardinality($1::bigint[]) = 0 OR outbox_id = ANY($1)) \
           AND ($2::text IS NULL OR tenant_id = $2) \
           AND ($3::text IS NULL OR action = $3) \
           AND ($4::text IS NULL OR strpos(lower(last_error), lower($4)) > 0) \
         ORDER BY created_at, outbox_id \
         LIMIT $5"
    };
}

fn bind_filter<'q, O>(
    query: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    f: &'q FailedFilter,
) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
    query
        .bind(&f.ids)
        .bind(&f.tenant_id)
        .bind(&f.action)
        .bind(&f.error_contains)
        .bind(f.limit.unwrap_or(1000).clamp(1, 100_000))
}

/// The failed messages matching the filter, oldest first.
pub async fn select_failed(
    executor: impl PgExecutor<'_>,
    f: &FailedFilter,
) -> Result<Vec<FailedMessage>, StoreError> {
    const SQL: &str = concat!(
        "SELECT o.outbox_id, o.tenant_id, o.external_id, o.action, o.idempotency_key, o.attempts, \
                o.last_error, o.created_at, o.resent_count, d.destination \
         FROM (",
        failed_matching!(),
        ") AS chosen JOIN outbox AS o USING (outbox_id) \
         LEFT JOIN outbox_destinations AS d USING (outbox_id) \
         ORDER BY o.created_at, o.outbox_id"
    );
    Ok(bind_filter(sqlx::query_as(SQL), f)
        .fetch_all(executor)
        .await?)
}

/// Makes the failed messages matching the filter due again at once, with a fresh attempt
/// budget and the same Idempotency-Key (a target that did receive an earlier try keeps one);
/// the next sender pass delivers them. Returns their ids.
pub async fn resend_failed(
    executor: impl PgExecutor<'_>,
    f: &FailedFilter,
) -> Result<Vec<i64>, StoreError> {
    const SQL: &str = concat!(
        "UPDATE outbox AS o SET status = 'pending', attempts = 0, next_attempt_at = now(), \
             leased_until = NULL, resent_count = o.resent_count + 1, resent_at = now() \
         FROM (",
        failed_matching!(),
        " FOR UPDATE) AS chosen \
         WHERE o.outbox_id = chosen.outbox_id AND o.status = 'failed' \
         RETURNING o.outbox_id"
    );
    let resent: Vec<(i64,)> = bind_filter(sqlx::query_as(SQL), f)
        .fetch_all(executor)
        .await?;
    let mut ids: Vec<i64> = resent.into_iter().map(|(id,)| id).collect();
    ids.sort_unstable();
    Ok(ids)
}

/// Closes failed messages whose effect is not wanted: they are never sent again, no longer
/// need a human, and retention may take them with their events. Returns the ids it closed (a
/// message that is not failed is left as it is).
pub async fn discard_failed(
    executor: impl PgExecutor<'_>,
    outbox_ids: &[i64],
) -> Result<Vec<i64>, StoreError> {
    const SQL: &str = "UPDATE outbox SET status = 'discarded', discarded_at = now() \
         WHERE outbox_id = ANY($1) AND status = 'failed' \
         RETURNING outbox_id";
    let mut ids: Vec<i64> = sqlx::query_scalar(SQL)
        .bind(outbox_ids)
        .fetch_all(executor)
        .await?;
    ids.sort_unstable();
    Ok(ids)
}
