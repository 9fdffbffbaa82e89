//! The library every webhook function links: trusted sources, signature schemes, secrets, the
//! Postgres store and the ingest path. It knows nothing about Lambda event types; the crates
//! under `functions/` adapt Lambda events to the calls made here.

pub mod address_lists;
pub mod address_ranges;
pub mod anomaly;
pub mod aws;
pub mod backfill;
pub mod batches;
pub mod buffer;
pub mod catalogue;
pub mod config;
pub mod database;
pub mod domain;
pub mod drain;
pub mod effects;
pub mod extract;
pub mod github_api;
pub mod ingest;
pub mod maintenance;
pub mod metrics;
pub mod operator;
pub mod outbox;
pub mod partners;
pub mod prepare;
pub mod protocol;
pub mod provider_api;
pub mod reconcile;
pub mod redirects;
pub mod retention;
pub mod schema;
pub mod secrets;
pub mod signature;
pub mod sources;
pub mod stale;
pub mod status;
pub mod store;
pub mod subscriptions;
pub mod telemetry;

pub use domain::{ExternalId, FieldLocator, Scheme, SecretVersion, SourceId, TenantId};
