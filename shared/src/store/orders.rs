//! The `orders` and `payment_exceptions` tables: the payments reference flow.

use sqlx::{PgConnection, PgExecutor};

use super::{StoreError, column};

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Order {
    pub tenant_id: String,
    pub order_id: String,
    pub merchant_reference: String,
    pub gateway_order_id: Option<String>,
    pub amount_minor: i64,
    pub currency: String,
    pub state: String,
    pub paid_by_event: Option<String>,
    pub paid_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// The orders named by (tenant, order id) pairs that exist, locked for the rest of the caller's
/// transaction, in key order: concurrent drainers locking overlapping sets never deadlock.
pub async fn lock_all(
    conn: &mut PgConnection,
    tenants: &[&str],
    order_ids: &[&str],
) -> Result<Vec<Order>, StoreError> {
    const SQL: &str = "SELECT o.tenant_id, o.order_id, o.merchant_reference, o.gateway_order_id, o.amount_minor, \
             o.currency, o.state, o.paid_by_event, o.paid_at \
         FROM orders AS o \
         WHERE (o.tenant_id, o.order_id) IN (SELECT * FROM unnest($1::text[], $2::text[])) \
         ORDER BY o.tenant_id, o.order_id \
         FOR UPDATE OF o";
    if order_ids.is_empty() {
        return Ok(Vec::new());
    }
    // Planned afresh with the keys in hand, like the entity projection's statement (see
    // `entities::apply_versioned`): a cached generic plan would join by a sequential scan.
    Ok(sqlx::query_as(SQL)
        .persistent(false)
        .bind(tenants)
        .bind(order_ids)
        .fetch_all(conn)
        .await?)
}

/// What a group of payment events does to the orders it locked, written by [`settle`].
#[derive(Debug, Default)]
pub struct Settlement {
    pub paid: Vec<Payment>,
    pub fulfilments: Vec<Fulfilment>,
    pub exceptions: Vec<PaymentException>,
}

/// An order's one forward transition, awaiting_payment → paid.
#[derive(Debug)]
pub struct Payment {
    pub tenant_id: String,
    pub order_id: String,
    pub gateway_order_id: String,
    /// The paying event.
    pub external_id: String,
}

/// A paid order's fulfilment message, for the outbox.
#[derive(Debug)]
pub struct Fulfilment {
    pub tenant_id: String,
    pub external_id: String,
    pub message: serde_json::Value,
    pub idempotency_key: String,
}

/// Why a payment event did not pay its order.
#[derive(Debug)]
pub struct PaymentException {
    pub tenant_id: String,
    pub external_id: String,
    pub order_id: Option<String>,
    pub kind: &'static str,
    pub detail: String,
}

impl Settlement {
    pub fn is_empty(&self) -> bool {
        self.paid.is_empty() && self.fulfilments.is_empty() && self.exceptions.is_empty()
    }
}

/// Writes a settlement in one statement: each paid order's one forward transition
/// (awaiting_payment → paid), the fulfilment outbox rows (`fulfilment_action`, once per paying
/// event: written again, a no-op) and the exception rows (once per event and kind). Returns
/// how many orders it paid: fewer than asked means an order was not awaiting payment after all.
/// A payment is stamped with the time of this statement, never the transaction's start (see
/// `entities::apply_versioned`): `paid_at` is never older than the paying event's receipt.
pub async fn settle(
    executor: impl PgExecutor<'_>,
    settlement: &Settlement,
    fulfilment_action: &str,
) -> Result<u64, StoreError> {
    const SQL: &str = "WITH paid AS ( \
             UPDATE orders AS o SET state = 'paid', paid_by_event = p.external_id, paid_at = statement_timestamp(), \
                 gateway_order_id = COALESCE(o.gateway_order_id, p.gateway_order_id), updated_at = statement_timestamp() \
             FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) \
                 AS p(tenant_id, order_id, gateway_order_id, external_id) \
             WHERE o.tenant_id = p.tenant_id AND o.order_id = p.order_id AND o.state = 'awaiting_payment' \
             RETURNING 1), \
         fulfilments AS ( \
             INSERT INTO outbox (tenant_id, external_id, action, payload, idempotency_key) \
             SELECT f.tenant_id, f.external_id, $5, f.payload, f.idempotency_key \
             FROM unnest($6::text[], $7::text[], $8::jsonb[], $9::text[]) \
                 AS f(tenant_id, external_id, payload, idempotency_key) \
             ON CONFLICT (tenant_id, external_id, action) DO NOTHING), \
         exceptions AS ( \
             INSERT INTO payment_exceptions (tenant_id, external_id, order_id, kind, detail) \
             SELECT * FROM unnest($10::text[], $11::text[], $12::text[], $13::text[], $14::text[]) \
             ON CONFLICT (tenant_id, external_id, kind) DO NOTHING) \
         SELECT count(*) FROM paid";
    if settlement.is_empty() {
        return Ok(0);
    }
    let (p, f, x) = (
        &settlement.paid,
        &settlement.fulfilments,
        &settlement.exceptions,
    );
    let paid: i64 = sqlx::query_scalar(SQL)
        .persistent(false)
        .bind(column(p, |p| p.tenant_id.as_str()))
        .bind(column(p, |p| p.order_id.as_str()))
        .bind(column(p, |p| p.gateway_order_id.as_str()))
        .bind(column(p, |p| p.external_id.as_str()))
        .bind(fulfilment_action)
        .bind(column(f, |f| f.tenant_id.as_str()))
        .bind(column(f, |f| f.external_id.as_str()))
        .bind(column(f, |f| &f.message))
        .bind(column(f, |f| f.idempotency_key.as_str()))
        .bind(column(x, |x| x.tenant_id.as_str()))
        .bind(column(x, |x| x.external_id.as_str()))
        .bind(column(x, |x| x.order_id.as_deref()))
        .bind(column(x, |x| x.kind))
        .bind(column(x, |x| x.detail.as_str()))
        .fetch_one(executor)
        .await?;
    Ok(paid as u64)
}
