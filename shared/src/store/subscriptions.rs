//! Subscriptions' tables: `outbox_subscriptions` (what `hookctl routes apply` wrote),
//! `subscription_pauses`, `subscription_replays`, and the outbox rows a subscription's
//! messages are (action `event:<name>`).

use sqlx::{PgConnection, PgExecutor};

use super::StoreError;
use super::event_queue::ClaimedEvent;

/// An `outbox_subscriptions` row, column for column.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct SubscriptionRow {
    pub tenant_id: String,
    pub name: String,
    pub source_id: Option<String>,
    pub event_types: Vec<String>,
    pub payload_pointer: Option<String>,
    pub payload_values: Option<serde_json::Value>,
    pub kind: String,
    pub target: String,
    pub event_source: Option<String>,
    pub signing_secret_ref: Option<String>,
    pub rate_limit: Option<f64>,
}

/// Every subscription, tenant by tenant.
pub async fn list(executor: impl PgExecutor<'_>) -> Result<Vec<SubscriptionRow>, StoreError> {
    const SQL: &str = "SELECT tenant_id, name, source_id, event_types, payload_pointer, payload_values, \
         kind, target, event_source, signing_secret_ref, rate_limit \
         FROM outbox_subscriptions ORDER BY tenant_id, name";
    Ok(sqlx::query_as(SQL).fetch_all(executor).await?)
}

/// One subscription, by tenant and name.
pub async fn find(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    name: &str,
) -> Result<Option<SubscriptionRow>, StoreError> {
    const SQL: &str = "SELECT tenant_id, name, source_id, event_types, payload_pointer, payload_values, \
         kind, target, event_source, signing_secret_ref, rate_limit \
         FROM outbox_subscriptions WHERE tenant_id = $1 AND name = $2";
    Ok(sqlx::query_as(SQL)
        .bind(tenant_id)
        .bind(name)
        .fetch_optional(executor)
        .await?)
}

/// Removes every subscription (the apply writes the new set in the same transaction).
pub async fn delete_all(executor: impl PgExecutor<'_>) -> Result<u64, StoreError> {
    const SQL: &str = "DELETE FROM outbox_subscriptions";
    Ok(sqlx::query(SQL).execute(executor).await?.rows_affected())
}

pub async fn insert(
    executor: impl PgExecutor<'_>,
    row: &SubscriptionRow,
) -> Result<(), StoreError> {
    const SQL: &str = "INSERT INTO outbox_subscriptions (tenant_id, name, source_id, event_types, \
         payload_pointer, payload_values, kind, target, event_source, signing_secret_ref, rate_limit) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";
    sqlx::query(SQL)
        .bind(&row.tenant_id)
        .bind(&row.name)
        .bind(&row.source_id)
        .bind(&row.event_types)
        .bind(&row.payload_pointer)
        .bind(&row.payload_values)
        .bind(&row.kind)
        .bind(&row.target)
        .bind(&row.event_source)
        .bind(&row.signing_secret_ref)
        .bind(row.rate_limit)
        .execute(executor)
        .await?;
    Ok(())
}

/// The outbox rows of a drain batch's subscriptions, column by column.
#[derive(Debug, Default)]
pub struct ForwardRows {
    tenant_ids: Vec<String>,
    external_ids: Vec<String>,
    actions: Vec<String>,
    keys: Vec<String>,
    envelopes: Vec<String>,
}

