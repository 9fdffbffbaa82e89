//! Effects: what processing an event does to trusted state. A registry maps a provider scheme
//! and event type to a handler, so a new event type is one handler. Every handler runs inside
//! the drain's transaction (under a savepoint of its own only when its batch is redone to
//! isolate a failure) and writes its outbox rows there.

pub mod entity;
pub mod payments;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use sqlx::PgConnection;

use crate::domain::Scheme;
use crate::store::StoreError;
use crate::store::event_queue::{ClaimedEvent, DeclaredExpectations};

/// What a handler did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// State changed (and its outbox rows were written).
    Applied,
    /// The event is older than the state it would change: nothing to do, by design.
    Stale,
    /// The event carries nothing this handler projects.
    Skipped,
    /// The event disagreed with the state it targets; an exception row says how.
    Exception(&'static str),
}

/// What a processed event leaves behind that reconciliation can check, as its handler declares
/// it. Reconcile expects exactly this of the event, nothing more: a handler that writes no
/// projection row is never re-queued for a missing one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expectation {
    /// Nothing reconciliation can check.
    Nothing,
    /// The versioned projection holds the event's version or a newer one; when it holds the
    /// change this very event made (after its row existed), the `entity.changed` row exists.
    Projection,
    /// When the event paid its order (after its row existed), the `fulfil_order` row exists.
    Fulfilment,
}

impl Expectation {
    /// As stored in `webhook_events.expects`.
    pub fn as_str(self) -> &'static str {
        match self {
            Expectation::Nothing => "nothing",
            Expectation::Projection => "projection",
            Expectation::Fulfilment => "fulfilment",
        }
    }
}

/// What a handler expects of the events it processes, declared as data rather than answered
/// event by event: of an event that names an entity and a version, and of one that does not.
/// The drain's claim records it in the statement that completes the batch
/// ([`crate::store::event_queue::claim_completed`]); a handler that declares nothing still
/// answers [`EffectHandler::expects`], recorded by one more statement per batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeclaredExpectation {
    pub if_versioned: Expectation,
    pub otherwise: Expectation,
}

impl DeclaredExpectation {
    /// The same expectation of every event.
    pub const fn always(expectation: Expectation) -> Self {
        Self {
            if_versioned: expectation,
            otherwise: expectation,
        }
    }

    /// What this declares of `event`.
    pub fn of(self, event: &ClaimedEvent) -> Expectation {
        if event.entity_id.is_some() && event.entity_version.is_some() {
            self.if_versioned
        } else {
            self.otherwise
        }
    }
}

