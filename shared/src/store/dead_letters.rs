//! The `dead_letters` table: events the drain gave up on, and their triage.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use super::StoreError;

/// Dead-letters events in one statement: each leaves the queue, its event row says
/// `dead_lettered`, and a dead letter keeps its payload, headers, error and attempts. Only a
/// pending event can be dead-lettered: a processed one never is. An event whose `attempts` this
/// takes to 2 has its hour marked for the anomaly rollup (see [`super::delivery_hours`]).
pub async fn bury(
    executor: impl PgExecutor<'_>,
    tenants: &[String],
    ids: &[String],
    errors: &[String],
    reasons: &[&str],
) -> Result<u64, StoreError> {
    const SQL: &str = "WITH d AS ( \
             SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) AS d(tenant_id, external_id, error, reason)), \
         dequeued AS ( \
             DELETE FROM event_queue AS q USING d \
             WHERE q.tenant_id = d.tenant_id AND q.external_id = d.external_id \
             RETURNING q.tenant_id, q.external_id, d.error, d.reason), \
         marked AS ( \
             UPDATE webhook_events AS e \
             SET status = 'dead_lettered', attempts = e.attempts + 1, last_error = dequeued.error \
             FROM dequeued \
             WHERE e.tenant_id = dequeued.tenant_id AND e.external_id = dequeued.external_id AND e.status = 'pending' \
             RETURNING e.tenant_id, e.external_id, e.source_id, e.event_type, e.payload, e.headers, e.attempts, \
                 e.first_received_at, dequeued.error, dequeued.reason), \
         counted_retried AS ( \
             INSERT INTO delivery_hours_dirty (source_id, hour) \
             SELECT DISTINCT source_id, date_trunc('hour', first_received_at) FROM marked WHERE attempts = 2) \
         INSERT INTO dead_letters (tenant_id, external_id, source_id, event_type, payload, headers, error, reason, attempts) \
         SELECT tenant_id, external_id, source_id, event_type, payload, headers, error, reason, attempts FROM marked";
    if ids.is_empty() {
        return Ok(0);
    }
    let reasons: Vec<&str> = reasons.to_vec();
    Ok(sqlx::query(SQL)
        .bind(tenants)
        .bind(ids)
        .bind(errors)
        .bind(reasons)
        .execute(executor)
        .await?
        .rows_affected())
}

/// Which open dead letters to replay. Empty fields do not filter; `limit` alone is no filter.
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReplayFilter {
    #[serde(default)]
    pub ids: Vec<i64>,
    pub tenant_id: Option<String>,
    pub event_type: Option<String>,
    /// Case-insensitive substring of the recorded error.
    pub error_contains: Option<String>,
    pub created_after: Option<DateTime<Utc>>,
    pub created_before: Option<DateTime<Utc>>,
    /// At most this many (default 1000).
    pub limit: Option<i64>,
}

impl ReplayFilter {
    /// Whether it picks every open letter (up to its limit).
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
            && self.tenant_id.is_none()
            && self.event_type.is_none()
            && self.error_contains.is_none()
            && self.created_after.is_none()
            && self.created_before.is_none()
    }
}

#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct DeadLetter {
    pub dead_letter_id: i64,
    pub tenant_id: String,
    pub external_id: String,
    pub event_type: String,
    pub status: String,
    pub error: String,
    pub attempts: i32,
}

/// The open letters (`new`, `investigating`) a [`ReplayFilter`] matches: its fields are `$1` to
/// `$6`, bound in that order by [`bind_filter!`].
macro_rules! open_and_matching {
    () => {
        " WHERE status IN ('new', 'investigating') \
           AND (cardinality($1::bigint[]) = 0 OR dead_letter_id = ANY($1)) \
           AND ($2::text IS NULL OR tenant_id = $2) \
           AND ($3::text IS NULL OR event_type = $3) \
           AND ($4::text IS NULL OR strpos(lower(error), lower($4)) > 0) \
           AND ($5::timestamptz IS NULL OR created_at >= $5) \
           AND ($6::timestamptz IS NULL OR created_at < $6)"
    };
}

/// Binds a [`ReplayFilter`]'s fields as [`open_and_matching!`] reads them.
macro_rules! bind_filter {
    ($query:expr, $f:expr) => {
        $query
            .bind(&$f.ids)
            .bind(&$f.tenant_id)
            .bind(&$f.event_type)
            .bind(&$f.error_contains)
            .bind($f.created_after)
            .bind($f.created_before)
    };
}

/// Open dead letters (`new` or `investigating`) matching the filter, oldest first.
pub async fn select_open(
    executor: impl PgExecutor<'_>,
    f: &ReplayFilter,
) -> Result<Vec<DeadLetter>, StoreError> {
    const SQL: &str = concat!(
        "SELECT dead_letter_id, tenant_id, external_id, event_type, status, error, attempts \
         FROM dead_letters",
        open_and_matching!(),
        " ORDER BY created_at, dead_letter_id LIMIT $7"
    );
    Ok(bind_filter!(sqlx::query_as(SQL), f)
        .bind(f.limit.unwrap_or(1000).clamp(1, 100_000))
        .fetch_all(executor)
        .await?)
}

