//! Subscriptions: the verified event itself, forwarded to the services that asked for it. A
//! subscription is a route whose action is `event` (the routes file, `hookctl routes apply`):
//! a tenant, optionally one of its sources, optionally event types (exact names or globs) and a
//! predicate on the event's data, and a destination. The drain writes one outbox message per
//! (event, matching subscription) in the transaction that marks the event processed
//! ([`fan_out`]); the outbox sender delivers it as any other message, in the envelope of
//! [`envelope`], signed the Standard Webhooks way on HTTP.
//!
//! A subscription's messages carry the action `event:<name>`, so their idempotency key
//! (`effects::outbox_key`) is stable per (tenant, event, subscription) across retries, resends
//! and replays, and the outbox admits each at most once.

pub mod envelope;
pub mod replay;
pub mod signing;

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

use crate::effects::outbox_key;
use crate::store::StoreError;
use crate::store::event_queue::ClaimedEvent;
use crate::store::subscriptions::{self as stored, ForwardRows, SubscriptionRow};

/// The route action of a subscription.
pub const EVENT: &str = "event";

/// The outbox action of a subscription's messages.
pub fn action_of(name: &str) -> String {
    format!("{EVENT}:{name}")
}

/// The subscription a message's action names, when it is a subscription's.
pub fn name_of(action: &str) -> Option<&str> {
    action
        .strip_prefix(EVENT)
        .and_then(|rest| rest.strip_prefix(':'))
}

/// Whether `name` may name a subscription: 1 to 63 of `a-z 0-9 . _ -`, starting with a letter
/// or digit (the table's check says the same).
pub fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name.len() <= 63
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "._-".contains(c))
}

/// Which events a subscription takes, beyond its tenant and source.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Selection {
    /// Exact event types or globs (`*` any run of characters, `?` one); empty: every type.
    pub event_types: Vec<String>,
    /// The value at this JSON pointer of the event's data is one of `values`.
    pub filter: Option<PayloadFilter>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PayloadFilter {
    pub pointer: String,
    pub values: Vec<serde_json::Value>,
}

impl Selection {
    pub fn takes_type(&self, event_type: &str) -> bool {
        self.event_types.is_empty() || self.event_types.iter().any(|g| glob(g, event_type))
    }

    /// Whether the event's data passes the filter (`data` is read only when there is one).
    pub fn takes_data(&self, data: impl FnOnce() -> Option<serde_json::Value>) -> bool {
        match &self.filter {
            None => true,
            Some(f) => data()
                .and_then(|d| d.pointer(&f.pointer).cloned())
                .is_some_and(|v| f.values.contains(&v)),
        }
    }
}

/// `*` matches any run of characters (`.` and `/` included), `?` exactly one; everything else
/// itself.
pub fn glob(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || (p[pi] != '*' && p[pi] == t[ti])) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// What a stored subscription takes. A filter whose stored values are not a list matches
/// nothing rather than everything.
pub fn selection_of(row: &SubscriptionRow) -> Selection {
    let filter = match (&row.payload_pointer, &row.payload_values) {
        (Some(pointer), Some(values)) => Some(PayloadFilter {
            pointer: pointer.clone(),
            values: values.as_array().cloned().unwrap_or_default(),
        }),
        _ => None,
    };
    Selection {
        event_types: row.event_types.clone(),
        filter,
    }
}

/// A stored subscription as the drain matches it.
#[derive(Debug, Clone)]
pub struct Subscription {
    pub tenant_id: String,
    pub name: String,
    pub source_id: Option<String>,
    pub selection: Selection,
}

/// The subscriptions, by tenant.
#[derive(Debug, Default)]
pub struct Subscriptions {
    by_tenant: HashMap<String, Vec<Subscription>>,
}

impl Subscriptions {
    pub fn new(subscriptions: Vec<Subscription>) -> Self {
        let mut by_tenant: HashMap<String, Vec<Subscription>> = HashMap::new();
        for s in subscriptions {
            by_tenant.entry(s.tenant_id.clone()).or_default().push(s);
        }
        Self { by_tenant }
    }

