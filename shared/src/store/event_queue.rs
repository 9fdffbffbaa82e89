//! The `event_queue` table: pending work. Claimed with `FOR UPDATE SKIP LOCKED`, left by DELETE.

use sqlx::{PgConnection, PgExecutor};

use super::StoreError;

/// An event claimed for processing, with what its handler needs.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ClaimedEvent {
    pub tenant_id: String,
    pub external_id: String,
    pub source_id: String,
    pub scheme: String,
    pub event_type: String,
    pub entity_id: Option<String>,
    pub entity_version: Option<i64>,
    /// Orders events of one entity and version (see `FieldMap::version_tiebreak`).
    pub version_tiebreak: Option<i64>,
    pub payload: Option<Vec<u8>>,
    pub payload_sha256: Vec<u8>,
    pub first_received_at: chrono::DateTime<chrono::Utc>,
    /// Attempts made before this one.
    pub attempts: i32,
    /// The event is already processed: reconcile re-queued it to re-assert its effects. A
    /// repair leaves the event row as it is, whatever its outcome.
    pub repair: bool,
}

/// The text that claims a batch, shared by [`claim`] and [`claim_completed`] so that both take
/// the same events in the same order: up to `$1` ready events, oldest first, their queue and
/// event rows locked, rows another drainer holds or a delivery is updating skipped. Each row
/// has a [`ClaimedEvent`]'s columns after `$columns` (more, each followed by a comma, from `q`
/// the queue row, `e` the event row and `s` its source, or empty); `$joined` is joined after
/// those three (or empty).
macro_rules! claim_batch {
    ($columns:literal, $joined:literal) => {
        concat!(
            "SELECT ",
            $columns,
            " q.tenant_id, q.external_id, e.source_id, s.scheme, e.event_type, e.entity_id, \
                 e.entity_version, e.version_tiebreak, e.payload, e.payload_sha256, e.first_received_at, \
                 e.attempts, e.status = 'processed' AS repair \
             FROM event_queue AS q \
             JOIN webhook_events AS e ON e.tenant_id = q.tenant_id AND e.external_id = q.external_id \
             JOIN sources AS s ON s.source_id = e.source_id ",
            $joined,
            " WHERE q.ready_at <= now() \
             ORDER BY q.ready_at \
             LIMIT $1 \
             FOR UPDATE OF q, e SKIP LOCKED"
        )
    };
}

/// Claims up to `limit` ready events, locking their queue and event rows for the caller's
/// transaction. Rows another drainer holds, or that a delivery is updating right now, are
/// skipped, not waited for.
pub async fn claim(conn: &mut PgConnection, limit: i64) -> Result<Vec<ClaimedEvent>, StoreError> {
    const SQL: &str = claim_batch!("", "");
    Ok(sqlx::query_as(SQL).bind(limit).fetch_all(conn).await?)
}

/// What each handler is declared to expect of an event it processed, as the arrays
/// [`claim_completed`] binds: one entry per registered (scheme, event type), and the fallback's
/// for every other event. Each entry says what the handler expects of an event that names an
/// entity and a version and of one that does not; an entry of `None` is a handler that declares
/// nothing (its events are claimed with no expectation, and the caller records theirs itself).
#[derive(Debug, Clone, Default)]
pub struct DeclaredExpectations<'a> {
    pub schemes: Vec<&'a str>,
    pub event_types: Vec<&'a str>,
    pub if_versioned: Vec<Option<&'static str>>,
    pub otherwise: Vec<Option<&'static str>>,
    /// The fallback handler's (if versioned, otherwise).
    pub fallback: (Option<&'static str>, Option<&'static str>),
}

/// An event [`claim_completed`] claimed and completed, with the expectation the statement
/// recorded for it (`None`: none was declared, or the event is a repair).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct CompletedClaim {
    #[sqlx(flatten)]
    pub event: ClaimedEvent,
    pub expects: Option<String>,
}

