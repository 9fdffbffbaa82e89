//! The `batch_requests` table: a batched delivery's bytes, kept once beside the events its
//! elements became (`crate::batches`).

use sqlx::PgExecutor;

use super::StoreError;

/// A batched delivery, as received.
#[derive(Debug, Clone)]
pub struct NewBatchRequest<'a> {
    pub tenant_id: &'a str,
    pub source_id: &'a str,
    pub received_at: chrono::DateTime<chrono::Utc>,
    /// The ids of the events it carried, in the order sent.
    pub external_ids: Vec<&'a str>,
    pub body: &'a [u8],
    pub body_sha256: [u8; 32],
    pub headers: &'a serde_json::Value,
    pub verified_with: &'a str,
}

/// Keeps the request; returns its id. In the caller's transaction, with the elements' upsert:
/// kept exactly when they are.
pub async fn record(
    executor: impl PgExecutor<'_>,
    request: &NewBatchRequest<'_>,
) -> Result<i64, StoreError> {
    const SQL: &str = "INSERT INTO batch_requests \
         (received_at, tenant_id, source_id, external_ids, body, body_sha256, headers, verified_with) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING batch_request_id";
    Ok(sqlx::query_scalar(SQL)
        .bind(request.received_at)
        .bind(request.tenant_id)
        .bind(request.source_id)
        .bind(&request.external_ids)
        .bind(request.body)
        .bind(&request.body_sha256[..])
        .bind(request.headers)
        .bind(request.verified_with)
        .fetch_one(executor)
        .await?)
}

/// Deletes up to `limit` requests received more than `age_seconds` ago, oldest first; returns
/// how many.
pub async fn purge_older_than(
    executor: impl PgExecutor<'_>,
    age_seconds: f64,
    limit: i64,
) -> Result<u64, StoreError> {
    const SQL: &str = "DELETE FROM batch_requests WHERE batch_request_id IN \
         (SELECT batch_request_id FROM batch_requests \
          WHERE received_at < now() - make_interval(secs => $1) \
          ORDER BY received_at LIMIT $2)";
    Ok(sqlx::query(SQL)
        .bind(age_seconds)
        .bind(limit)
        .execute(executor)
        .await?
        .rows_affected())
}