impl ForwardRows {
    pub fn push(
        &mut self,
        tenant_id: &str,
        external_id: &str,
        action: String,
        key: String,
        envelope: String,
    ) {
        self.tenant_ids.push(tenant_id.to_owned());
        self.external_ids.push(external_id.to_owned());
        self.actions.push(action);
        self.keys.push(key);
        self.envelopes.push(envelope);
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// The start of a statement that writes a batch of subscription messages, bound by
/// [`bind_forwards`]; what it does with one that exists follows it.
macro_rules! insert_forwards {
    () => {
        "INSERT INTO outbox (tenant_id, external_id, action, payload, idempotency_key) \
         SELECT t, e, a, p::jsonb, k FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[]) \
             AS m(t, e, a, p, k) \
         ON CONFLICT (tenant_id, external_id, action) "
    };
}

async fn bind_forwards(
    executor: impl PgExecutor<'_>,
    sql: &'static str,
    rows: &ForwardRows,
) -> Result<u64, StoreError> {
    if rows.is_empty() {
        return Ok(0);
    }
    Ok(sqlx::query(sql)
        .bind(&rows.tenant_ids)
        .bind(&rows.external_ids)
        .bind(&rows.actions)
        .bind(&rows.envelopes)
        .bind(&rows.keys)
        .execute(executor)
        .await?
        .rows_affected())
}

/// Writes the messages that do not exist yet; one statement. Returns how many it wrote.
pub async fn insert_forwards(
    executor: impl PgExecutor<'_>,
    rows: &ForwardRows,
) -> Result<u64, StoreError> {
    const SQL: &str = concat!(insert_forwards!(), "DO NOTHING");
    bind_forwards(executor, SQL, rows).await
}

/// Writes the messages of a replay: a new one pending; one that exists and is not waiting
/// (delivered, failed, discarded) pending again with a fresh attempt budget and the same key,
/// its resend counted; one already waiting is left to its course. One statement.
pub async fn requeue_forwards(
    executor: impl PgExecutor<'_>,
    rows: &ForwardRows,
) -> Result<u64, StoreError> {
    const SQL: &str = concat!(
        insert_forwards!(),
        "DO UPDATE SET status = 'pending', attempts = 0, \
             next_attempt_at = now(), leased_until = NULL, last_error = NULL, payload = EXCLUDED.payload, \
             resent_count = outbox.resent_count + 1, resent_at = now() \
         WHERE outbox.status <> 'pending'"
    );
    bind_forwards(executor, SQL, rows).await
}

/// A pause: who, when, why.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct Pause {
    pub tenant_id: String,
    pub name: String,
    pub paused_at: chrono::DateTime<chrono::Utc>,
    pub reason: String,
    pub actor: String,
}

/// Pauses a subscription; a second pause keeps the first's record. Returns whether it was
/// running.
pub async fn pause(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    name: &str,
    reason: &str,
    actor: &str,
) -> Result<bool, StoreError> {
    const SQL: &str = "INSERT INTO subscription_pauses (tenant_id, name, reason, actor) \
         VALUES ($1, $2, $3, $4) ON CONFLICT (tenant_id, name) DO NOTHING";
    Ok(sqlx::query(SQL)
        .bind(tenant_id)
        .bind(name)
        .bind(reason)
        .bind(actor)
        .execute(executor)
        .await?
        .rows_affected()
        == 1)
}

/// Resumes a subscription: its pause removed and its parked messages (of outbox action
/// `action`) due at once. Returns the pause it lifted and how many messages it made due.
pub async fn resume(
    conn: &mut PgConnection,
    tenant_id: &str,
    name: &str,
    action: &str,
) -> Result<(Option<Pause>, u64), StoreError> {
    const LIFT: &str = "DELETE FROM subscription_pauses WHERE tenant_id = $1 AND name = $2 \
         RETURNING tenant_id, name, paused_at, reason, actor";
    const DUE: &str = "UPDATE outbox SET next_attempt_at = now(), leased_until = NULL \
         WHERE status = 'pending' AND next_attempt_at = 'infinity' AND tenant_id = $1 AND action = $2";
    let lifted: Option<Pause> = sqlx::query_as(LIFT)
        .bind(tenant_id)
        .bind(name)
        .fetch_optional(&mut *conn)
        .await?;
    let due = sqlx::query(DUE)
        .bind(tenant_id)
        .bind(action)
        .execute(&mut *conn)
        .await?
        .rows_affected();
    Ok((lifted, due))
}

pub async fn pauses(executor: impl PgExecutor<'_>) -> Result<Vec<Pause>, StoreError> {
    const SQL: &str = "SELECT tenant_id, name, paused_at, reason, actor FROM subscription_pauses \
         ORDER BY tenant_id, name";
    Ok(sqlx::query_as(SQL).fetch_all(executor).await?)
}

/// A subscription's messages not yet delivered.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct Undelivered {
    pub tenant_id: String,
    pub name: String,
    /// Pending (waiting, parked by a pause, or being retried).
    pub undelivered: i64,
    /// Seconds since the oldest of them was written; 0 when none waits.
    pub oldest_age_seconds: f64,
    /// Failed for good, waiting for an operator.
    pub failed: i64,
    pub paused: bool,
}