/// Locks an open dead letter and its event for a replay in the caller's transaction, and
/// returns the event as the drain would have claimed it. `None` when the letter is not open or
/// another replay holds it. The payload is the letter's own copy when retention has purged the
/// event's: an open letter keeps what its replay needs.
pub async fn claim_for_replay(
    conn: &mut sqlx::PgConnection,
    dead_letter_id: i64,
) -> Result<Option<super::event_queue::ClaimedEvent>, StoreError> {
    const SQL: &str = "SELECT e.tenant_id, e.external_id, e.source_id, s.scheme, e.event_type, e.entity_id, \
                e.entity_version, e.version_tiebreak, COALESCE(e.payload, l.payload) AS payload, e.payload_sha256, \
                e.first_received_at, e.attempts, false AS repair \
         FROM dead_letters AS l \
         JOIN webhook_events AS e ON e.tenant_id = l.tenant_id AND e.external_id = l.external_id \
         JOIN sources AS s ON s.source_id = e.source_id \
         WHERE l.dead_letter_id = $1 AND l.status IN ('new', 'investigating') AND e.status = 'dead_lettered' \
         FOR UPDATE OF l, e SKIP LOCKED";
    Ok(sqlx::query_as(SQL)
        .bind(dead_letter_id)
        .fetch_optional(conn)
        .await?)
}

/// After a replay processed the event: the letter is closed as `replayed` and its event is
/// `processed`, with what its handler expects reconciliation to find, in one statement (which
/// marks the event's hour for the anomaly rollup when it takes `attempts` to 2, and records
/// its received → processed latency as the drain's completions do,
/// [`super::processing_completions`]).
pub async fn mark_replayed(
    executor: impl PgExecutor<'_>,
    dead_letter_id: i64,
    expects: &str,
) -> Result<(), StoreError> {
    const SQL: &str = concat!(
        "WITH letter AS ( \
             UPDATE dead_letters SET status = 'replayed', replayed_at = statement_timestamp(), \
                 replay_count = replay_count + 1, updated_at = statement_timestamp() \
             WHERE dead_letter_id = $1 RETURNING tenant_id, external_id), \
         replayed AS ( \
             UPDATE webhook_events AS e SET status = 'processed', processed_at = statement_timestamp(), \
                 attempts = e.attempts + 1, last_error = NULL, expects = $2 \
             FROM letter WHERE e.tenant_id = letter.tenant_id AND e.external_id = letter.external_id \
             RETURNING e.source_id, e.first_received_at, e.attempts, \
                 EXTRACT(EPOCH FROM e.processed_at - e.received_at)::float8 AS seconds), \
         recorded AS (",
        super::processing_completions::record_latencies!("replayed"),
        ") \
         INSERT INTO delivery_hours_dirty (source_id, hour) \
         SELECT source_id, date_trunc('hour', first_received_at) FROM replayed WHERE attempts = 2"
    );
    sqlx::query(SQL)
        .bind(dead_letter_id)
        .bind(expects)
        .execute(executor)
        .await?;
    Ok(())
}

/// After a replay failed again: the letter stays open with the new error, and so does its
/// event's `last_error`.
pub async fn record_failed_replay(
    executor: impl PgExecutor<'_>,
    dead_letter_id: i64,
    error: &str,
) -> Result<(), StoreError> {
    const SQL: &str = "WITH letter AS ( \
             UPDATE dead_letters SET error = $2, replay_count = replay_count + 1, \
                 attempts = attempts + 1, updated_at = now() \
             WHERE dead_letter_id = $1 RETURNING tenant_id, external_id), \
         failed AS ( \
             UPDATE webhook_events AS e SET attempts = e.attempts + 1, last_error = $2 \
             FROM letter WHERE e.tenant_id = letter.tenant_id AND e.external_id = letter.external_id \
             RETURNING e.source_id, e.first_received_at, e.attempts) \
         INSERT INTO delivery_hours_dirty (source_id, hour) \
         SELECT source_id, date_trunc('hour', first_received_at) FROM failed WHERE attempts = 2";
    sqlx::query(SQL)
        .bind(dead_letter_id)
        .bind(error)
        .execute(executor)
        .await?;
    Ok(())
}

