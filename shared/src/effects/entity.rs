//! The generic versioned entity projection: an event that names an entity and a version sets
//! that entity's state, only when the stored version is lower. Processing order therefore does
//! not matter: any order of the same events converges to the highest version.

use std::collections::HashMap;

use sqlx::PgConnection;

use super::{
    DeclaredExpectation, Effect, EffectError, EffectFuture, EffectHandler, EffectsFuture,
    Expectation, outbox_key, payload_text,
};
use crate::store::entities::{self, EntityChange};
use crate::store::event_queue::ClaimedEvent;

/// The outbox action announcing a projection change.
pub const ENTITY_CHANGED: &str = "entity.changed";

pub struct EntityProjection;

impl EffectHandler for EntityProjection {
    fn name(&self) -> &'static str {
        "entity_projection"
    }

    /// The projection of an event that names an entity and a version; nothing of one that
    /// does not (it changes nothing).
    fn declares(&self) -> Option<DeclaredExpectation> {
        Some(DeclaredExpectation {
            if_versioned: Expectation::Projection,
            otherwise: Expectation::Nothing,
        })
    }

    fn apply<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        event: &'a ClaimedEvent,
    ) -> EffectFuture<'a> {
        super::apply_one(self, conn, event)
    }

    /// One statement per round: the first change of each entity in the group, then the
    /// second, and so on, so events of one entity meet in their order, as one at a time would.
    fn apply_all<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        events: &'a [&'a ClaimedEvent],
    ) -> EffectsFuture<'a> {
        Box::pin(async move {
            let mut effects = vec![Effect::Skipped; events.len()];
            let mut rounds: Vec<Vec<(usize, EntityChange<'a>)>> = Vec::new();
            let mut seen: HashMap<(&str, &str, &str), usize> = HashMap::new();
            for (i, event) in events.iter().enumerate() {
                let Some(change) = change_of(event)? else {
                    continue;
                };
                let key = (change.tenant_id, change.entity_type, change.entity_id);
                let round = seen.entry(key).or_insert(0);
                if rounds.len() <= *round {
                    rounds.push(Vec::new());
                }
                rounds[*round].push((i, change));
                *round += 1;
            }
            for round in rounds {
                let changes: Vec<EntityChange<'_>> = round.iter().map(|(_, c)| c.clone()).collect();
                let results =
                    entities::apply_versioned(&mut *conn, &changes, ENTITY_CHANGED).await?;
                for ((i, change), result) in round.iter().zip(results) {
                    effects[*i] = if result.applied {
                        Effect::Applied
                    } else {
                        if result.held_by_this_event {
                            if result.changed_before {
                                // Applied before this event row existed: a redelivery after
                                // retention purged its identity. Recorded; nothing repeated,
                                // nothing re-announced.
                                super::redelivered_after_purge(&mut *conn, events[*i]).await?;
                            } else {
                                // This event's own effect: make sure its announcement exists
                                // (the reconciler re-queues events whose outbox row went
                                // missing).
                                entities::ensure_announced(&mut *conn, change, ENTITY_CHANGED)
                                    .await?;
                            }
                        }
                        Effect::Stale
                    };
                }
            }
            Ok(effects)
        })
    }
}

/// The change an event makes to its entity, or `None` when it names no entity and version.
fn change_of(event: &ClaimedEvent) -> Result<Option<EntityChange<'_>>, EffectError> {
    let (Some(entity_id), Some(version)) = (event.entity_id.as_deref(), event.entity_version)
    else {
        return Ok(None);
    };
    // Bound as text and cast by PostgreSQL: parsed once, there, not here too.
    let state = payload_text(event)?;
    let (entity_type, deleted) = classify(&event.event_type);
    Ok(Some(EntityChange {
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
        outbox_key: outbox_key(&event.tenant_id, &event.external_id, ENTITY_CHANGED),
        since: event.first_received_at,
    }))
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
