//! Retention's bounded purges. Payload bytes go first; identity (the dedup key) only after a
//! horizon longer than any provider's retry window, together with its outbox rows.

use sqlx::PgExecutor;

use super::StoreError;

/// A CTE for a statement whose `purged` CTE names the events whose payload it cleared: their
/// subscriptions' messages lose the copy of the data their envelope carries, marked `purged`
/// with the operator request that says so (`subscriptions::envelope`), so no copy of a payload
/// outlives its horizon. A message still waiting is sent so.
macro_rules! forwarded_data_purged {
    () => {
        " forwarded_data_purged AS ( \
             UPDATE outbox AS o SET payload = (o.payload - 'data' - 'data_base64') || jsonb_build_object( \
                 'dataomitted', 'purged', \
                 'datafetch', jsonb_build_object('action', 'show_event', 'tenant_id', o.tenant_id, \
                                                 'external_id', o.external_id)::text) \
             FROM purged AS p \
             WHERE o.tenant_id = p.tenant_id AND o.external_id = p.external_id \
               AND o.action LIKE 'event:%' AND (o.payload ? 'data' OR o.payload ? 'data_base64')), "
    };
}

/// What one batch of [`purge_payloads`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PayloadBatch {
    /// Events the cursor walked over (with a payload or not): fewer than the limit when it
    /// reached the horizon.
    pub examined: u64,
    /// Of those, payloads cleared. The cursor moves past the last event examined (by its
    /// instant, then its key): another batch never walks the same events again.
    pub purged: u64,
}

/// Clears payload bytes of up to `limit` finished events first received before `age_seconds`,
/// resuming from the stored cursor (which moves past what was examined; a bound of the time
/// index's range, so a batch reads from it on, not every older event). An examined event it
/// could not clear (still pending: the drain needs its payload) is listed in
/// `payloads_awaiting_processing` for [`purge_processed_since_passed`]; one with no payload
/// (a held replay, whose bytes are never copied) is walked over. A batch that clears nothing
/// is therefore not the last: the walk ends when a batch examines fewer than `limit`.
pub async fn purge_payloads(
    executor: impl PgExecutor<'_>,
    age_seconds: f64,
    limit: i64,
) -> Result<PayloadBatch, StoreError> {
    // The cursor: the instant and, at it, the last event examined; from a row a previous build
    // moved (`after_at` not `through`), every event at the instant.
    const SQL: &str = concat!(
        "WITH stored AS ( \
             SELECT through, after_at, after_tenant_id, after_external_id \
             FROM retention_cursors WHERE name = 'payloads'), \
         cursor AS ( \
             SELECT COALESCE((SELECT through FROM stored), '-infinity') AS through, \
                    COALESCE((SELECT after_tenant_id FROM stored WHERE after_at = through), '') AS tenant_id, \
                    COALESCE((SELECT after_external_id FROM stored WHERE after_at = through), '') AS external_id), \
         batch AS ( \
             SELECT e.tenant_id, e.external_id, e.first_received_at, e.payload IS NOT NULL AS has_payload \
             FROM webhook_events AS e, cursor AS c \
             WHERE e.first_received_at >= c.through \
               AND (e.first_received_at > c.through OR (e.tenant_id, e.external_id) > (c.tenant_id, c.external_id)) \
               AND e.first_received_at < now() - make_interval(secs => $1) \
             ORDER BY e.first_received_at, e.tenant_id, e.external_id LIMIT $2), \
         purged AS ( \
             UPDATE webhook_events AS e SET payload = NULL FROM batch \
             WHERE e.tenant_id = batch.tenant_id AND e.external_id = batch.external_id \
               AND e.status <> 'pending' AND e.payload IS NOT NULL \
             RETURNING e.tenant_id, e.external_id), ",
        forwarded_data_purged!(),
        " awaiting AS ( \
             INSERT INTO payloads_awaiting_processing (tenant_id, external_id) \
             SELECT b.tenant_id, b.external_id FROM batch AS b \
             WHERE b.has_payload AND NOT EXISTS ( \
                 SELECT 1 FROM purged AS p WHERE p.tenant_id = b.tenant_id AND p.external_id = b.external_id) \
             ON CONFLICT DO NOTHING), \
         last AS ( \
             SELECT first_received_at, tenant_id, external_id FROM batch \
             ORDER BY first_received_at DESC, tenant_id DESC, external_id DESC LIMIT 1), \
         moved AS ( \
             INSERT INTO retention_cursors (name, through, after_at, after_tenant_id, after_external_id) \
             SELECT 'payloads', first_received_at, first_received_at, tenant_id, external_id FROM last \
             ON CONFLICT (name) DO UPDATE SET through = EXCLUDED.through, after_at = EXCLUDED.after_at, \
                 after_tenant_id = EXCLUDED.after_tenant_id, after_external_id = EXCLUDED.after_external_id) \
         SELECT (SELECT count(*) FROM batch), (SELECT count(*) FROM purged)"
    );
    let (examined, purged): (i64, i64) = sqlx::query_as(SQL)
        .bind(age_seconds)
        .bind(limit)
        .fetch_one(executor)
        .await?;
    Ok(PayloadBatch {
        examined: examined as u64,
        purged: purged as u64,
    })
}