/// Claims up to `limit` ready events as [`claim`] does and, in the same statement, finishes
/// them as if every one of them succeeds: each queue row deleted; each pending event marked
/// processed with what its handler declares it expects (`declared`), as [`complete`] would,
/// its latency recorded; a repair's event row left as it was. For a batch whose effects are
/// applied as one unit: when any of them fails, the caller rolls the transaction back and
/// nothing of this stays. One statement and one round trip where claiming and completing took
/// two, and the rows it finishes are the rows it locked (by their row addresses), not looked
/// up again by key.
///
/// `processed_at` is this statement's time, which is when it started, not when it locked each
/// row. A redelivery that replaces a pending payload and commits while the statement runs,
/// before the statement reaches that row, is claimed in its new version. That version's
/// `received_at` can then be later than `processed_at` by up to the time the statement had run.
/// [`complete`], a later statement than its claim, cannot do this.
///
/// The statement finds the rows it completes by the addresses it locked. When a redelivery
/// committed an update of a claimed event after the statement began and before it locked the
/// row, the claim locks (and returns) that newer version, which the statement's own update
/// cannot see: the statement then marks fewer events processed than it claimed, and a second
/// statement completes the rest by key ([`complete_locked`]).
///
/// The rows are found again as an array of row addresses (`ctid = ANY(ARRAY(...))`), a TID scan
/// whatever the plan guesses of the batch: joined to the claim as a relation, the generic plan
/// a prepared statement may fall back to (which guesses a tenth of the queue for `LIMIT $1`)
/// hashed the whole queue and the whole event table to find 100 rows.
pub async fn claim_completed(
    conn: &mut PgConnection,
    limit: i64,
    declared: &DeclaredExpectations<'_>,
) -> Result<Vec<CompletedClaim>, StoreError> {
    const SQL: &str = concat!(
        "WITH c AS (",
        claim_batch!(
            "q.ctid AS queue_row, e.ctid AS event_row, q.ready_at, \
             CASE WHEN e.status = 'processed' THEN NULL \
                  WHEN e.entity_id IS NOT NULL AND e.entity_version IS NOT NULL \
                  THEN CASE WHEN r.scheme IS NULL THEN $6 ELSE r.if_versioned END \
                  ELSE CASE WHEN r.scheme IS NULL THEN $7 ELSE r.otherwise END END AS expects,",
            "LEFT JOIN unnest($2::text[], $3::text[], $4::text[], $5::text[]) \
                 AS r(scheme, event_type, if_versioned, otherwise) \
                 ON r.scheme = s.scheme AND r.event_type = e.event_type"
        ),
        "), \
         left_queue AS ( \
             DELETE FROM event_queue AS q WHERE q.ctid = ANY(ARRAY(SELECT queue_row FROM c))), \
         processed AS ( \
             UPDATE webhook_events AS e \
             SET status = 'processed', processed_at = statement_timestamp(), attempts = e.attempts + 1, last_error = NULL, \
                 expects = c.expects \
             FROM c \
             WHERE e.ctid = ANY(ARRAY(SELECT event_row FROM c WHERE NOT c.repair)) AND e.ctid = c.event_row \
             RETURNING e.first_received_at, EXTRACT(EPOCH FROM e.processed_at - e.received_at)::float8 AS seconds), \
         recorded AS (",
        super::processing_completions::record_latencies!("processed"),
        ") \
         SELECT c.tenant_id, c.external_id, c.source_id, c.scheme, c.event_type, c.entity_id, c.entity_version, \
             c.version_tiebreak, c.payload, c.payload_sha256, c.first_received_at, c.attempts, c.repair, c.expects, \
             (SELECT count(*) FROM processed) AS completed \
         FROM c ORDER BY c.ready_at"
    );
    let rows: Vec<ClaimRow> = sqlx::query_as(SQL)
        .bind(limit)
        .bind(&declared.schemes)
        .bind(&declared.event_types)
        .bind(&declared.if_versioned)
        .bind(&declared.otherwise)
        .bind(declared.fallback.0)
        .bind(declared.fallback.1)
        .fetch_all(&mut *conn)
        .await?;
    let completed = rows.first().map_or(0, |r| r.completed);
    let claims: Vec<CompletedClaim> = rows.into_iter().map(|r| r.claim).collect();
    let to_complete = claims.iter().filter(|c| !c.event.repair).count();
    if usize::try_from(completed).unwrap_or(0) < to_complete {
        // A redelivery committed between the statement's start and its lock: the claim locked
        // (and returned) a version its own snapshot cannot see, so the address-based update
        // missed it. This transaction holds those rows; found by key, they are completed now.
        let missed = claims.iter().filter(|c| !c.event.repair);
        let tenants: Vec<String> = missed.clone().map(|c| c.event.tenant_id.clone()).collect();
        let ids: Vec<String> = missed
            .clone()
            .map(|c| c.event.external_id.clone())
            .collect();
        let expects: Vec<Option<&str>> = missed.map(|c| c.expects.as_deref()).collect();
        let late = complete_locked(&mut *conn, &tenants, &ids, &expects).await?;
        tracing::info!(
            completed,
            late,
            "claimed events updated while the claim ran: completed by key"
        );
    }
    Ok(claims)
}

#[derive(sqlx::FromRow)]
struct ClaimRow {
    #[sqlx(flatten)]
    claim: CompletedClaim,
    /// How many events the statement marked processed.
    completed: i64,
}

