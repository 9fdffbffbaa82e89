//! Routes: where each outbox action of a tenant, or of one of its sources, is delivered. A route
//! file (TOML) is validated and applied by `hookctl routes apply`; the sender reads the stored
//! set at each batch. A message no route covers (and no default `OUTBOX_TARGET_URL` takes)
//! fails at once with the reason, for an operator to see (`hookctl outbox list`, `status`).
//!
//! ```toml
//! [[route]]
//! tenant = "acme"
//! action = "entity.changed"
//! destination = "sqs"
//! queue_url = "https://sqs.eu-west-1.amazonaws.com/123456789012/acme-entities.fifo"
//!
//! [[route]]
//! tenant = "acme"
//! source = "acme-stripe"        # this source only; without it, every source of the tenant
//! action = "fulfil_order"
//! destination = "eventbridge"
//! bus = "orders"                # a name or an ARN
//! event_source = "acme.payments" # the entries' Source (default "webhook-receiver")
//!
//! [[route]]                     # a subscription: the verified event itself
//! tenant = "acme"
//! source = "acme-github"        # optional
//! action = "event"
//! name = "issue-tracker"        # unique in the tenant; its messages' action is event:<name>
//! types = ["issues.*", "pull_request.opened"]  # optional: exact names or globs
//! filter = { pointer = "/repository/full_name", in = ["acme/api"] }  # optional (or equals = ...)
//! destination = "http"
//! url = "https://tracker.internal/hooks"
//! signing_secret_ref = "acme/tracker-signing"  # whsec_...: Standard Webhooks signatures
//! rate_limit = 20               # optional: deliveries a second
//! ```

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde::Deserialize;
use sqlx::PgPool;

use super::destinations::Destination;
use crate::effects::entity::ENTITY_CHANGED;
use crate::effects::payments::FULFIL_ORDER;
use crate::store::outbox_routes::{self, RouteRow};
use crate::store::subscriptions::{self as stored_subscriptions, SubscriptionRow};
use crate::store::{self, StoreError};
use crate::subscriptions::{self, EVENT, PayloadFilter, Selection};

/// The actions a route may name: the effects' outbox actions, and `event`, a subscription.
pub const ACTIONS: &[&str] = &[ENTITY_CHANGED, FULFIL_ORDER, EVENT];

/// The entries' `Source` of an EventBridge route that names none.
pub use super::destinations::DEFAULT_EVENT_SOURCE;

/// One route: the action of a tenant (or of one of its sources) and where it goes.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub tenant_id: String,
    /// `None`: every source of the tenant that has no route of its own for the action.
    pub source_id: Option<String>,
    pub action: String,
    pub destination: Destination,
    /// HTTP only: the Standard Webhooks secret (`whsec_...`) its deliveries are signed with.
    pub signing_secret_ref: Option<String>,
    /// The action `event`: the subscription's name and what it takes.
    pub subscription: Option<SubscriptionSpec>,
}

/// What a subscription (a route of action `event`) adds to a route.
#[derive(Debug, Clone, PartialEq)]
pub struct SubscriptionSpec {
    pub name: String,
    pub selection: Selection,
    /// At most this many deliveries a second.
    pub rate_limit: Option<f64>,
}

impl Route {
    /// The outbox action of its messages: the action, or `event:<name>` for a subscription.
    pub fn message_action(&self) -> String {
        match &self.subscription {
            Some(s) => subscriptions::action_of(&s.name),
            None => self.action.clone(),
        }
    }
}

/// A subscription's payload filter as written: a JSON pointer and the value it must equal, or
/// the values it may take.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterSpec {
    pub pointer: String,
    #[serde(default)]
    pub equals: Option<serde_json::Value>,
    #[serde(default, rename = "in")]
    pub one_of: Option<Vec<serde_json::Value>>,
}

