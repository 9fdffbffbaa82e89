//! The `unrepaired_losses` table: what reconcile found lost and could not repair, one row per
//! event, kept while the loss stands. Small (as many rows as losses), so the status verdict
//! counts it whole.

use sqlx::PgExecutor;

use super::StoreError;

/// Records events reconcile found lost with their payloads purged (`problems`:
/// `missing_effect` or `missing_outbox`). Found again, a row keeps its first finding.
pub async fn record_purged(
    executor: impl PgExecutor<'_>,
    tenants: &[String],
    ids: &[String],
    problems: &[String],
) -> Result<u64, StoreError> {
    const SQL: &str = "INSERT INTO unrepaired_losses (tenant_id, external_id, problem, reason) \
         SELECT t, e, p, 'payload_purged' FROM unnest($1::text[], $2::text[], $3::text[]) AS l(t, e, p) \
         ON CONFLICT (tenant_id, external_id) DO UPDATE SET problem = EXCLUDED.problem, \
             reason = EXCLUDED.reason, last_error = NULL, last_found_at = now()";
    if ids.is_empty() {
        return Ok(0);
    }
    Ok(sqlx::query(SQL)
        .bind(tenants)
        .bind(ids)
        .bind(problems)
        .execute(executor)
        .await?
        .rows_affected())
}

/// Records repairs that failed, with their errors (the drain, in its batch's transaction).
pub async fn record_failed_repairs(
    executor: impl PgExecutor<'_>,
    tenants: &[String],
    ids: &[String],
    errors: &[String],
) -> Result<u64, StoreError> {
    const SQL: &str = "INSERT INTO unrepaired_losses (tenant_id, external_id, problem, reason, last_error) \
         SELECT t, e, NULL, 'repair_failed', x FROM unnest($1::text[], $2::text[], $3::text[]) AS l(t, e, x) \
         ON CONFLICT (tenant_id, external_id) DO UPDATE SET reason = EXCLUDED.reason, \
             last_error = EXCLUDED.last_error, last_found_at = now()";
    if ids.is_empty() {
        return Ok(0);
    }
    Ok(sqlx::query(SQL)
        .bind(tenants)
        .bind(ids)
        .bind(errors)
        .execute(executor)
        .await?
        .rows_affected())
}

/// Clears the losses of events whose repair succeeded.
pub async fn clear(
    executor: impl PgExecutor<'_>,
    tenants: &[String],
    ids: &[String],
) -> Result<u64, StoreError> {
    const SQL: &str = "DELETE FROM unrepaired_losses AS u USING unnest($1::text[], $2::text[]) AS l(t, e) \
         WHERE u.tenant_id = l.t AND u.external_id = l.e";
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

/// Clears the losses of a scanned key range, `(after) < key <= (through)` (`through` `None`:
/// to the end of the table), except the events `still_lost` (the range's findings) and events
/// in the queue (a repair under way decides for itself): what is left there was found
/// consistent, or is no longer stored. Reads the loss table's key range, nothing else.
pub async fn clear_scanned(
    executor: impl PgExecutor<'_>,
    after: (&str, &str),
    through: Option<(&str, &str)>,
    still_lost: (&[String], &[String]),
) -> Result<u64, StoreError> {
    const SQL: &str = "DELETE FROM unrepaired_losses AS u \
         WHERE (u.tenant_id, u.external_id) > ($1, $2) \
           AND ($3::text IS NULL OR (u.tenant_id, u.external_id) <= ($3, $4)) \
           AND NOT EXISTS (SELECT 1 FROM unnest($5::text[], $6::text[]) AS l(t, e) \
                           WHERE l.t = u.tenant_id AND l.e = u.external_id) \
           AND NOT EXISTS (SELECT 1 FROM event_queue AS q \
                           WHERE q.tenant_id = u.tenant_id AND q.external_id = u.external_id)";
    Ok(sqlx::query(SQL)
        .bind(after.0)
        .bind(after.1)
        .bind(through.map(|t| t.0))
        .bind(through.map(|t| t.1).unwrap_or_default())
        .bind(still_lost.0)
        .bind(still_lost.1)
        .execute(executor)
        .await?
        .rows_affected())
}

/// The losses standing, by why they stay.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, sqlx::FromRow, serde::Serialize, serde::Deserialize,
)]
pub struct LossCounts {
    pub payload_purged: i64,
    pub repair_failed: i64,
}

impl LossCounts {
    pub fn total(&self) -> i64 {
        self.payload_purged + self.repair_failed
    }
}

pub async fn counts(executor: impl PgExecutor<'_>) -> Result<LossCounts, StoreError> {
    const SQL: &str = "SELECT count(*) FILTER (WHERE reason = 'payload_purged') AS payload_purged, \
                count(*) FILTER (WHERE reason = 'repair_failed') AS repair_failed \
         FROM unrepaired_losses";
    Ok(sqlx::query_as(SQL).fetch_one(executor).await?)
}