/// The end of a statement that marks the pending events of `$rows` (a CTE of `tenant_id`,
/// `external_id` and `expects`) processed with what they expect, records their latencies
/// ([`super::processing_completions`]) and answers how many it marked. One text for
/// [`complete`] and [`complete_locked`].
macro_rules! mark_processed {
    ($rows:literal) => {
        concat!(
            "processed AS ( \
                 UPDATE webhook_events AS e \
                 SET status = 'processed', processed_at = statement_timestamp(), attempts = e.attempts + 1, \
                     last_error = NULL, expects = ", $rows, ".expects \
                 FROM ", $rows, " \
                 WHERE e.tenant_id = ", $rows, ".tenant_id AND e.external_id = ", $rows, ".external_id \
                   AND e.status = 'pending' \
                 RETURNING e.first_received_at, EXTRACT(EPOCH FROM e.processed_at - e.received_at)::float8 AS seconds), \
             recorded AS (",
            super::processing_completions::record_latencies!("processed"),
            ") \
             SELECT count(*) FROM processed"
        )
    };
}

/// Completes, by key, claimed events this transaction holds locked whose queue rows it already
/// deleted and that are still pending: what [`claim_completed`] finishes when its own update
/// could not see a row's newest version. Records their latencies as every completion does.
async fn complete_locked(
    executor: impl PgExecutor<'_>,
    tenants: &[String],
    ids: &[String],
    expects: &[Option<&str>],
) -> Result<u64, StoreError> {
    const SQL: &str = concat!(
        "WITH d AS ( \
             SELECT * FROM unnest($1::text[], $2::text[], $3::text[]) AS d(tenant_id, external_id, expects)), ",
        mark_processed!("d")
    );
    let processed: i64 = sqlx::query_scalar(SQL)
        .bind(tenants)
        .bind(ids)
        .bind(expects)
        .fetch_one(executor)
        .await?;
    Ok(processed as u64)
}

/// Records what their handlers expect of events already marked processed in this transaction
/// (by [`claim_completed`], for the events whose handler declared nothing or something else).
pub async fn record_expectations(
    executor: impl PgExecutor<'_>,
    tenants: &[String],
    ids: &[String],
    expects: &[&str],
) -> Result<u64, StoreError> {
    const SQL: &str = "UPDATE webhook_events AS e SET expects = d.expects \
         FROM unnest($1::text[], $2::text[], $3::text[]) AS d(tenant_id, external_id, expects) \
         WHERE e.tenant_id = d.tenant_id AND e.external_id = d.external_id AND e.status = 'processed'";
    if ids.is_empty() {
        return Ok(0);
    }
    Ok(sqlx::query(SQL)
        .bind(tenants)
        .bind(ids)
        .bind(expects)
        .execute(executor)
        .await?
        .rows_affected())
}

/// Marks events processed and removes them from the queue, in one statement, recording what
/// each event's handler expects reconciliation to find (`webhook_events.expects`).
/// `processed_at` is this statement's time: after the claim, so never before the payload it
/// processed was received. The same statement records the events' received → processed
/// latencies ([`super::processing_completions`]), for the anomaly pass's `processing_latency`.
pub async fn complete(
    executor: impl PgExecutor<'_>,
    tenants: &[String],
    ids: &[String],
    expects: &[&str],
) -> Result<u64, StoreError> {
    const SQL: &str = concat!(
        "WITH d AS ( \
             SELECT * FROM unnest($1::text[], $2::text[], $3::text[]) AS d(tenant_id, external_id, expects)), \
         done AS ( \
             DELETE FROM event_queue AS q USING d \
             WHERE q.tenant_id = d.tenant_id AND q.external_id = d.external_id \
             RETURNING q.tenant_id, q.external_id, d.expects), ",
        mark_processed!("done")
    );
    if ids.is_empty() {
        return Ok(0);
    }
    let processed: i64 = sqlx::query_scalar(SQL)
        .bind(tenants)
        .bind(ids)
        .bind(expects)
        .fetch_one(executor)
        .await?;
    Ok(processed as u64)
}

/// Removes repairs from the queue: their events stay exactly as they were.
pub async fn dequeue(
    executor: impl PgExecutor<'_>,
    tenants: &[String],
    ids: &[String],
) -> Result<u64, StoreError> {
    const SQL: &str = "DELETE FROM event_queue AS q USING unnest($1::text[], $2::text[]) AS d(tenant_id, external_id) \
         WHERE q.tenant_id = d.tenant_id AND q.external_id = d.external_id";
    if ids.is_empty() {
        return Ok(0);
    }
    Ok(sqlx::query(SQL)
        .bind(tenants)
        .bind(ids)
        .execute(executor)
        .await?
        .rows_affected())
}