    pub async fn load(conn: &mut PgConnection) -> Result<Self, StoreError> {
        Ok(Self::new(
            stored::list(conn)
                .await?
                .into_iter()
                .map(|row| Subscription {
                    selection: selection_of(&row),
                    tenant_id: row.tenant_id,
                    name: row.name,
                    source_id: row.source_id,
                })
                .collect(),
        ))
    }

    pub fn is_empty(&self) -> bool {
        self.by_tenant.is_empty()
    }

    /// The subscriptions that take `event`, by name.
    pub fn matching<'a>(&'a self, event: &ClaimedEvent) -> Vec<&'a str> {
        let Some(candidates) = self.by_tenant.get(&event.tenant_id) else {
            return Vec::new();
        };
        let mut data: Option<Option<serde_json::Value>> = None;
        candidates
            .iter()
            .filter(|s| {
                s.source_id
                    .as_deref()
                    .is_none_or(|id| id == event.source_id)
            })
            .filter(|s| s.selection.takes_type(&event.event_type))
            .filter(|s| {
                s.selection.takes_data(|| {
                    data.get_or_insert_with(|| {
                        event
                            .payload
                            .as_deref()
                            .and_then(|p| envelope::data_of(p).as_json())
                    })
                    .clone()
                })
            })
            .map(|s| s.name.as_str())
            .collect()
    }
}

/// Writes one outbox message per (event, subscription that takes it), in the caller's
/// transaction: the envelope as its payload, the key stable per (tenant, event, subscription).
/// A message that exists already (a repair, a replayed dead letter) is left as it is. Returns
/// how many were written.
pub async fn fan_out(conn: &mut PgConnection, events: &[&ClaimedEvent]) -> Result<u64, StoreError> {
    if events.is_empty() {
        return Ok(0);
    }
    let subscriptions = Subscriptions::load(conn).await?;
    if subscriptions.is_empty() {
        return Ok(0);
    }
    let mut rows = ForwardRows::default();
    for event in events {
        for name in subscriptions.matching(event) {
            let action = action_of(name);
            let key = outbox_key(&event.tenant_id, &event.external_id, &action);
            let envelope = envelope::of(event, &key).to_string();
            rows.push(&event.tenant_id, &event.external_id, action, key, envelope);
        }
    }
    stored::insert_forwards(conn, &rows).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_as_documented() {
        assert!(glob("issues.*", "issues.opened"));
        assert!(glob("invoice.payment_*", "invoice.payment_failed"));
        assert!(!glob("invoice.payment_*", "invoice.paid"));
        assert!(glob("push", "push"));
        assert!(!glob("push", "pushed"));
        assert!(glob("*", ""));
        assert!(glob("a?c", "abc"));
        assert!(!glob("a?c", "ac"));
        assert!(glob("*.*.deleted", "customer.subscription.deleted"));
        assert!(glob("orders/*", "orders/create"));
    }

    #[test]
    fn names_and_actions() {
        assert!(valid_name("github-issues"));
        assert!(valid_name("a.b_c-1"));
        assert!(!valid_name(""));
        assert!(!valid_name("-x"));
        assert!(!valid_name("Has Upper"));
        assert!(!valid_name(&"a".repeat(64)));
        assert_eq!(name_of(&action_of("x")), Some("x"));
        assert_eq!(name_of("entity.changed"), None);
        assert_eq!(name_of("events:x"), None);
    }

    #[test]
    fn a_filter_reads_its_pointer_and_no_data_fails_it() {
        let s = Selection {
            event_types: vec![],
            filter: Some(PayloadFilter {
                pointer: "/action".into(),
                values: vec!["opened".into(), "closed".into()],
            }),
        };
        assert!(s.takes_data(|| Some(serde_json::json!({"action": "opened"}))));
        assert!(!s.takes_data(|| Some(serde_json::json!({"action": "edited"}))));
        assert!(!s.takes_data(|| Some(serde_json::json!({}))));
        assert!(!s.takes_data(|| None));
        assert!(Selection::default().takes_data(|| None));
    }
}
