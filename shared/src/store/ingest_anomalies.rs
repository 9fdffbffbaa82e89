//! The `ingest_anomalies` table: authenticated deliveries that raised a question. Digest
//! conflicts, source collisions and replayed bodies are written by the event upsert itself,
//! one counted row per (source, kind, event id, delivered digest) (see `webhook_events`); this
//! file writes the deliveries that could not be filed at all.

use sqlx::PgExecutor;

use super::StoreError;

/// A signed delivery whose event fields could not be read, or a buffered one that can no longer
/// be filed (its source disabled since ingest verified it).
#[derive(Debug, Clone)]
pub struct UnreadableDelivery<'a> {
    pub tenant_id: &'a str,
    pub source_id: &'a str,
    /// `unparseable_payload`, `missing_field` or `invalid_field`; for a buffered delivery also
    /// `buffered_source_unavailable`.
    pub kind: &'static str,
    pub payload: &'a [u8],
    pub payload_sha256: [u8; 32],
    pub detail: &'a str,
}

#[tracing::instrument(skip_all, fields(tenant_id = delivery.tenant_id, source_id = delivery.source_id, kind = delivery.kind), err)]
pub async fn record_unreadable(
    executor: impl PgExecutor<'_>,
    delivery: &UnreadableDelivery<'_>,
) -> Result<i64, StoreError> {
    const SQL: &str = "INSERT INTO ingest_anomalies (tenant_id, source_id, kind, payload_sha256, payload, detail) \
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING anomaly_id";
    let id: i64 = sqlx::query_scalar(SQL)
        .bind(delivery.tenant_id)
        .bind(delivery.source_id)
        .bind(delivery.kind)
        .bind(&delivery.payload_sha256[..])
        .bind(delivery.payload)
        .bind(delivery.detail)
        .fetch_one(executor)
        .await?;
    Ok(id)
}

/// A delivery whose effect was applied before its event row existed: its identity had been
/// purged by retention and the provider delivered it again. No second effect was made.
pub async fn record_redelivered_after_purge(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    source_id: &str,
    external_id: &str,
    payload_sha256: &[u8],
) -> Result<(), StoreError> {
    const SQL: &str = "INSERT INTO ingest_anomalies (tenant_id, source_id, kind, external_id, payload_sha256, detail) \
         VALUES ($1, $2, 'redelivered_after_purge', $3, $4, \
                 'delivered again after retention purged its identity; its effect was already applied and was not repeated')";
    sqlx::query(SQL)
        .bind(tenant_id)
        .bind(source_id)
        .bind(external_id)
        .bind(payload_sha256)
        .execute(executor)
        .await?;
    Ok(())
}

/// Signed deliveries refused in the last day (answered 400: unreadable, no id, unusable field),
/// by source. Signature failures are not here: they are never stored.
pub async fn refused_last_day_by_source(
    executor: impl PgExecutor<'_>,
) -> Result<Vec<(String, i64)>, StoreError> {
    const SQL: &str = "SELECT source_id, count(*) FROM ingest_anomalies \
         WHERE kind IN ('unparseable_payload', 'missing_field', 'invalid_field') \
           AND detected_at > now() - interval '1 day' \
         GROUP BY source_id ORDER BY source_id";
    Ok(sqlx::query_as(SQL).fetch_all(executor).await?)
}