/// Lists for the payload purge ([`purge_processed_since_passed`]) those of the given events that
/// were stored behind its cursor with a payload: filed late by the buffer's consumer (a delivery
/// redriven from the dead-letter queue days after ingest received it), under a received time
/// the cursor has walked past and never walks again. In the filing transaction, so an event
/// cannot land behind the cursor unlisted. Returns how many were listed.
pub async fn list_filed_behind_payload_cursor(
    executor: impl PgExecutor<'_>,
    tenants: &[&str],
    ids: &[&str],
) -> Result<u64, StoreError> {
    const SQL: &str = "INSERT INTO payloads_awaiting_processing (tenant_id, external_id) \
         SELECT e.tenant_id, e.external_id \
         FROM unnest($1::text[], $2::text[]) AS d(tenant_id, external_id) \
         JOIN webhook_events AS e ON e.tenant_id = d.tenant_id AND e.external_id = d.external_id \
         WHERE e.payload IS NOT NULL \
           AND e.first_received_at <= (SELECT through FROM retention_cursors WHERE name = 'payloads') \
         ON CONFLICT DO NOTHING";
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

/// What one look at the events the payload cursor passed while pending found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AwaitingPass {
    /// Listed events that were finished (or gone, or already without a payload).
    pub examined: u64,
    /// Of those, payloads cleared.
    pub purged: u64,
}

/// Clears the payloads of up to `limit` events the cursor of [`purge_payloads`] passed while
/// they were pending and that have finished since (they are past the payload horizon: the
/// cursor only walks events that are), and forgets them; also forgets listed events that are
/// gone or have no payload. Events still pending stay listed. The list holds only events that
/// were pending past the horizon, so the look costs what they number, not the table's size.
pub async fn purge_processed_since_passed(
    executor: impl PgExecutor<'_>,
    limit: i64,
) -> Result<AwaitingPass, StoreError> {
    const SQL: &str = concat!(
        "WITH due AS ( \
             SELECT w.tenant_id, w.external_id, (e.tenant_id IS NULL OR e.payload IS NULL) AS nothing_left \
             FROM payloads_awaiting_processing AS w \
             LEFT JOIN webhook_events AS e ON e.tenant_id = w.tenant_id AND e.external_id = w.external_id \
             WHERE e.tenant_id IS NULL OR e.payload IS NULL OR e.status <> 'pending' \
             LIMIT $1), \
         purged AS ( \
             UPDATE webhook_events AS e SET payload = NULL FROM due \
             WHERE e.tenant_id = due.tenant_id AND e.external_id = due.external_id \
               AND e.status <> 'pending' AND e.payload IS NOT NULL \
             RETURNING e.tenant_id, e.external_id), ",
        forwarded_data_purged!(),
        " forgotten AS ( \
             DELETE FROM payloads_awaiting_processing AS w USING due \
             WHERE w.tenant_id = due.tenant_id AND w.external_id = due.external_id \
               AND (due.nothing_left OR EXISTS ( \
                   SELECT 1 FROM purged AS p WHERE p.tenant_id = w.tenant_id AND p.external_id = w.external_id))) \
         SELECT (SELECT count(*) FROM due), (SELECT count(*) FROM purged)"
    );
    let (examined, purged): (i64, i64) =
        sqlx::query_as(SQL).bind(limit).fetch_one(executor).await?;
    Ok(AwaitingPass {
        examined: examined as u64,
        purged: purged as u64,
    })
}