/// Moves a letter along its workflow: new → investigating → replayed | discarded. Replayed is
/// set only by a successful replay.
pub async fn set_status(
    executor: impl PgExecutor<'_>,
    dead_letter_id: i64,
    status: &str,
) -> Result<bool, StoreError> {
    const SQL: &str = "UPDATE dead_letters SET status = $2, updated_at = now() \
         WHERE dead_letter_id = $1 AND status IN ('new', 'investigating') AND $2 IN ('investigating', 'discarded')";
    Ok(sqlx::query(SQL)
        .bind(dead_letter_id)
        .bind(status)
        .execute(executor)
        .await?
        .rows_affected()
        == 1)
}

/// How many dead letters are open (`new` or `investigating`).
pub async fn count_open(executor: impl PgExecutor<'_>) -> Result<i64, StoreError> {
    const SQL: &str = "SELECT count(*) FROM dead_letters WHERE status IN ('new', 'investigating')";
    Ok(sqlx::query_scalar(SQL).fetch_one(executor).await?)
}

/// One dead letter, whatever its status, with what an operator needs to decide on it.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct DeadLetterDetail {
    pub dead_letter_id: i64,
    pub tenant_id: String,
    pub external_id: String,
    pub source_id: String,
    pub event_type: String,
    pub status: String,
    /// `fatal` or `exhausted`.
    pub reason: String,
    pub error: String,
    pub attempts: i32,
    pub replay_count: i32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub replayed_at: Option<DateTime<Utc>>,
    /// The headers kept with the event, less the signatures.
    pub headers: serde_json::Value,
    /// The signature headers kept with the event and not shown: with the payload, they are a
    /// delivery anyone could post again within the provider's tolerance.
    #[sqlx(skip)]
    #[serde(default)]
    pub withheld_headers: Vec<String>,
    /// The payload as text (invalid UTF-8 replaced); `None` once retention took the letter's copy.
    #[sqlx(skip)]
    pub payload: Option<String>,
    pub payload_bytes: Option<i32>,
}

/// One dead letter for an operator's eyes: its signature headers withheld (named in
/// `withheld_headers`).
pub async fn find(
    executor: impl PgExecutor<'_>,
    dead_letter_id: i64,
) -> Result<Option<DeadLetterDetail>, StoreError> {
    use sqlx::{FromRow as _, Row as _};
    const SQL: &str = "SELECT dead_letter_id, tenant_id, external_id, source_id, event_type, status, reason, error, \
                attempts, replay_count, created_at, updated_at, replayed_at, headers, \
                payload AS payload_raw, octet_length(payload) AS payload_bytes \
         FROM dead_letters WHERE dead_letter_id = $1";
    let Some(row) = sqlx::query(SQL)
        .bind(dead_letter_id)
        .fetch_optional(executor)
        .await?
    else {
        return Ok(None);
    };
    let mut detail = DeadLetterDetail::from_row(&row)?;
    let raw: Option<Vec<u8>> = row.try_get("payload_raw")?;
    detail.payload = raw.map(|p| String::from_utf8_lossy(&p).into_owned());
    if let serde_json::Value::Object(headers) = &mut detail.headers {
        let signatures: Vec<String> = headers
            .keys()
            .filter(|name| crate::signature::is_signature_header(name))
            .cloned()
            .collect();
        for name in &signatures {
            headers.remove(name);
        }
        detail.withheld_headers = signatures;
    }
    Ok(Some(detail))
}

/// How many open dead letters match the filter (its `limit` ignored): a job's estimate.
pub async fn count_matching(
    executor: impl PgExecutor<'_>,
    f: &ReplayFilter,
) -> Result<i64, StoreError> {
    const SQL: &str = concat!("SELECT count(*) FROM dead_letters", open_and_matching!());
    Ok(bind_filter!(sqlx::query_scalar(SQL), f)
        .fetch_one(executor)
        .await?)
}

/// The next `limit` open dead letters matching the filter with an id above `after_id`, in id
/// order: a job's next step.
pub async fn select_open_after(
    executor: impl PgExecutor<'_>,
    f: &ReplayFilter,
    after_id: i64,
    limit: i64,
) -> Result<Vec<DeadLetter>, StoreError> {
    const SQL: &str = concat!(
        "SELECT dead_letter_id, tenant_id, external_id, event_type, status, error, attempts \
         FROM dead_letters",
        open_and_matching!(),
        " AND dead_letter_id > $7 ORDER BY dead_letter_id LIMIT $8"
    );
    Ok(bind_filter!(sqlx::query_as(SQL), f)
        .bind(after_id)
        .bind(limit)
        .fetch_all(executor)
        .await?)
}

/// Discards these letters that are still open, in one statement; how many it discarded.
pub async fn discard_open(executor: impl PgExecutor<'_>, ids: &[i64]) -> Result<u64, StoreError> {
    const SQL: &str = "UPDATE dead_letters SET status = 'discarded' \
         WHERE dead_letter_id = ANY($1) AND status IN ('new', 'investigating')";
    Ok(sqlx::query(SQL)
        .bind(ids)
        .execute(executor)
        .await?
        .rows_affected())
}