/// Every subscription's undelivered and failed counts. Reads the pending and failed rows only
/// (the `outbox_due` and `outbox_failed` partial indexes).
pub async fn undelivered(executor: impl PgExecutor<'_>) -> Result<Vec<Undelivered>, StoreError> {
    const SQL: &str = "WITH pending AS ( \
             SELECT tenant_id, action, count(*) AS n, min(created_at) AS oldest FROM outbox \
             WHERE status = 'pending' AND action LIKE 'event:%' GROUP BY 1, 2), \
         failed AS ( \
             SELECT tenant_id, action, count(*) AS n FROM outbox \
             WHERE status = 'failed' AND action LIKE 'event:%' GROUP BY 1, 2) \
         SELECT s.tenant_id, s.name, COALESCE(p.n, 0) AS undelivered, \
             COALESCE(EXTRACT(EPOCH FROM now() - p.oldest), 0)::float8 AS oldest_age_seconds, \
             COALESCE(f.n, 0) AS failed, \
             EXISTS (SELECT 1 FROM subscription_pauses AS z \
                     WHERE z.tenant_id = s.tenant_id AND z.name = s.name) AS paused \
         FROM outbox_subscriptions AS s \
         LEFT JOIN pending AS p ON p.tenant_id = s.tenant_id AND p.action = 'event:' || s.name \
         LEFT JOIN failed AS f ON f.tenant_id = s.tenant_id AND f.action = 'event:' || s.name \
         ORDER BY s.tenant_id, s.name";
    Ok(sqlx::query_as(SQL).fetch_all(executor).await?)
}

/// A replay job.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct ReplayJob {
    pub replay_id: i64,
    pub tenant_id: String,
    pub name: String,
    pub source_id: Option<String>,
    pub event_types: Vec<String>,
    pub since: chrono::DateTime<chrono::Utc>,
    pub until: chrono::DateTime<chrono::Utc>,
    pub rate: f64,
    pub cursor_received_at: Option<chrono::DateTime<chrono::Utc>>,
    pub cursor_tenant_id: Option<String>,
    pub cursor_external_id: Option<String>,
    pub queued: i64,
    pub skipped_purged: i64,
    pub status: String,
    pub actor: String,
}

macro_rules! job_columns {
    () => {
        "replay_id, tenant_id, name, source_id, event_types, since, until, rate, \
         cursor_received_at, cursor_tenant_id, cursor_external_id, queued, skipped_purged, status, actor"
    };
}

/// The running replay of the same range to the same subscription, or a new one. Locked for the
/// caller's transaction, so two runs of one replay never interleave.
#[allow(clippy::too_many_arguments)]
pub async fn start_or_resume(
    conn: &mut PgConnection,
    tenant_id: &str,
    name: &str,
    source_id: Option<&str>,
    event_types: &[String],
    since: chrono::DateTime<chrono::Utc>,
    until: chrono::DateTime<chrono::Utc>,
    rate: f64,
    actor: &str,
    reason: Option<&str>,
) -> Result<(ReplayJob, bool), StoreError> {
    const FIND: &str = concat!(
        "SELECT ",
        job_columns!(),
        " FROM subscription_replays WHERE status = 'running' AND tenant_id = $1 \
         AND name = $2 AND source_id IS NOT DISTINCT FROM $3 AND event_types = $4 AND since = $5 \
         AND until = $6 ORDER BY replay_id LIMIT 1 FOR UPDATE"
    );
    if let Some(mut job) = sqlx::query_as::<_, ReplayJob>(FIND)
        .bind(tenant_id)
        .bind(name)
        .bind(source_id)
        .bind(event_types)
        .bind(since)
        .bind(until)
        .fetch_optional(&mut *conn)
        .await?
    {
        job.rate = rate;
        return Ok((job, true));
    }
    const INSERT: &str = concat!(
        "INSERT INTO subscription_replays (tenant_id, name, source_id, event_types, since, until, rate, actor, reason) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING ",
        job_columns!()
    );
    let job = sqlx::query_as(INSERT)
        .bind(tenant_id)
        .bind(name)
        .bind(source_id)
        .bind(event_types)
        .bind(since)
        .bind(until)
        .bind(rate)
        .bind(actor)
        .bind(reason)
        .fetch_one(&mut *conn)
        .await?;
    Ok((job, false))
}