/// Why a handler failed. Decides between retrying, dead-lettering and abandoning the batch.
#[derive(Debug, thiserror::Error)]
pub enum EffectError {
    /// May succeed later (lock timeout, serialization failure, downstream 5xx).
    #[error("retryable: {0}")]
    Retryable(String),
    /// Will fail the same way every time (schema or business rejection): dead-letter at once.
    #[error("fatal: {0}")]
    Fatal(String),
    /// The connection or transaction is gone: the whole batch is abandoned, nothing committed.
    #[error("batch aborted: {0}")]
    Aborted(#[source] StoreError),
}

impl From<StoreError> for EffectError {
    fn from(error: StoreError) -> Self {
        match &error {
            StoreError::Unavailable(sqlx::Error::Database(_)) => {
                EffectError::Retryable(error.to_string())
            }
            StoreError::Unavailable(_)
            | StoreError::UntrustedServer { .. }
            | StoreError::CredentialsRejected(_)
            | StoreError::CredentialsUnavailable { .. } => EffectError::Aborted(error),
            StoreError::Corrupt { .. } => EffectError::Fatal(error.to_string()),
            StoreError::Query(sqlx::Error::Database(db)) => {
                // 22: data exception, 23: integrity violation, 42: syntax or access rule. The
                // same statement on the same data fails the same way.
                let code = db.code().unwrap_or_default();
                if code.starts_with("22") || code.starts_with("23") || code.starts_with("42") {
                    EffectError::Fatal(error.to_string())
                } else {
                    EffectError::Retryable(error.to_string())
                }
            }
            StoreError::Query(_) => EffectError::Aborted(error),
        }
    }
}

pub type EffectFuture<'a> = Pin<Box<dyn Future<Output = Result<Effect, EffectError>> + Send + 'a>>;

/// What [`EffectHandler::apply_all`] returns: one effect per event, in the events' order.
pub type EffectsFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<Effect>, EffectError>> + Send + 'a>>;

/// One kind of effect.
pub trait EffectHandler: Send + Sync {
    /// For logs and metrics.
    fn name(&self) -> &'static str;
    /// Applies the event's effect on `conn` (inside the caller's savepoint).
    fn apply<'a>(&'a self, conn: &'a mut PgConnection, event: &'a ClaimedEvent)
    -> EffectFuture<'a>;
    /// Applies the effects of `events`, in their order, as one unit inside the caller's
    /// savepoint: the same result as applying them one after another, so a handler that can
    /// write a whole group in a few statements does so here. Any error fails the group: the
    /// caller rolls all of it back and splits it until each failing event stands alone.
    fn apply_all<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        events: &'a [&'a ClaimedEvent],
    ) -> EffectsFuture<'a> {
        Box::pin(async move {
            let mut effects = Vec::with_capacity(events.len());
            for event in events {
                effects.push(self.apply(&mut *conn, event).await?);
            }
            Ok(effects)
        })
    }
    /// What reconciliation may check of `event` once this handler processed it. Recorded with
    /// the event; reconcile and the referential anomaly checks expect nothing else. By default,
    /// what [`EffectHandler::declares`] says of it, or nothing.
    fn expects(&self, event: &ClaimedEvent) -> Expectation {
        self.declares()
            .map_or(Expectation::Nothing, |declared| declared.of(event))
    }
    /// [`EffectHandler::expects`] as data, when it depends on nothing but whether the event
    /// names an entity and a version: the drain then records it as it claims the batch. `None`
    /// (the default) when it cannot be declared so; the drain then asks `expects` event by
    /// event.
    fn declares(&self) -> Option<DeclaredExpectation> {
        None
    }
}

/// One event's effect through `handler`'s [`EffectHandler::apply_all`], for a handler whose
/// group statements are its only SQL: one event and a batch take the same path.
pub fn apply_one<'a>(
    handler: &'a (impl EffectHandler + ?Sized),
    conn: &'a mut PgConnection,
    event: &'a ClaimedEvent,
) -> EffectFuture<'a> {
    Box::pin(async move {
        let mut effects = handler.apply_all(conn, &[event]).await?;
        effects
            .pop()
            .ok_or_else(|| EffectError::Fatal(format!("{} returned no effect", handler.name())))
    })
}

/// Handlers by (scheme, event type), with a fallback for everything else.
pub struct EffectRegistry {
    handlers: HashMap<(Scheme, String), Arc<dyn EffectHandler>>,
    fallback: Arc<dyn EffectHandler>,
}

impl EffectRegistry {
    /// Only the fallback: every event goes to `fallback`.
    pub fn new(fallback: Arc<dyn EffectHandler>) -> Self {
        Self {
            handlers: HashMap::new(),
            fallback,
        }
    }

    /// The product's handlers: Stripe payment events run the payments flow; every other event
    /// that names an entity and a version updates the versioned projection.
    pub fn standard() -> Self {
        let mut registry = Self::new(Arc::new(entity::EntityProjection));
        let payments: Arc<dyn EffectHandler> = Arc::new(payments::Payments::stripe());
        registry.register(Scheme::Stripe, "payment_intent.succeeded", payments);
        registry
    }

    pub fn register(
        &mut self,
        scheme: Scheme,
        event_type: &str,
        handler: Arc<dyn EffectHandler>,
    ) -> &mut Self {
        self.handlers
            .insert((scheme, event_type.to_owned()), handler);
        self
    }