/// A route as written in a route file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteSpec {
    pub tenant: String,
    #[serde(default)]
    pub source: Option<String>,
    pub action: String,
    /// `http`, `eventbridge`, `sqs` or `sns`.
    pub destination: String,
    #[serde(default)]
    pub url: Option<String>,
    #[serde(default)]
    pub bus: Option<String>,
    #[serde(default)]
    pub event_source: Option<String>,
    #[serde(default)]
    pub queue_url: Option<String>,
    #[serde(default)]
    pub topic_arn: Option<String>,
    #[serde(default)]
    pub signing_secret_ref: Option<String>,
    /// A subscription's name (action `event` only).
    #[serde(default)]
    pub name: Option<String>,
    /// A subscription's event types: exact names or globs.
    #[serde(default)]
    pub types: Option<Vec<String>>,
    #[serde(default)]
    pub filter: Option<FilterSpec>,
    #[serde(default)]
    pub rate_limit: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RoutesFile {
    #[serde(default)]
    route: Vec<RouteSpec>,
}

/// Why a route file or a stored route is not a set of routes.
#[derive(Debug, thiserror::Error)]
pub enum RoutesError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("{path}: route {index} ({what}): {reason}")]
    Invalid {
        path: String,
        index: usize,
        what: String,
        reason: String,
    },
    #[error("{what} is routed twice")]
    Duplicate { what: String },
    #[error(
        "route for {action} of tenant {tenant} names source {source_id}, which is not a source of that tenant (apply the sources first)"
    )]
    UnknownSource {
        tenant: String,
        source_id: String,
        action: String,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl RouteSpec {
    fn what(&self) -> String {
        if let Some(name) = &self.name {
            return format!("subscription {name} of {}", self.tenant);
        }
        match &self.source {
            Some(source) => format!("{} of {}/{}", self.action, self.tenant, source),
            None => format!("{} of {}", self.action, self.tenant),
        }
    }

    pub fn into_route(self) -> Result<Route, String> {
        if self.tenant.trim().is_empty() {
            return Err("tenant is empty".into());
        }
        if self.source.as_deref().is_some_and(|s| s.trim().is_empty()) {
            return Err("source is empty (leave it out to route every source)".into());
        }
        if !ACTIONS.contains(&self.action.as_str()) {
            return Err(format!(
                "unknown action {:?}: the outbox writes {}",
                self.action,
                ACTIONS.join(", ")
            ));
        }
        let given: Vec<&str> = [
            ("url", self.url.is_some()),
            ("bus", self.bus.is_some()),
            ("event_source", self.event_source.is_some()),
            ("queue_url", self.queue_url.is_some()),
            ("topic_arn", self.topic_arn.is_some()),
        ]
        .iter()
        .filter(|(_, set)| *set)
        .map(|(name, _)| *name)
        .collect();
        let allowed: &[&str] = match self.destination.as_str() {
            "http" => &["url"],
            "eventbridge" => &["bus", "event_source"],
            "sqs" => &["queue_url"],
            "sns" => &["topic_arn"],
            other => {
                return Err(format!(
                    "destination {other:?} is not one of http, eventbridge, sqs, sns"
                ));
            }
        };
        if let Some(extra) = given.iter().find(|g| !allowed.contains(g)) {
            return Err(format!(
                "{extra} does not apply to a {} destination (it takes {})",
                self.destination,
                allowed.join(", ")
            ));
        }
        let need = |value: Option<String>, name: &str| {
            value.ok_or_else(|| format!("a {} destination needs {name}", self.destination))
        };
        let destination = match self.destination.as_str() {
            "http" => Destination::http(need(self.url.clone(), "url")?)?,
            "eventbridge" => Destination::eventbridge(
                need(self.bus.clone(), "bus")?,
                self.event_source
                    .clone()
                    .unwrap_or_else(|| DEFAULT_EVENT_SOURCE.to_owned()),
            )?,
            "sqs" => Destination::sqs(need(self.queue_url.clone(), "queue_url")?)?,
            _ => Destination::sns(need(self.topic_arn.clone(), "topic_arn")?)?,
        };
        if let Some(secret) = &self.signing_secret_ref {
            if self.destination != "http" {
                return Err(format!(
                    "signing_secret_ref signs HTTP deliveries; a {} destination is reached with IAM",
                    self.destination
                ));
            }
            if secret.trim().is_empty() {
                return Err("signing_secret_ref is empty".into());
            }
        }
        let subscription = self.subscription()?;
        Ok(Route {
            tenant_id: self.tenant,
            source_id: self.source,
            action: self.action,
            destination,
            signing_secret_ref: self.signing_secret_ref,
            subscription,
        })
    }

    fn subscription(&self) -> Result<Option<SubscriptionSpec>, String> {
        if self.action != EVENT {
            for (field, set) in [
                ("name", self.name.is_some()),
                ("types", self.types.is_some()),
                ("filter", self.filter.is_some()),
                ("rate_limit", self.rate_limit.is_some()),
            ] {
                if set {
                    return Err(format!(
                        "{field} belongs to a subscription (action = \"event\"), not to {}",
                        self.action
                    ));
                }
            }
            return Ok(None);
        }
        let name = self
            .name
            .clone()
            .ok_or("a subscription (action = \"event\") needs a name")?;
        if !subscriptions::valid_name(&name) {
            return Err(format!(
                "name {name:?} is not a subscription name (1 to 63 of a-z 0-9 . _ -, starting with a letter or digit)"
            ));
        }
        let event_types = self.types.clone().unwrap_or_default();
        if event_types.iter().any(|t| t.trim().is_empty()) {
            return Err("types holds an empty event type".into());
        }
        let filter = match &self.filter {
            None => None,
            Some(f) => {
                if !(f.pointer.is_empty() || f.pointer.starts_with('/')) {
                    return Err(format!(
                        "filter pointer {:?} is not a JSON pointer (it starts with /)",
                        f.pointer
                    ));
                }
                let values = match (&f.equals, &f.one_of) {
                    (Some(v), None) => vec![v.clone()],
                    (None, Some(vs)) if !vs.is_empty() => vs.clone(),
                    (None, Some(_)) => return Err("filter in = [] matches nothing".into()),
                    _ => {
                        return Err(
                            "a filter takes equals = <value> or in = [<values>], one of them"
                                .into(),
                        );
                    }
                };
                Some(PayloadFilter {
                    pointer: f.pointer.clone(),
                    values,
                })
            }
        };
        if let Some(rate) = self.rate_limit
            && !(rate.is_finite() && rate > 0.0)
        {
            return Err(format!(
                "rate_limit {rate} is not a positive number of deliveries a second"
            ));
        }
        Ok(Some(SubscriptionSpec {
            name,
            selection: Selection {
                event_types,
                filter,
            },
            rate_limit: self.rate_limit,
        }))
    }
}

fn duplicate_free(routes: &[Route]) -> Result<(), RoutesError> {
    let mut seen = HashSet::new();
    let mut names = HashSet::new();
    for r in routes {
        if let Some(s) = &r.subscription {
            if !names.insert((&r.tenant_id, &s.name)) {
                return Err(RoutesError::Duplicate {
                    what: format!("subscription {} of tenant {}", s.name, r.tenant_id),
                });
            }
            continue;
        }
        if !seen.insert((&r.tenant_id, &r.source_id, &r.action)) {
            return Err(RoutesError::Duplicate {
                what: describe(&r.tenant_id, r.source_id.as_deref(), &r.action),
            });
        }
    }
    Ok(())
}

fn describe(tenant: &str, source: Option<&str>, action: &str) -> String {
    match source {
        Some(source) => format!("{action} of tenant {tenant}, source {source}"),
        None => format!("{action} of tenant {tenant}"),
    }
}

/// Parses and validates a route file's text; `path` names it in errors.
pub fn parse_routes(path: &str, text: &str) -> Result<Vec<Route>, RoutesError> {
    let file: RoutesFile = toml::from_str(text).map_err(|e| RoutesError::Parse {
        path: path.to_owned(),
        message: e.to_string(),
    })?;
    let routes = file
        .route
        .into_iter()
        .enumerate()
        .map(|(i, spec)| {
            let what = spec.what();
            spec.into_route().map_err(|reason| RoutesError::Invalid {
                path: path.to_owned(),
                index: i + 1,
                what,
                reason,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    duplicate_free(&routes)?;
    Ok(routes)
}

/// Reads and validates a route file.
pub fn read_routes_file(path: &Path) -> Result<Vec<Route>, RoutesError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| RoutesError::Read {
        path: shown.clone(),
        source,
    })?;
    parse_routes(&shown, &text)
}

impl From<&Route> for RouteRow {
    fn from(r: &Route) -> Self {
        let (kind, target, event_source) = r.destination.to_columns();
        RouteRow {
            tenant_id: r.tenant_id.clone(),
            source_id: r.source_id.clone(),
            action: r.action.clone(),
            kind: kind.to_owned(),
            target,
            event_source,
            signing_secret_ref: r.signing_secret_ref.clone(),
        }
    }
}

impl Route {
    /// The subscription's row, when the route is one.
    fn subscription_row(&self) -> Option<SubscriptionRow> {
        let s = self.subscription.as_ref()?;
        let (kind, target, event_source) = self.destination.to_columns();
        let filter = s.selection.filter.as_ref();
        Some(SubscriptionRow {
            tenant_id: self.tenant_id.clone(),
            name: s.name.clone(),
            source_id: self.source_id.clone(),
            event_types: s.selection.event_types.clone(),
            payload_pointer: filter.map(|f| f.pointer.clone()),
            payload_values: filter.map(|f| serde_json::Value::Array(f.values.clone())),
            kind: kind.to_owned(),
            target,
            event_source,
            signing_secret_ref: self.signing_secret_ref.clone(),
            rate_limit: s.rate_limit,
        })
    }
}

impl TryFrom<SubscriptionRow> for Route {
    type Error = StoreError;

    fn try_from(row: SubscriptionRow) -> Result<Self, StoreError> {
        let destination =
            Destination::from_columns(&row.kind, &row.target, row.event_source.clone()).map_err(
                |reason| StoreError::Corrupt {
                    what: "outbox subscription",
                    reason,
                },
            )?;
        Ok(Route {
            subscription: Some(SubscriptionSpec {
                name: row.name.clone(),
                selection: subscriptions::selection_of(&row),
                rate_limit: row.rate_limit,
            }),
            tenant_id: row.tenant_id,
            source_id: row.source_id,
            action: EVENT.to_owned(),
            destination,
            signing_secret_ref: row.signing_secret_ref,
        })
    }
}

impl TryFrom<RouteRow> for Route {
    type Error = StoreError;

    fn try_from(row: RouteRow) -> Result<Self, StoreError> {
        let destination = Destination::from_columns(&row.kind, &row.target, row.event_source)
            .map_err(|reason| StoreError::Corrupt {
                what: "outbox route",
                reason,
            })?;
        Ok(Route {
            tenant_id: row.tenant_id,
            source_id: row.source_id,
            action: row.action,
            destination,
            signing_secret_ref: row.signing_secret_ref,
            subscription: None,
        })
    }
}

/// Replaces the stored routes with `routes`, all or nothing: the file is the whole set, so a
/// route left out of it is removed. Refused when a route names a source the tenant does not
/// have. Applies run one at a time.
pub async fn apply(pool: &PgPool, routes: &[Route]) -> Result<(), RoutesError> {
    duplicate_free(routes)?;
    let mut tx = pool.begin().await.map_err(StoreError::from)?;
    outbox_routes::lock_for_apply(&mut *tx).await?;
    outbox_routes::delete_all(&mut *tx).await?;
    stored_subscriptions::delete_all(&mut *tx).await?;
    for route in routes {
        match route.subscription_row() {
            Some(row) => stored_subscriptions::insert(&mut *tx, &row).await?,
            None => outbox_routes::insert(&mut *tx, &RouteRow::from(route)).await?,
        }
    }
    if let Some((tenant, source_id)) = outbox_routes::unknown_sources(&mut *tx)
        .await?
        .into_iter()
        .next()
    {
        let action = routes
            .iter()
            .find(|r| r.tenant_id == tenant && r.source_id.as_deref() == Some(&source_id))
            .map(|r| r.action.clone())
            .unwrap_or_default();
        return Err(RoutesError::UnknownSource {
            tenant,
            source_id,
            action,
        });
    }
    tx.commit().await.map_err(StoreError::from)?;
    Ok(())
}

/// The stored routes, subscriptions after the effects' routes.
pub async fn list(conn: &mut sqlx::PgConnection) -> Result<Vec<Route>, StoreError> {
    let mut routes = store::outbox_routes::list(&mut *conn)
        .await?
        .into_iter()
        .map(Route::try_from)
        .collect::<Result<Vec<_>, _>>()?;
    for row in stored_subscriptions::list(&mut *conn).await? {
        routes.push(Route::try_from(row)?);
    }
    Ok(routes)
}

type RouteKey = (String, Option<String>, String);

/// Where a route sends its messages, and how.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub destination: Destination,
    /// HTTP: the secret its deliveries are signed with.
    pub signing_secret_ref: Option<String>,
    /// A subscription's: at most this many deliveries a second.
    pub rate_limit: Option<f64>,
}

impl Target {
    fn of(route: Route) -> (RouteKey, Self) {
        let key = match &route.subscription {
            // A subscription's name is unique in its tenant: its messages are found by it.
            Some(s) => (
                route.tenant_id.clone(),
                None,
                subscriptions::action_of(&s.name),
            ),
            None => (
                route.tenant_id.clone(),
                route.source_id.clone(),
                route.action.clone(),
            ),
        };
        let target = Target {
            rate_limit: route.subscription.as_ref().and_then(|s| s.rate_limit),
            signing_secret_ref: route.signing_secret_ref,
            destination: route.destination,
        };
        (key, target)
    }
}

/// The routes, looked up as the sender needs them.
#[derive(Debug, Clone, Default)]
pub struct RouteTable {
    /// (tenant, source, action) → target, or why the stored route is not one: a bad row fails
    /// the messages it would route, with its reason, and no other. A subscription's under
    /// (tenant, none, `event:<name>`).
    by_key: HashMap<RouteKey, Result<Target, String>>,
}

impl RouteTable {
    pub fn new(routes: Vec<Route>) -> Self {
        Self {
            by_key: routes
                .into_iter()
                .map(|r| {
                    let (key, target) = Target::of(r);
                    (key, Ok(target))
                })
                .collect(),
        }
    }

    pub async fn load(conn: &mut sqlx::PgConnection) -> Result<Self, StoreError> {
        let mut by_key = HashMap::new();
        for row in store::outbox_routes::list(&mut *conn).await? {
            let target = Destination::from_columns(&row.kind, &row.target, row.event_source).map(
                |destination| Target {
                    destination,
                    signing_secret_ref: row.signing_secret_ref,
                    rate_limit: None,
                },
            );
            by_key.insert((row.tenant_id, row.source_id, row.action), target);
        }
        for row in stored_subscriptions::list(&mut *conn).await? {
            let key = (
                row.tenant_id.clone(),
                None,
                subscriptions::action_of(&row.name),
            );
            let target = Destination::from_columns(&row.kind, &row.target, row.event_source).map(
                |destination| Target {
                    destination,
                    signing_secret_ref: row.signing_secret_ref,
                    rate_limit: row.rate_limit,
                },
            );
            by_key.insert(key, target);
        }
        Ok(Self { by_key })
    }

    /// The source's own route for the action, else the tenant's.
    pub fn find(
        &self,
        tenant: &str,
        source: Option<&str>,
        action: &str,
    ) -> Option<&Result<Target, String>> {
        let key = |source: Option<&str>| {
            (
                tenant.to_owned(),
                source.map(str::to_owned),
                action.to_owned(),
            )
        };
        source
            .and_then(|s| self.by_key.get(&key(Some(s))))
            .or_else(|| self.by_key.get(&key(None)))
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
}

/// The error of a message no route covers.
pub fn unrouted_reason(tenant: &str, source: Option<&str>, action: &str) -> String {
    format!(
        "no route for {}: add one to the route file (hookctl routes apply), then resend",
        describe(tenant, source, action)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const QUEUE: &str = "https://sqs.us-east-1.amazonaws.com/123456789012/orders.fifo";

    #[test]
    fn a_route_file_parses_into_routes_of_each_kind() {
        let text = format!(
            r#"
[[route]]
tenant = "acme"
action = "entity.changed"
destination = "sqs"
queue_url = "{QUEUE}"

[[route]]
tenant = "acme"
source = "acme-stripe"
action = "fulfil_order"
destination = "eventbridge"
bus = "orders"

[[route]]
tenant = "beta"
action = "entity.changed"
destination = "sns"
topic_arn = "arn:aws:sns:us-east-1:123456789012:changes"

[[route]]
tenant = "beta"
action = "fulfil_order"
destination = "http"
url = "https://beta.example/fulfil"
"#
        );
        let routes = parse_routes("routes.toml", &text).unwrap();
        assert_eq!(routes.len(), 4);
        assert_eq!(
            routes[0].destination,
            Destination::sqs(QUEUE.into()).unwrap()
        );
        assert_eq!(
            routes[1].destination,
            Destination::eventbridge("orders".into(), DEFAULT_EVENT_SOURCE.into()).unwrap()
        );
        let table = RouteTable::new(routes);
        assert!(matches!(
            table.find("acme", Some("acme-stripe"), "fulfil_order"),
            Some(Ok(Target {
                destination: Destination::EventBridge { .. },
                ..
            }))
        ));
        assert!(
            table
                .find("acme", Some("acme-shop"), "fulfil_order")
                .is_none(),
            "a source's route serves that source only"
        );
        assert!(matches!(
            table.find("acme", Some("any"), "entity.changed"),
            Some(Ok(Target {
                destination: Destination::Sqs { .. },
                ..
            }))
        ));
        assert!(table.find("gamma", None, "entity.changed").is_none());
    }

    fn refused(route: &str) -> String {
        parse_routes("r.toml", &format!("[[route]]\n{route}"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn a_route_file_is_refused_with_the_route_and_the_reason() {
        assert!(
            refused("tenant = \"a\"\naction = \"entity.changd\"\ndestination = \"sqs\"\nqueue_url = \"x\"")
                .contains("unknown action \"entity.changd\"")
        );
        assert!(
            refused("tenant = \"a\"\naction = \"entity.changed\"\ndestination = \"kafka\"")
                .contains("\"kafka\" is not one of")
        );
        assert!(
            refused("tenant = \"a\"\naction = \"entity.changed\"\ndestination = \"sqs\"")
                .contains("needs queue_url")
        );
        assert!(
            refused("tenant = \"a\"\naction = \"entity.changed\"\ndestination = \"sqs\"\nqueue_url = \"orders\"")
                .contains("queue URL")
        );
        assert!(
            refused("tenant = \"a\"\naction = \"entity.changed\"\ndestination = \"sns\"\ntopic_arn = \"arn:aws:sqs:us-east-1:1:q\"")
                .contains("topic ARN")
        );
        assert!(
            refused(
                "tenant = \"a\"\naction = \"entity.changed\"\ndestination = \"http\"\nbus = \"b\""
            )
            .contains("bus does not apply to a http destination")
        );
        assert!(
            refused("tenant = \"a\"\naction = \"entity.changed\"\ndestination = \"eventbridge\"\nbus = \"b\"\nevent_source = \"aws.s3\"")
                .contains("aws.")
        );
        let twice = format!(
            "[[route]]\ntenant = \"a\"\naction = \"fulfil_order\"\ndestination = \"sqs\"\nqueue_url = \"{QUEUE}\"\n\
             [[route]]\ntenant = \"a\"\naction = \"fulfil_order\"\ndestination = \"http\"\nurl = \"https://x\"\n"
        );
        assert!(
            parse_routes("r.toml", &twice)
                .unwrap_err()
                .to_string()
                .contains("fulfil_order of tenant a is routed twice")
        );
    }
}
