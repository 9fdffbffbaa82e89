//! The `buffer_receipts` table: the delivery ids the buffer's consumer has filed, so a message
//! SQS delivers twice (or a send the SDK retried) is filed once.

use sqlx::PgExecutor;

use super::StoreError;

/// How long a receipt is kept: longer than a copy of a filed delivery can still arrive. SQS
/// keeps a message 14 days at most, counted from its first enqueue even in the dead-letter
/// queue; a redrive (`hookctl buffer redrive`) sends a dead letter back as a new message, with
/// 14 days more: 28 days in all, and a day's margin. (A copy arriving later still meets its
/// event's identity, kept 30 days by default, and is counted a duplicate; the receipt is what
/// keeps it from being counted at all.)
pub const RECEIPT_HORIZON: std::time::Duration = std::time::Duration::from_secs(29 * 24 * 3600);

/// Claims `delivery_ids` as filed, in the caller's transaction, and returns those not filed
/// before (each once, whatever its repeats in `delivery_ids`). A concurrent consumer holding one
/// of them uncommitted makes this wait for its outcome: filed there, it is not returned here.
pub async fn claim(
    executor: impl PgExecutor<'_>,
    delivery_ids: &[&str],
) -> Result<Vec<String>, StoreError> {
    const SQL: &str = "INSERT INTO buffer_receipts (delivery_id) SELECT unnest($1::text[]) \
         ON CONFLICT (delivery_id) DO NOTHING RETURNING delivery_id";
    // In one order whatever the batch's, so that two consumers holding copies of the same
    // deliveries wait on each other rather than deadlock.
    let mut sorted = delivery_ids.to_vec();
    sorted.sort_unstable();
    Ok(sqlx::query_scalar(SQL)
        .bind(sorted)
        .fetch_all(executor)
        .await?)
}

/// Deletes up to `limit` receipts filed more than `older_than` ago. Returns how many.
pub async fn prune_older_than(
    executor: impl PgExecutor<'_>,
    older_than: std::time::Duration,
    limit: i64,
) -> Result<u64, StoreError> {
    const SQL: &str = "DELETE FROM buffer_receipts AS r USING ( \
             SELECT delivery_id FROM buffer_receipts \
             WHERE filed_at < now() - make_interval(secs => $1) \
             ORDER BY filed_at LIMIT $2 FOR UPDATE SKIP LOCKED) AS batch \
         WHERE r.delivery_id = batch.delivery_id";
    Ok(sqlx::query(SQL)
        .bind(older_than.as_secs_f64())
        .bind(limit)
        .execute(executor)
        .await?
        .rows_affected())
}