/// What one identity purge deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdentitiesPurged {
    pub events: u64,
    /// Closed (replayed or discarded) dead letters deleted with their events.
    pub closed_dead_letters: u64,
}

/// The events the identity purge may delete, as an SQL condition on `webhook_events AS e`, the
/// horizon in seconds being the SQL expression `$h`: finished (processed, or dead-lettered),
/// neither received nor seen within the horizon, with no open dead letter nor one closed
/// within it, no outbox row still to deliver or to decide, and no queue row. One text for the
/// purge and for the anomaly check that measures how far it lags
/// (`identity_purge_lag_seconds`), so the two cannot disagree on what is due.
macro_rules! identity_purgeable {
    ($h:literal) => {
        concat!(
            "e.first_received_at < now() - make_interval(secs => ", $h, ") \
               AND e.last_seen_at < now() - make_interval(secs => ", $h, ") \
               AND e.status IN ('processed', 'dead_lettered') \
               AND NOT EXISTS (SELECT 1 FROM dead_letters AS d WHERE d.tenant_id = e.tenant_id AND d.external_id = e.external_id \
                               AND (d.status IN ('new', 'investigating') OR d.updated_at >= now() - make_interval(secs => ", $h, "))) \
               AND NOT EXISTS (SELECT 1 FROM outbox AS o WHERE o.tenant_id = e.tenant_id AND o.external_id = e.external_id \
                               AND o.status IN ('pending', 'failed')) \
               AND NOT EXISTS (SELECT 1 FROM event_queue AS q WHERE q.tenant_id = e.tenant_id AND q.external_id = e.external_id)"
        )
    };
}
pub(crate) use identity_purgeable;

/// Deletes up to `limit` finished events (processed, or dead-lettered with the letter closed)
/// neither received nor seen within `horizon_seconds`, with their outbox rows and their closed
/// dead letters. Kept: an event with an open dead letter (the letter needs it, however old), or
/// one whose letter closed within the horizon (the operator's record of the replay or the
/// discard stays that long), or with an outbox row still to deliver (pending) or still to decide
/// (failed: an operator resends or discards it), or one still queued (a repair reconcile re-queued:
/// the queue row would go with the event, by cascade, and the repair with it). The hours of
/// deleted events the anomaly rollup still keeps are marked for it (`delivery_hours_dirty`).
pub async fn purge_identities(
    executor: impl PgExecutor<'_>,
    horizon_seconds: f64,
    limit: i64,
) -> Result<IdentitiesPurged, StoreError> {
    const SQL: &str = concat!(
        "WITH batch AS ( \
             SELECT e.tenant_id, e.external_id FROM webhook_events AS e WHERE ",
        identity_purgeable!("$1"),
        " ORDER BY e.first_received_at LIMIT $2 FOR UPDATE SKIP LOCKED), \
         letters_gone AS ( \
             DELETE FROM dead_letters AS d USING batch \
             WHERE d.tenant_id = batch.tenant_id AND d.external_id = batch.external_id RETURNING 1), \
         outbox_gone AS ( \
             DELETE FROM outbox AS o USING batch \
             WHERE o.tenant_id = batch.tenant_id AND o.external_id = batch.external_id RETURNING o.outbox_id), \
         destinations_gone AS ( \
             DELETE FROM outbox_destinations AS d USING outbox_gone WHERE d.outbox_id = outbox_gone.outbox_id), \
         filings_gone AS ( \
             DELETE FROM event_filings AS f USING batch \
             WHERE f.tenant_id = batch.tenant_id AND f.external_id = batch.external_id), \
         gone AS ( \
             DELETE FROM webhook_events AS e USING batch \
             WHERE e.tenant_id = batch.tenant_id AND e.external_id = batch.external_id \
             RETURNING e.source_id, e.first_received_at), \
         marked AS ( \
             INSERT INTO delivery_hours_dirty (source_id, hour) \
             SELECT DISTINCT source_id, date_trunc('hour', first_received_at) FROM gone \
             WHERE first_received_at >= date_trunc('hour', now() - make_interval(days => $3::int))) \
         SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM letters_gone)"
    );
    let (events, letters): (i64, i64) = sqlx::query_as(SQL)
        .bind(horizon_seconds)
        .bind(limit)
        .bind(super::delivery_hours::DAYS)
        .fetch_one(executor)
        .await?;
    Ok(IdentitiesPurged {
        events: events as u64,
        closed_dead_letters: letters as u64,
    })
}

