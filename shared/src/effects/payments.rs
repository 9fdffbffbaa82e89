//! The payments reference flow: a payment event pays its order exactly once, and only when
//! order and payment agree. Order locked `FOR UPDATE`; merchant reference, gateway id, amount,
//! currency and current state compared; one forward transition (awaiting_payment → paid); the
//! fulfilment outbox row written in the same transaction. Any disagreement records an exception
//! row and produces no fulfilment; the event is still processed (retrying would not change it).
//! A batch's payment events are settled together: their orders locked with one statement, in key
//! order, and every transition, fulfilment and exception written with another.

use std::collections::HashMap;

use serde_json::Value;
use sqlx::PgConnection;

use super::{
    DeclaredExpectation, Effect, EffectError, EffectFuture, EffectHandler, EffectsFuture,
    Expectation, outbox_key, payload_json,
};
use crate::store::event_queue::ClaimedEvent;
use crate::store::orders::{self, Fulfilment, Order, PaymentException, Settlement};

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
    fn declares(&self) -> Option<DeclaredExpectation> {
        Some(DeclaredExpectation::always(Expectation::Fulfilment))
    }

    fn apply<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        event: &'a ClaimedEvent,
    ) -> EffectFuture<'a> {
        super::apply_one(self, conn, event)
    }

    /// Three statements for the whole group: lock every order it names (in key order), then,
    /// after comparing each event with its order as the events before it left it, write every
    /// transition, fulfilment and exception together.
    fn apply_all<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        events: &'a [&'a ClaimedEvent],
    ) -> EffectsFuture<'a> {
        Box::pin(async move {
            let mut payments = Vec::with_capacity(events.len());
            for event in events {
                payments.push(self.read(&payload_json(event)?));
            }
            let (tenants, order_ids): (Vec<&str>, Vec<&str>) = events
                .iter()
                .zip(&payments)
                .filter_map(|(e, p)| {
                    Some((e.tenant_id.as_str(), p.as_ref().ok()?.order_id.as_str()))
                })
                .unzip();
            let mut orders: HashMap<(String, String), Order> =
                orders::lock_all(&mut *conn, &tenants, &order_ids)
                    .await?
                    .into_iter()
                    .map(|o| ((o.tenant_id.clone(), o.order_id.clone()), o))
                    .collect();
            let mut settlement = Settlement::default();
            let mut purged = Vec::new();
            let effects: Vec<Effect> = events
                .iter()
                .zip(&payments)
                .map(|(event, payment)| match payment {
                    Err(why) => exception(&mut settlement, event, None, "unmappable_event", why),
                    Ok(payment) => {
                        settle_one(&mut orders, &mut settlement, &mut purged, event, payment)
                    }
                })
                .collect();
            let paying = settlement.paid.len() as u64;
            if orders::settle(&mut *conn, &settlement, FULFIL_ORDER).await? != paying {
                return Err(EffectError::Retryable(
                    "an order changed under its lock".into(),
                ));
            }
            for event in purged {
                // Paid before this event row existed: a redelivery after retention.
                super::redelivered_after_purge(&mut *conn, event).await?;
            }
            Ok(effects)
        })
    }
}

/// Compares one payment with its order as the group's earlier events left it, and settles it:
/// pays the order, or records why not.
fn settle_one<'e>(
    orders: &mut HashMap<(String, String), Order>,
    settlement: &mut Settlement,
    purged: &mut Vec<&'e ClaimedEvent>,
    event: &'e ClaimedEvent,
    payment: &Payment,
) -> Effect {
    let event_id = event.external_id.as_str();
    let order_id = Some(payment.order_id.as_str());
    let key = (event.tenant_id.clone(), payment.order_id.clone());
    let Some(order) = orders.get_mut(&key) else {
        return exception(
            settlement,
            event,
            order_id,
            "unknown_order",
            "no such order",
        );
    };
    if order.state != "awaiting_payment" {
        return if order.paid_by_event.as_deref() == Some(event_id) {
            if order.paid_at.is_some_and(|t| t < event.first_received_at) {
                purged.push(event);
            } else {
                // This event paid it: make sure its fulfilment row exists.
                fulfil(settlement, event, payment);
            }
            Effect::Stale
        } else if order.state == "cancelled" {
            exception(
                settlement,
                event,
                order_id,
                "invalid_state",
                "order is cancelled",
            )
        } else {
            let detail = format!(
                "order is {} (paid by {:?})",
                order.state, order.paid_by_event
            );
            exception(settlement, event, order_id, "already_paid", &detail)
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
    } else if payment.merchant_reference.as_deref() != Some(order.merchant_reference.as_str()) {
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
        return exception(settlement, event, order_id, kind, &detail);
    }
    // The one forward transition, as the later events of the group will see it.
    order.state = "paid".into();
    order.paid_by_event = Some(event_id.to_owned());
    order.paid_at = None;
    order
        .gateway_order_id
        .get_or_insert_with(|| payment.gateway_order_id.clone());
    settlement.paid.push(orders::Payment {
        tenant_id: event.tenant_id.clone(),
        order_id: payment.order_id.clone(),
        gateway_order_id: payment.gateway_order_id.clone(),
        external_id: event_id.to_owned(),
    });
    fulfil(settlement, event, payment);
    Effect::Applied
}

/// The order's fulfilment message, in the outbox once per paying event (its key is stable, so
/// writing it again is a no-op).
fn fulfil(settlement: &mut Settlement, event: &ClaimedEvent, payment: &Payment) {
    let message = serde_json::json!({
        "order_id": payment.order_id,
        "amount_minor": payment.amount,
        "currency": payment.currency,
        "gateway_order_id": payment.gateway_order_id,
    });
    settlement.fulfilments.push(Fulfilment {
        tenant_id: event.tenant_id.clone(),
        external_id: event.external_id.clone(),
        message,
        idempotency_key: outbox_key(&event.tenant_id, &event.external_id, FULFIL_ORDER),
    });
}

fn exception(
    settlement: &mut Settlement,
    event: &ClaimedEvent,
    order_id: Option<&str>,
    kind: &'static str,
    detail: &str,
) -> Effect {
    tracing::warn!(tenant_id = %event.tenant_id, external_id = %event.external_id, kind, detail, "payment exception");
    settlement.exceptions.push(PaymentException {
        tenant_id: event.tenant_id.clone(),
        external_id: event.external_id.clone(),
        order_id: order_id.map(str::to_owned),
        kind,
        detail: detail.to_owned(),
    });
    Effect::Exception(kind)
}