/// A replay job by its id.
pub async fn find_job(
    executor: impl PgExecutor<'_>,
    replay_id: i64,
) -> Result<Option<ReplayJob>, StoreError> {
    const SQL: &str = concat!(
        "SELECT ",
        job_columns!(),
        " FROM subscription_replays WHERE replay_id = $1"
    );
    Ok(sqlx::query_as(SQL)
        .bind(replay_id)
        .fetch_optional(executor)
        .await?)
}

/// The events a replay job reads: processed, of its tenant (and source), first received in its
/// range, after its cursor. Bound by [`bind_replay_range!`] as `$1`..`$7`.
macro_rules! replay_range {
    () => {
        " WHERE e.tenant_id = $1 AND e.first_received_at >= $2 AND e.first_received_at < $3 \
           AND ($4::text IS NULL OR e.source_id = $4) AND e.status = 'processed' \
           AND ($5::timestamptz IS NULL OR (e.first_received_at, e.tenant_id, e.external_id) > ($5, $6, $7)) "
    };
}

macro_rules! bind_replay_range {
    ($query:expr, $job:expr) => {
        $query
            .bind(&$job.tenant_id)
            .bind($job.since)
            .bind($job.until)
            .bind(&$job.source_id)
            .bind($job.cursor_received_at)
            .bind(&$job.cursor_tenant_id)
            .bind(&$job.cursor_external_id)
    };
}

/// How many stored events the replay's range holds from its cursor on (its progress bar's
/// length).
pub async fn remaining(executor: impl PgExecutor<'_>, job: &ReplayJob) -> Result<i64, StoreError> {
    const SQL: &str = concat!("SELECT count(*) FROM webhook_events AS e", replay_range!());
    Ok(bind_replay_range!(sqlx::query_scalar(SQL), job)
        .fetch_one(executor)
        .await?)
}

/// The next processed events of the replay's range after its cursor, in first-received order,
/// as the drain claims them.
pub async fn next_events(
    executor: impl PgExecutor<'_>,
    job: &ReplayJob,
    limit: i64,
) -> Result<Vec<ClaimedEvent>, StoreError> {
    const SQL: &str = concat!(
        "SELECT e.tenant_id, e.external_id, e.source_id, s.scheme, e.event_type, e.entity_id, \
             e.entity_version, e.version_tiebreak, e.payload, e.payload_sha256, e.first_received_at, \
             e.attempts, false AS repair \
         FROM webhook_events AS e JOIN sources AS s ON s.source_id = e.source_id",
        replay_range!(),
        "ORDER BY e.first_received_at, e.tenant_id, e.external_id LIMIT $8"
    );
    Ok(bind_replay_range!(sqlx::query_as(SQL), job)
        .bind(limit)
        .fetch_all(executor)
        .await?)
}

/// Moves the replay's cursor past `last` and adds to its counts; finishes it when `finished`.
pub async fn advance(
    executor: impl PgExecutor<'_>,
    replay_id: i64,
    last: Option<&ClaimedEvent>,
    queued: i64,
    skipped_purged: i64,
    finished: bool,
) -> Result<(), StoreError> {
    const SQL: &str = "UPDATE subscription_replays SET \
             cursor_received_at = COALESCE($2, cursor_received_at), \
             cursor_tenant_id = COALESCE($3, cursor_tenant_id), \
             cursor_external_id = COALESCE($4, cursor_external_id), \
             queued = queued + $5, skipped_purged = skipped_purged + $6, updated_at = now(), \
             status = CASE WHEN $7 THEN 'finished' ELSE status END, \
             finished_at = CASE WHEN $7 THEN now() END \
         WHERE replay_id = $1";
    sqlx::query(SQL)
        .bind(replay_id)
        .bind(last.map(|e| e.first_received_at))
        .bind(last.map(|e| e.tenant_id.as_str()))
        .bind(last.map(|e| e.external_id.as_str()))
        .bind(queued)
        .bind(skipped_purged)
        .bind(finished)
        .execute(executor)
        .await?;
    Ok(())
}