/// Clears the payload copies of up to `limit` dead letters closed (replayed or discarded) more
/// than `age_seconds` ago. An open letter keeps its copy: its replay needs it once the event's
/// own payload is purged. Returns how many were cleared.
pub async fn purge_closed_dead_letter_payloads(
    executor: impl PgExecutor<'_>,
    age_seconds: f64,
    limit: i64,
) -> Result<u64, StoreError> {
    const SQL: &str = "UPDATE dead_letters AS d SET payload = NULL \
         FROM (SELECT dead_letter_id FROM dead_letters \
               WHERE status IN ('replayed', 'discarded') AND payload IS NOT NULL \
                 AND updated_at < now() - make_interval(secs => $1) \
               ORDER BY dead_letter_id LIMIT $2 FOR UPDATE SKIP LOCKED) AS batch \
         WHERE d.dead_letter_id = batch.dead_letter_id";
    Ok(sqlx::query(SQL)
        .bind(age_seconds)
        .bind(limit)
        .execute(executor)
        .await?
        .rows_affected())
}

/// Deletes records that only describe the past: anomalies last seen, run rows started, and
/// operator jobs and replays to a subscription finished, before the horizon. (An anomaly row
/// counts every delivery of one body under one id: it stays while they keep coming. A job or a
/// replay still running stays whatever its age; one finished is told by its operator action.)
pub async fn purge_history(
    executor: impl PgExecutor<'_>,
    horizon_seconds: f64,
    limit: i64,
) -> Result<u64, StoreError> {
    const SQL: &str = "WITH a AS ( \
             DELETE FROM ingest_anomalies WHERE anomaly_id IN ( \
                 SELECT anomaly_id FROM ingest_anomalies \
                 WHERE COALESCE(last_seen_at, detected_at) < now() - make_interval(secs => $1) \
                 ORDER BY anomaly_id LIMIT $2) RETURNING 1), \
         r AS ( \
             DELETE FROM maintenance_runs WHERE run_id IN ( \
                 SELECT run_id FROM maintenance_runs WHERE started_at < now() - make_interval(secs => $1) \
                 ORDER BY run_id LIMIT $2) RETURNING 1), \
         j AS ( \
             DELETE FROM operator_jobs WHERE job_id IN ( \
                 SELECT job_id FROM operator_jobs \
                 WHERE status <> 'running' AND finished_at < now() - make_interval(secs => $1) \
                 ORDER BY job_id LIMIT $2) RETURNING 1), \
         s AS ( \
             DELETE FROM subscription_replays WHERE replay_id IN ( \
                 SELECT replay_id FROM subscription_replays \
                 WHERE status <> 'running' AND finished_at < now() - make_interval(secs => $1) \
                 ORDER BY replay_id LIMIT $2) RETURNING 1) \
         SELECT (SELECT count(*) FROM a) + (SELECT count(*) FROM r) + (SELECT count(*) FROM j) \
              + (SELECT count(*) FROM s)";
    let deleted: i64 = sqlx::query_scalar(SQL)
        .bind(horizon_seconds)
        .bind(limit)
        .fetch_one(executor)
        .await?;
    Ok(deleted as u64)
}

/// Deletes up to `limit` signed-body digests first seen before `horizon_seconds` (the replay
/// horizon, longer than identity's): a body re-posted after that is no longer refused as a
/// replay by its digest.
pub async fn purge_signed_bodies(
    executor: impl PgExecutor<'_>,
    horizon_seconds: f64,
    limit: i64,
) -> Result<u64, StoreError> {
    const SQL: &str = "DELETE FROM signed_bodies AS b USING ( \
             SELECT source_id, payload_sha256 FROM signed_bodies \
             WHERE first_seen_at < now() - make_interval(secs => $1) \
             ORDER BY first_seen_at LIMIT $2 FOR UPDATE SKIP LOCKED) AS batch \
         WHERE b.source_id = batch.source_id AND b.payload_sha256 = batch.payload_sha256";
    Ok(sqlx::query(SQL)
        .bind(horizon_seconds)
        .bind(limit)
        .execute(executor)
        .await?
        .rows_affected())
}
