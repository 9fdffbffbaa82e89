//! The `deliveries_outside_ranges` table: signed deliveries whose source address lay outside
//! their provider's published ranges, one row a source and address, counted; each source's 100
//! most recently seen addresses kept.

use std::net::IpAddr;

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use super::StoreError;

/// How many addresses of one source are kept.
pub const KEPT_PER_SOURCE: i64 = 100;

/// One delivery from outside, as ingest saw it.
#[derive(Debug, Clone)]
pub struct OutsideDelivery<'a> {
    pub source_id: &'a str,
    pub tenant_id: &'a str,
    pub provider: &'a str,
    pub address: IpAddr,
    /// Refused (the source enforces) rather than admitted (it observes).
    pub refused: bool,
}

/// Counts the delivery against its source and address, and keeps the source's newest
/// [`KEPT_PER_SOURCE`] addresses, in one statement.
#[tracing::instrument(skip_all, fields(source_id = delivery.source_id, refused = delivery.refused), err)]
pub async fn record(
    executor: impl PgExecutor<'_>,
    delivery: &OutsideDelivery<'_>,
) -> Result<(), StoreError> {
    const SQL: &str = "WITH seen AS (INSERT INTO deliveries_outside_ranges \
                 (source_id, source_address, tenant_id, provider, admitted, refused) \
             VALUES ($1, $2::inet, $3, $4, $5, $6) \
             ON CONFLICT (source_id, source_address) DO UPDATE SET last_seen_at = now(), \
                 tenant_id = EXCLUDED.tenant_id, provider = EXCLUDED.provider, \
                 admitted = deliveries_outside_ranges.admitted + EXCLUDED.admitted, \
                 refused = deliveries_outside_ranges.refused + EXCLUDED.refused \
             RETURNING 1), \
         older AS (DELETE FROM deliveries_outside_ranges WHERE source_id = $1 \
             AND source_address <> $2::inet AND source_address IN \
             (SELECT source_address FROM deliveries_outside_ranges WHERE source_id = $1 \
              ORDER BY last_seen_at DESC, source_address OFFSET $7 - 1)) \
         SELECT count(*) FROM seen";
    sqlx::query_scalar::<_, i64>(SQL)
        .bind(delivery.source_id)
        .bind(delivery.address.to_string())
        .bind(delivery.tenant_id)
        .bind(delivery.provider)
        .bind(i64::from(!delivery.refused))
        .bind(i64::from(delivery.refused))
        .bind(KEPT_PER_SOURCE)
        .fetch_one(executor)
        .await?;
    Ok(())
}

/// One source's address outside its provider's ranges.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct Outside {
    pub source_id: String,
    pub tenant_id: String,
    pub provider: String,
    /// The address, as PostgreSQL writes a host (`203.0.113.9`, `2001:db8::1`).
    pub source_address: String,
    pub first_seen_at: DateTime<Utc>,
    pub last_seen_at: DateTime<Utc>,
    pub admitted: i64,
    pub refused: i64,
}

/// The addresses seen most recently, of every source, newest first.
pub async fn list(executor: impl PgExecutor<'_>, limit: i64) -> Result<Vec<Outside>, StoreError> {
    const SQL: &str = "SELECT source_id, tenant_id, provider, host(source_address) AS source_address, \
             first_seen_at, last_seen_at, admitted, refused \
         FROM deliveries_outside_ranges ORDER BY last_seen_at DESC, source_id, source_address LIMIT $1";
    Ok(sqlx::query_as(SQL).bind(limit).fetch_all(executor).await?)
}