    /// What every handler declares it expects ([`EffectHandler::declares`]), as the drain's
    /// claim binds it: the scheme and event type each registered handler is looked up by, and
    /// the fallback's for the rest.
    pub fn declared_expectations(&self) -> DeclaredExpectations<'_> {
        let as_str = |d: Option<DeclaredExpectation>| {
            (
                d.map(|d| d.if_versioned.as_str()),
                d.map(|d| d.otherwise.as_str()),
            )
        };
        let mut declared = DeclaredExpectations {
            fallback: as_str(self.fallback.declares()),
            ..DeclaredExpectations::default()
        };
        for ((scheme, event_type), handler) in &self.handlers {
            let (if_versioned, otherwise) = as_str(handler.declares());
            declared.schemes.push(scheme.as_str());
            declared.event_types.push(event_type);
            declared.if_versioned.push(if_versioned);
            declared.otherwise.push(otherwise);
        }
        declared
    }

    pub fn handler_for(&self, event: &ClaimedEvent) -> &dyn EffectHandler {
        event
            .scheme
            .parse::<Scheme>()
            .ok()
            .and_then(|scheme| self.handlers.get(&(scheme, event.event_type.clone())))
            .unwrap_or(&self.fallback)
            .as_ref()
    }
}

/// The Idempotency-Key of an outbox row: stable for (tenant, event, action), opaque outside.
pub fn outbox_key(tenant_id: &str, external_id: &str, action: &str) -> String {
    let mut hash = Sha256::new();
    for part in [tenant_id, external_id, action] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    hex::encode(hash.finalize())
}

/// Records that this event's effect predates its own event row (see `ingest_anomalies`).
pub(crate) async fn redelivered_after_purge(
    conn: &mut PgConnection,
    event: &ClaimedEvent,
) -> Result<(), EffectError> {
    tracing::warn!(tenant_id = %event.tenant_id, external_id = %event.external_id, "redelivered after its identity was purged");
    crate::store::ingest_anomalies::record_redelivered_after_purge(
        conn,
        &event.tenant_id,
        &event.source_id,
        &event.external_id,
        &event.payload_sha256,
    )
    .await?;
    Ok(())
}

/// The event's payload as text, for a handler that hands it to PostgreSQL as JSON unparsed,
/// or a fatal error saying why not.
pub fn payload_text(event: &ClaimedEvent) -> Result<&str, EffectError> {
    let bytes = event
        .payload
        .as_deref()
        .ok_or_else(|| EffectError::Fatal("payload was purged by retention".into()))?;
    std::str::from_utf8(bytes)
        .map_err(|e| EffectError::Fatal(format!("payload is not UTF-8 text: {e}")))
}

/// The event's payload as JSON, or a fatal error saying why not.
pub fn payload_json(event: &ClaimedEvent) -> Result<serde_json::Value, EffectError> {
    serde_json::from_str(payload_text(event)?)
        .map_err(|e| EffectError::Fatal(format!("payload is not JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_standard_handlers_declare_what_they_expect_for_the_claim_to_record() {
        let registry = EffectRegistry::standard();
        let declared = registry.declared_expectations();
        assert_eq!(declared.fallback, (Some("projection"), Some("nothing")));
        assert_eq!(
            (
                declared.schemes,
                declared.event_types,
                declared.if_versioned,
                declared.otherwise
            ),
            (
                vec!["stripe"],
                vec!["payment_intent.succeeded"],
                vec![Some("fulfilment")],
                vec![Some("fulfilment")]
            )
        );
        // A handler that declares nothing is bound as such, not as the fallback's.
        struct Silent;
        impl EffectHandler for Silent {
            fn name(&self) -> &'static str {
                "silent"
            }
            fn apply<'a>(
                &'a self,
                _conn: &'a mut PgConnection,
                _event: &'a ClaimedEvent,
            ) -> EffectFuture<'a> {
                Box::pin(async { Ok(Effect::Skipped) })
            }
        }
        let mut registry = EffectRegistry::standard();
        registry.register(Scheme::Github, "push", Arc::new(Silent));
        let declared = registry.declared_expectations();
        let push = declared
            .event_types
            .iter()
            .position(|t| *t == "push")
            .expect("push is bound");
        assert_eq!(
            (
                declared.schemes[push],
                declared.if_versioned[push],
                declared.otherwise[push]
            ),
            ("github", None, None)
        );
    }

    #[test]
    fn outbox_keys_are_stable_and_unambiguous() {
        assert_eq!(outbox_key("t", "e", "a"), outbox_key("t", "e", "a"));
        assert_ne!(outbox_key("t", "ea", "b"), outbox_key("t", "e", "ab"));
        assert_eq!(outbox_key("t", "e", "a").len(), 64);
    }
}
