//! Reconciliation's reads and repairs: bounded, indexed statements, none holding locks longer
//! than one chunk.

use sqlx::PgExecutor;

use super::StoreError;

/// One event of a scanned chunk, with what is wrong with it (if anything).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ScannedEvent {
    pub tenant_id: String,
    pub external_id: String,
    /// `orphaned_pending`, `missing_effect`, `missing_outbox`, or NULL when consistent.
    pub problem: Option<String>,
    /// The payload is still stored: the event's handler can run again.
    pub has_payload: bool,
}

/// The next `limit` events after the cursor, by primary key, each checked against its queue
/// row and against what the handler that processed it declared (`webhook_events.expects`):
/// `projection`: the projection holds the event's version or a newer one, and a change this
/// event made after its row existed was announced; `fulfilment`: an order this event paid after
/// its row existed has its fulfilment row. A change or payment older than the event row was
/// made by an earlier delivery whose identity retention purged: nothing is expected of this
/// one. An event already in the queue (a repair under way) is not checked. The entity type is
/// derived from the event type exactly as the projection derives it (everything before the last
/// `.` or `/`).
pub async fn scan_chunk(
    executor: impl PgExecutor<'_>,
    after_tenant: &str,
    after_id: &str,
    limit: i64,
) -> Result<Vec<ScannedEvent>, StoreError> {
    const SQL: &str = "WITH chunk AS ( \
             SELECT tenant_id, external_id, event_type, entity_id, entity_version, status, expects, \
                    first_received_at, payload IS NOT NULL AS has_payload \
             FROM webhook_events WHERE (tenant_id, external_id) > ($1, $2) \
             ORDER BY tenant_id, external_id LIMIT $3) \
         SELECT c.tenant_id, c.external_id, c.has_payload, \
             CASE \
                 WHEN c.status = 'pending' AND q.external_id IS NULL THEN 'orphaned_pending' \
                 WHEN c.status <> 'processed' OR q.external_id IS NOT NULL THEN NULL \
                 WHEN c.expects = 'projection' \
                      AND (x.version IS NULL OR x.version < c.entity_version) THEN 'missing_effect' \
                 WHEN c.expects = 'projection' AND x.last_event_id = c.external_id \
                      AND x.updated_at >= c.first_received_at AND NOT EXISTS ( \
                      SELECT 1 FROM outbox o WHERE o.tenant_id = c.tenant_id AND o.external_id = c.external_id \
                        AND o.action = 'entity.changed') THEN 'missing_outbox' \
                 WHEN c.expects = 'fulfilment' AND p.paid_at >= c.first_received_at AND NOT EXISTS ( \
                      SELECT 1 FROM outbox o WHERE o.tenant_id = c.tenant_id AND o.external_id = c.external_id \
                        AND o.action = 'fulfil_order') THEN 'missing_outbox' \
             END AS problem \
         FROM chunk AS c \
         LEFT JOIN event_queue AS q ON q.tenant_id = c.tenant_id AND q.external_id = c.external_id \
         LEFT JOIN entities AS x ON c.expects = 'projection' AND x.tenant_id = c.tenant_id AND x.entity_id = c.entity_id \
              AND x.entity_type = regexp_replace(c.event_type, '[./][^./]*$', '') \
         LEFT JOIN orders AS p ON c.expects = 'fulfilment' AND p.tenant_id = c.tenant_id AND p.paid_by_event = c.external_id \
         ORDER BY c.tenant_id, c.external_id";
    Ok(sqlx::query_as(SQL)
        .bind(after_tenant)
        .bind(after_id)
        .bind(limit)
        .fetch_all(executor)
        .await?)
}

/// Where the scan resumes: (tenant_id, external_id), or the start of the table.
pub async fn cursor(executor: impl PgExecutor<'_>) -> Result<(String, String), StoreError> {
    const SQL: &str =
        "SELECT tenant_id, external_id FROM reconcile_cursors WHERE check_name = 'events'";
    Ok(sqlx::query_as(SQL)
        .fetch_optional(executor)
        .await?
        .unwrap_or_default())
}

