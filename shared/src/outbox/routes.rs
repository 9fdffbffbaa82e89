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
//! ```

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde::Deserialize;
use sqlx::PgPool;

use super::destinations::Destination;
use crate::effects::entity::ENTITY_CHANGED;
use crate::effects::payments::FULFIL_ORDER;
use crate::store::outbox_routes::{self, RouteRow};
use crate::store::{self, StoreError};

/// The actions the effects write to the outbox: a route must name one of them.
pub const ACTIONS: &[&str] = &[ENTITY_CHANGED, FULFIL_ORDER];

/// The entries' `Source` of an EventBridge route that names none.
pub use super::destinations::DEFAULT_EVENT_SOURCE;

/// One route: the action of a tenant (or of one of its sources) and where it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub tenant_id: String,
    /// `None`: every source of the tenant that has no route of its own for the action.
    pub source_id: Option<String>,
    pub action: String,
    pub destination: Destination,
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
        Ok(Route {
            tenant_id: self.tenant,
            source_id: self.source,
            action: self.action,
            destination,
        })
    }
}

fn duplicate_free(routes: &[Route]) -> Result<(), RoutesError> {
    let mut seen = HashSet::new();
    for r in routes {
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
        }
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
    for route in routes {
        outbox_routes::insert(&mut *tx, &RouteRow::from(route)).await?;
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

/// The stored routes.
pub async fn list(executor: impl sqlx::PgExecutor<'_>) -> Result<Vec<Route>, StoreError> {
    store::outbox_routes::list(executor)
        .await?
        .into_iter()
        .map(Route::try_from)
        .collect()
}

type RouteKey = (String, Option<String>, String);

/// The routes, looked up as the sender needs them.
#[derive(Debug, Clone, Default)]
pub struct RouteTable {
    /// (tenant, source, action) → destination, or why the stored route is not one: a bad row
    /// fails the messages it would route, with its reason, and no other.
    by_key: HashMap<RouteKey, Result<Destination, String>>,
}

impl RouteTable {
    pub fn new(routes: Vec<Route>) -> Self {
        Self {
            by_key: routes
                .into_iter()
                .map(|r| ((r.tenant_id, r.source_id, r.action), Ok(r.destination)))
                .collect(),
        }
    }

    pub async fn load(executor: impl sqlx::PgExecutor<'_>) -> Result<Self, StoreError> {
        let rows = store::outbox_routes::list(executor).await?;
        Ok(Self {
            by_key: rows
                .into_iter()
                .map(|row| {
                    let destination =
                        Destination::from_columns(&row.kind, &row.target, row.event_source);
                    ((row.tenant_id, row.source_id, row.action), destination)
                })
                .collect(),
        })
    }

    /// The source's own route for the action, else the tenant's.
    pub fn find(
        &self,
        tenant: &str,
        source: Option<&str>,
        action: &str,
    ) -> Option<&Result<Destination, String>> {
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
            Some(Ok(Destination::EventBridge { .. }))
        ));
        assert!(
            table
                .find("acme", Some("acme-shop"), "fulfil_order")
                .is_none(),
            "a source's route serves that source only"
        );
        assert!(matches!(
            table.find("acme", Some("any"), "entity.changed"),
            Some(Ok(Destination::Sqs { .. }))
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
