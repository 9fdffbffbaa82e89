//! The generic versioned entity projection: an event that names an entity and a version sets
//! that entity's state, only when the stored version is lower. Processing order therefore does
//! not matter: any order of the same events converges to the highest version.

use sqlx::PgConnection;

use super::{Effect, EffectFuture, EffectHandler, Expectation, outbox_key, payload_text};
use crate::store::entities::{self, EntityChange};
use crate::store::event_queue::ClaimedEvent;

/// The outbox action announcing a projection change.
pub const ENTITY_CHANGED: &str = "entity.changed";

pub struct EntityProjection;

impl EffectHandler for EntityProjection {
    fn name(&self) -> &'static str {
        "entity_projection"
    }

    fn expects(&self, event: &ClaimedEvent) -> Expectation {
        if event.entity_id.is_some() && event.entity_version.is_some() {
            Expectation::Projection
        } else {
            Expectation::Nothing
        }
    }

    fn apply<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        event: &'a ClaimedEvent,
    ) -> EffectFuture<'a> {
        Box::pin(async move {
            let (Some(entity_id), Some(version)) =
                (event.entity_id.as_deref(), event.entity_version)
            else {
                return Ok(Effect::Skipped);
            };
            // Bound as text and cast by PostgreSQL: parsed once, there, not here too.
            let state = payload_text(event)?;
            let (entity_type, deleted) = classify(&event.event_type);
            let key = outbox_key(&event.tenant_id, &event.external_id, ENTITY_CHANGED);
            let change = EntityChange {
                tenant_id: &event.tenant_id,
                entity_type,
                entity_id,
                version,
                version_tiebreak: event.version_tiebreak,
                state,
                deleted,
                external_id: &event.external_id,
                source_id: &event.source_id,
                payload_sha256: &event.payload_sha256,
                outbox_action: ENTITY_CHANGED,
                outbox_key: &key,
            };
            let result =
                entities::apply_versioned(&mut *conn, &change, event.first_received_at).await?;
            if result.applied {
                return Ok(Effect::Applied);
            }
            if result.held_by_this_event {
                if result.changed_before {
                    // Applied before this event row existed: a redelivery after retention
                    // purged its identity. Recorded; nothing repeated, nothing re-announced.
                    super::redelivered_after_purge(conn, event).await?;
                } else {
                    // This event's own effect: make sure its announcement exists (the
                    // reconciler re-queues events whose outbox row went missing).
                    entities::ensure_announced(&mut *conn, &change).await?;
                }
            }
            Ok(Effect::Stale)
        })
    }
}

/// `customer.updated` → (`customer`, false); `orders/delete` → (`orders`, true).
pub fn classify(event_type: &str) -> (&str, bool) {
    match event_type.rfind(['.', '/']) {
        Some(i) => {
            let verb = &event_type[i + 1..];
            (
                &event_type[..i],
                matches!(verb, "deleted" | "delete" | "removed"),
            )
        }
        None => (event_type, false),
    }
}

#[cfg(test)]
mod tests {
    use super::classify;

    #[test]
    fn entity_types_and_deletes_come_from_the_event_type() {
        assert_eq!(classify("customer.updated"), ("customer", false));
        assert_eq!(
            classify("customer.subscription.deleted"),
            ("customer.subscription", true)
        );
        assert_eq!(classify("orders/delete"), ("orders", true));
        assert_eq!(classify("ping"), ("ping", false));
    }
}
