//! The payments reference flow: a payment event pays its order exactly once, and only when
//! order and payment agree. Order locked `FOR UPDATE`; merchant reference, gateway id, amount,
//! currency and current state compared; one forward transition (awaiting_payment → paid); the
//! fulfilment outbox row written in the same transaction. Any disagreement records an exception
//! row and produces no fulfilment; the event is still processed (retrying would not change it).

use serde_json::Value;
use sqlx::PgConnection;

use super::{
    Effect, EffectError, EffectFuture, EffectHandler, Expectation, outbox_key, payload_json,
};
use crate::store::event_queue::ClaimedEvent;
use crate::store::{orders, outbox};

/// The outbox action that asks the merchant's system to fulfil a paid order.
pub const FULFIL_ORDER: &str = "fulfil_order";

/// Where a provider's payment event keeps what the order is checked against (JSON pointers).
#[derive(Debug, Clone)]
pub struct Payments {
    pub order_id: &'static str,
    pub merchant_reference: &'static str,
    pub gateway_order_id: &'static str,
    pub amount: &'static [&'static str],
    pub currency: &'static str,
}

impl Payments {
    /// Stripe `payment_intent.succeeded`: the order id and merchant reference travel in the
    /// PaymentIntent's metadata, set when the merchant created it.
    pub fn stripe() -> Self {
        Self {
            order_id: "/data/object/metadata/order_id",
            merchant_reference: "/data/object/metadata/merchant_reference",
            gateway_order_id: "/data/object/id",
            amount: &["/data/object/amount_received", "/data/object/amount"],
            currency: "/data/object/currency",
        }
    }
}

struct Payment {
    order_id: String,
    merchant_reference: Option<String>,
    gateway_order_id: String,
    amount: i64,
    currency: String,
}

fn text(body: &Value, pointer: &str) -> Option<String> {
    match body.pointer(pointer)? {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

impl Payments {
    fn read(&self, body: &Value) -> Result<Payment, String> {
        let order_id =
            text(body, self.order_id).ok_or_else(|| format!("no order id at {}", self.order_id))?;
        let gateway_order_id = text(body, self.gateway_order_id)
            .ok_or_else(|| format!("no gateway id at {}", self.gateway_order_id))?;
        let amount = self
            .amount
            .iter()
            .find_map(|p| body.pointer(p).and_then(Value::as_i64))
            .ok_or_else(|| format!("no integer amount at {:?}", self.amount))?;
        let currency =
            text(body, self.currency).ok_or_else(|| format!("no currency at {}", self.currency))?;
        Ok(Payment {
            order_id,
            merchant_reference: text(body, self.merchant_reference),
            gateway_order_id,
            amount,
            currency,
        })
    }
}

impl EffectHandler for Payments {
    fn name(&self) -> &'static str {
        "payments"
    }

    /// A fulfilment row for the order the event paid; never a projection row, whatever
    /// entity fields the source reads.
    fn expects(&self, _event: &ClaimedEvent) -> Expectation {
        Expectation::Fulfilment
    }

    fn apply<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        event: &'a ClaimedEvent,
    ) -> EffectFuture<'a> {
        Box::pin(async move {
            let (tenant, event_id) = (event.tenant_id.as_str(), event.external_id.as_str());
            let body = payload_json(event)?;
            let payment = match self.read(&body) {
                Ok(p) => p,
                Err(why) => return exception(conn, event, None, "unmappable_event", &why).await,
            };
            let order_id = Some(payment.order_id.as_str());
            let Some(order) = orders::lock(&mut *conn, tenant, &payment.order_id).await? else {
                return exception(conn, event, order_id, "unknown_order", "no such order").await;
            };
            if order.state != "awaiting_payment" {
                return if order.paid_by_event.as_deref() == Some(event_id) {
                    if order.paid_at.is_some_and(|t| t < event.first_received_at) {
                        // Paid before this event row existed: a redelivery after retention.
                        super::redelivered_after_purge(conn, event).await?;
                    } else {
                        // This event paid it: make sure its fulfilment row exists.
                        enqueue_fulfilment(conn, event, &payment).await?;
                    }
                    Ok(Effect::Stale)
                } else if order.state == "cancelled" {
                    exception(conn, event, order_id, "invalid_state", "order is cancelled").await
                } else {
                    let detail = format!(
                        "order is {} (paid by {:?})",
                        order.state, order.paid_by_event
                    );
                    exception(conn, event, order_id, "already_paid", &detail).await
                };
            }
            let mismatch = if payment.amount != order.amount_minor {
                Some((
                    "amount_mismatch",
                    format!("payment {} != order {}", payment.amount, order.amount_minor),
                ))
            } else if !payment.currency.eq_ignore_ascii_case(&order.currency) {
                Some((
                    "currency_mismatch",
                    format!("payment {} != order {}", payment.currency, order.currency),
                ))
            } else if payment.merchant_reference.as_deref()
                != Some(order.merchant_reference.as_str())
            {
                Some((
                    "reference_mismatch",
                    format!(
                        "payment {:?} != order {:?}",
                        payment.merchant_reference, order.merchant_reference
                    ),
                ))
            } else if order
                .gateway_order_id
                .as_deref()
                .is_some_and(|g| g != payment.gateway_order_id)
            {
                Some((
                    "gateway_mismatch",
                    format!(
                        "payment {} != order {:?}",
                        payment.gateway_order_id, order.gateway_order_id
                    ),
                ))
            } else {
                None
            };
            if let Some((kind, detail)) = mismatch {
                return exception(conn, event, order_id, kind, &detail).await;
            }
            if !orders::mark_paid(
                &mut *conn,
                tenant,
                &payment.order_id,
                &payment.gateway_order_id,
                event_id,
            )
            .await?
            {
                return Err(EffectError::Retryable(
                    "order changed under its lock".into(),
                ));
            }
            enqueue_fulfilment(conn, event, &payment).await?;
            Ok(Effect::Applied)
        })
    }
}

/// The order's fulfilment message, in the outbox once per paying event (its key is stable, so
/// writing it again is a no-op).
async fn enqueue_fulfilment(
    conn: &mut PgConnection,
    event: &ClaimedEvent,
    payment: &Payment,
) -> Result<(), EffectError> {
    let message = serde_json::json!({
        "order_id": payment.order_id,
        "amount_minor": payment.amount,
        "currency": payment.currency,
        "gateway_order_id": payment.gateway_order_id,
    });
    let (tenant, event_id) = (event.tenant_id.as_str(), event.external_id.as_str());
    let key = outbox_key(tenant, event_id, FULFIL_ORDER);
    outbox::enqueue(conn, tenant, event_id, FULFIL_ORDER, &message, &key).await?;
    Ok(())
}

async fn exception(
    conn: &mut PgConnection,
    event: &ClaimedEvent,
    order_id: Option<&str>,
    kind: &'static str,
    detail: &str,
) -> Result<Effect, EffectError> {
    tracing::warn!(tenant_id = %event.tenant_id, external_id = %event.external_id, kind, detail, "payment exception");
    orders::record_exception(
        conn,
        &event.tenant_id,
        &event.external_id,
        order_id,
        kind,
        detail,
    )
    .await?;
    Ok(Effect::Exception(kind))
}
