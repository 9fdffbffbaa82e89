//! The `orders` and `payment_exceptions` tables: the payments reference flow.

use sqlx::{PgConnection, PgExecutor};

use super::StoreError;

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Order {
    pub order_id: String,
    pub merchant_reference: String,
    pub gateway_order_id: Option<String>,
    pub amount_minor: i64,
    pub currency: String,
    pub state: String,
    pub paid_by_event: Option<String>,
    pub paid_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// The order, locked for the rest of the caller's transaction.
pub async fn lock(
    conn: &mut PgConnection,
    tenant_id: &str,
    order_id: &str,
) -> Result<Option<Order>, StoreError> {
    const SQL: &str = "SELECT order_id, merchant_reference, gateway_order_id, amount_minor, currency, state, paid_by_event, paid_at \
         FROM orders WHERE tenant_id = $1 AND order_id = $2 FOR UPDATE";
    Ok(sqlx::query_as(SQL)
        .bind(tenant_id)
        .bind(order_id)
        .fetch_optional(conn)
        .await?)
}

/// The one forward transition a payment makes: awaiting_payment → paid.
pub async fn mark_paid(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    order_id: &str,
    gateway_order_id: &str,
    external_id: &str,
) -> Result<bool, StoreError> {
    const SQL: &str = "UPDATE orders SET state = 'paid', paid_by_event = $3, paid_at = now(), \
             gateway_order_id = COALESCE(gateway_order_id, $4), updated_at = now() \
         WHERE tenant_id = $1 AND order_id = $2 AND state = 'awaiting_payment'";
    let done = sqlx::query(SQL)
        .bind(tenant_id)
        .bind(order_id)
        .bind(external_id)
        .bind(gateway_order_id)
        .execute(executor)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// Records why a payment event did not pay its order. Idempotent per (event, kind).
pub async fn record_exception(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    external_id: &str,
    order_id: Option<&str>,
    kind: &str,
    detail: &str,
) -> Result<(), StoreError> {
    const SQL: &str = "INSERT INTO payment_exceptions (tenant_id, external_id, order_id, kind, detail) \
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (tenant_id, external_id, kind) DO NOTHING";
    sqlx::query(SQL)
        .bind(tenant_id)
        .bind(external_id)
        .bind(order_id)
        .bind(kind)
        .bind(detail)
        .execute(executor)
        .await?;
    Ok(())
}