/// Schedules retries: each event's next attempt after its own delay, its error recorded. An
/// event whose `attempts` this takes to 2 now counts as retried: its hour is marked for the
/// anomaly rollup (see [`super::delivery_hours`]).
pub async fn retry_later(
    executor: impl PgExecutor<'_>,
    tenants: &[String],
    ids: &[String],
    delays_ms: &[i64],
    errors: &[String],
) -> Result<u64, StoreError> {
    const SQL: &str = "WITH r AS ( \
             SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[]) \
                 AS r(tenant_id, external_id, delay_ms, error)), \
         requeued AS ( \
             UPDATE event_queue AS q SET ready_at = now() + make_interval(secs => r.delay_ms / 1000.0) \
             FROM r WHERE q.tenant_id = r.tenant_id AND q.external_id = r.external_id \
             RETURNING q.tenant_id, q.external_id, q.ready_at, r.error), \
         retried AS ( \
             UPDATE webhook_events AS e \
             SET attempts = e.attempts + 1, next_attempt_at = requeued.ready_at, last_error = requeued.error \
             FROM requeued \
             WHERE e.tenant_id = requeued.tenant_id AND e.external_id = requeued.external_id \
               AND e.status = 'pending' \
             RETURNING e.source_id, e.first_received_at, e.attempts), \
         counted_retried AS ( \
             INSERT INTO delivery_hours_dirty (source_id, hour) \
             SELECT DISTINCT source_id, date_trunc('hour', first_received_at) FROM retried WHERE attempts = 2) \
         SELECT count(*) FROM retried";
    if ids.is_empty() {
        return Ok(0);
    }
    let retried: i64 = sqlx::query_scalar(SQL)
        .bind(tenants)
        .bind(ids)
        .bind(delays_ms)
        .bind(errors)
        .fetch_one(executor)
        .await?;
    Ok(retried as u64)
}

/// How many events wait, and how old the oldest ready one is (seconds).
pub async fn backlog(executor: impl PgExecutor<'_>) -> Result<(i64, f64), StoreError> {
    const SQL: &str = "SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(enqueued_at))::float8, 0) FROM event_queue";
    Ok(sqlx::query_as(SQL).fetch_one(executor).await?)
}

/// The queue's events by source, read over at most `cap` queue rows (the earliest ready): a
/// source's pending events and how long its oldest has waited. Beyond `cap` rows the figures
/// are a lower bound and `capped` says so: the whole queue's depth is [`backlog`]'s.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SourceBacklog {
    pub source_id: String,
    pub pending: i64,
    pub oldest_pending_age_seconds: f64,
}

/// See [`SourceBacklog`]. Each queue row is looked up in `webhook_events` by its key (a
/// subquery per row: a join is planned as a scan of the table once the queue is large); `cap`
/// bounds the cost whatever the backlog (10 000 lookups take tens of milliseconds).
pub async fn backlog_by_source(
    executor: impl PgExecutor<'_>,
    cap: i64,
) -> Result<(Vec<SourceBacklog>, bool), StoreError> {
    const SQL: &str = "WITH q AS ( \
             SELECT tenant_id, external_id, enqueued_at, ready_at FROM event_queue \
             ORDER BY ready_at LIMIT $1 + 1), \
         r AS (SELECT * FROM q ORDER BY ready_at LIMIT $1) \
         SELECT s.source_id, count(*) AS pending, \
             EXTRACT(EPOCH FROM now() - min(s.enqueued_at))::float8 AS oldest_pending_age_seconds, \
             (SELECT count(*) FROM q) > $1 AS capped \
         FROM (SELECT r.enqueued_at, \
                      (SELECT e.source_id FROM webhook_events AS e \
                       WHERE e.tenant_id = r.tenant_id AND e.external_id = r.external_id) AS source_id \
               FROM r) AS s \
         WHERE s.source_id IS NOT NULL \
         GROUP BY s.source_id ORDER BY s.source_id";
    let rows: Vec<(String, i64, f64, bool)> = sqlx::query_as(SQL)
        .bind(cap.max(1))
        .fetch_all(executor)
        .await?;
    let capped = rows.first().is_some_and(|r| r.3);
    Ok((
        rows.into_iter()
            .map(|(source_id, pending, oldest, _)| SourceBacklog {
                source_id,
                pending,
                oldest_pending_age_seconds: oldest,
            })
            .collect(),
        capped,
    ))
}

/// Reclaims the queue's dead rows and index entries. Skips at once if another session is
/// already vacuuming it. Must run outside a transaction.
pub async fn vacuum(executor: impl PgExecutor<'_>) -> Result<(), StoreError> {
    sqlx::query("VACUUM (SKIP_LOCKED) event_queue")
        .execute(executor)
        .await?;
    Ok(())
}
