//! The `ingest_anomalies` table: authenticated deliveries that raised a question. Digest
//! conflicts, source collisions and replayed bodies are written by the event upsert itself,
//! one counted row per (source, kind, event id, delivered digest) (see `webhook_events`); this
//! file writes the deliveries that could not be filed at all.

use sqlx::PgExecutor;

use super::StoreError;

/// A signed delivery whose event fields could not be read (answered 400 by ingest, or, for a
/// buffered one, found unreadable by the consumer after ingest answered 200).
#[derive(Debug, Clone)]
pub struct UnreadableDelivery<'a> {
    pub tenant_id: &'a str,
    pub source_id: &'a str,
    /// `unparseable_payload`, `missing_field` or `invalid_field`.
    pub kind: &'static str,
    pub payload: &'a [u8],
    pub payload_sha256: [u8; 32],
    pub detail: &'a str,
    /// The headers kept beside a payload (`prepare::kept_headers`): what an event id or type
    /// read from a header needs when the kept delivery is filed later.
    pub headers: &'a serde_json::Value,
}

/// How the detail of an anomaly the buffer's consumer recorded begins: the provider was answered
/// 200 (`buffered`) and will not send the delivery again, unlike ingest's own 400s. The anomaly
/// checks and the refused-deliveries count tell the two apart by it.
pub const FROM_THE_BUFFER: &str = "buffered delivery ";

#[tracing::instrument(skip_all, fields(tenant_id = delivery.tenant_id, source_id = delivery.source_id, kind = delivery.kind), err)]
pub async fn record_unreadable(
    executor: impl PgExecutor<'_>,
    delivery: &UnreadableDelivery<'_>,
) -> Result<i64, StoreError> {
    const SQL: &str = "INSERT INTO ingest_anomalies (tenant_id, source_id, kind, payload_sha256, payload, detail, headers) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING anomaly_id";
    let id: i64 = sqlx::query_scalar(SQL)
        .bind(delivery.tenant_id)
        .bind(delivery.source_id)
        .bind(delivery.kind)
        .bind(&delivery.payload_sha256[..])
        .bind(delivery.payload)
        .bind(delivery.detail)
        .bind(delivery.headers)
        .fetch_one(executor)
        .await?;
    Ok(id)
}

/// The kinds of anomaly that keep a signed delivery for which no event was stored: what
/// [`kept_delivery`] can hand back to be filed.
pub const KEPT_DELIVERY_KINDS: [&str; 4] = [
    "unparseable_payload",
    "missing_field",
    "invalid_field",
    "buffered_source_unavailable",
];

/// A delivery an anomaly kept, as filing it needs it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct KeptDelivery {
    pub anomaly_id: i64,
    pub tenant_id: String,
    pub source_id: String,
    pub kind: String,
    /// `None` once retention purged it.
    pub payload: Option<Vec<u8>>,
    /// The kept headers; `None` for a row recorded before they were kept.
    pub headers: Option<serde_json::Value>,
    pub detected_at: chrono::DateTime<chrono::Utc>,
    /// The event id it was filed under, once filed.
    pub filed_as: Option<String>,
}

/// The delivery anomaly `anomaly_id` kept, locked for the caller's transaction (two operators
/// filing it at once: the second waits and sees it filed).
pub async fn kept_delivery(
    executor: impl PgExecutor<'_>,
    anomaly_id: i64,
) -> Result<Option<KeptDelivery>, StoreError> {
    const SQL: &str = "SELECT anomaly_id, tenant_id, source_id, kind, payload, headers, detected_at, filed_as \
         FROM ingest_anomalies WHERE anomaly_id = $1 FOR UPDATE";
    Ok(sqlx::query_as(SQL)
        .bind(anomaly_id)
        .fetch_optional(executor)
        .await?)
}

/// Records that the delivery anomaly `anomaly_id` kept was filed as event `external_id`.
pub async fn mark_filed(
    executor: impl PgExecutor<'_>,
    anomaly_id: i64,
    external_id: &str,
) -> Result<(), StoreError> {
    const SQL: &str =
        "UPDATE ingest_anomalies SET filed_at = now(), filed_as = $2 WHERE anomaly_id = $1";
    sqlx::query(SQL)
        .bind(anomaly_id)
        .bind(external_id)
        .execute(executor)
        .await?;
    Ok(())
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
           AND detail NOT LIKE 'buffered delivery %' \
           AND detected_at > now() - interval '1 day' \
         GROUP BY source_id ORDER BY source_id";
    Ok(sqlx::query_as(SQL).fetch_all(executor).await?)
}