pub async fn save_cursor(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    external_id: &str,
) -> Result<(), StoreError> {
    const SQL: &str = "INSERT INTO reconcile_cursors (check_name, tenant_id, external_id) VALUES ('events', $1, $2) \
         ON CONFLICT (check_name) DO UPDATE SET tenant_id = EXCLUDED.tenant_id, external_id = EXCLUDED.external_id, updated_at = now()";
    sqlx::query(SQL)
        .bind(tenant_id)
        .bind(external_id)
        .execute(executor)
        .await?;
    Ok(())
}

/// Puts events back through the normal path. A pending event that lost its queue row joins
/// the queue again; a processed event joins it as a repair and stays `processed`: the drain
/// re-runs its handler to re-assert its effects, and nothing (a delivery, a failure of the
/// repair) can rewrite or dead-letter it meanwhile.
pub async fn requeue(
    executor: impl PgExecutor<'_>,
    tenants: &[String],
    ids: &[String],
) -> Result<u64, StoreError> {
    const SQL: &str = "WITH r AS ( \
             SELECT * FROM unnest($1::text[], $2::text[]) AS r(tenant_id, external_id)), \
         pending AS ( \
             UPDATE webhook_events AS e SET next_attempt_at = now() FROM r \
             WHERE e.tenant_id = r.tenant_id AND e.external_id = r.external_id AND e.status = 'pending' \
             RETURNING e.tenant_id, e.external_id, false AS repair), \
         processed AS ( \
             SELECT e.tenant_id, e.external_id, true AS repair FROM webhook_events AS e JOIN r USING (tenant_id, external_id) \
             WHERE e.status = 'processed') \
         INSERT INTO event_queue (tenant_id, external_id, repair) \
         SELECT tenant_id, external_id, repair FROM pending UNION ALL SELECT tenant_id, external_id, repair FROM processed \
         ON CONFLICT (tenant_id, external_id) DO UPDATE SET ready_at = now()";
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

/// Events waiting longer than the SLA (seconds).
pub async fn pending_past_sla(
    executor: impl PgExecutor<'_>,
    sla_seconds: f64,
) -> Result<i64, StoreError> {
    const SQL: &str =
        "SELECT count(*) FROM event_queue WHERE enqueued_at < now() - make_interval(secs => $1)";
    Ok(sqlx::query_scalar(SQL)
        .bind(sla_seconds)
        .fetch_one(executor)
        .await?)
}

/// Outbox rows still pending past the window, and rows that failed for good.
pub async fn undelivered_outbox(
    executor: impl PgExecutor<'_>,
    window_seconds: f64,
) -> Result<(i64, i64), StoreError> {
    const SQL: &str = "SELECT count(*) FILTER (WHERE status = 'pending' AND created_at < now() - make_interval(secs => $1)), \
                count(*) FILTER (WHERE status = 'failed') \
         FROM outbox WHERE status IN ('pending', 'failed')";
    Ok(sqlx::query_as(SQL)
        .bind(window_seconds)
        .fetch_one(executor)
        .await?)
}

/// Makes overdue outbox rows due now (their backoff, or a lease that expired, pushed them out).
/// A row a sender holds leased is left to it: made due, a second sender would POST it too. A
/// paused subscription's message (parked: due never) waits for its resume.
pub async fn hurry_outbox(
    executor: impl PgExecutor<'_>,
    window_seconds: f64,
) -> Result<u64, StoreError> {
    const SQL: &str = "UPDATE outbox SET next_attempt_at = now() \
         WHERE status = 'pending' AND created_at < now() - make_interval(secs => $1) AND next_attempt_at > now() \
           AND next_attempt_at < 'infinity' AND (leased_until IS NULL OR leased_until <= now())";
    Ok(sqlx::query(SQL)
        .bind(window_seconds)
        .execute(executor)
        .await?
        .rows_affected())
}

/// Dead letters nobody has looked at for longer than `seconds`.
pub async fn untriaged_dead_letters(
    executor: impl PgExecutor<'_>,
    seconds: f64,
) -> Result<i64, StoreError> {
    const SQL: &str = "SELECT count(*) FROM dead_letters WHERE status = 'new' AND created_at < now() - make_interval(secs => $1)";
    Ok(sqlx::query_scalar(SQL)
        .bind(seconds)
        .fetch_one(executor)
        .await?)
}
