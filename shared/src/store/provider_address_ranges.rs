//! The `provider_address_ranges` table: the webhook address ranges each provider publishes, as
//! the ranges pass last read them (`crate::address_ranges`), and what became of its tries.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use super::StoreError;

/// How long a list is trusted after it was read, as SQL: ingest judges no delivery against an
/// older one and the `provider_ranges_stale` check counts it. One text for both
/// ([`crate::address_ranges::STALE_AFTER`] is read from it).
macro_rules! stale_after_seconds {
    () => {
        "86400"
    };
}
pub(crate) use stale_after_seconds;

/// A provider's row.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct StoredRanges {
    pub provider: String,
    pub source_url: String,
    /// The CIDRs as PostgreSQL writes them (`192.0.2.0/24`, `2001:db8::/32`); `None` until a
    /// try succeeded.
    pub cidrs: Option<Vec<String>>,
    pub fetched_at: Option<DateTime<Utc>>,
    pub attempted_at: DateTime<Utc>,
    /// Tries that failed since the list was read.
    pub failures: i32,
    pub last_error: Option<String>,
}

/// Every provider's row, by name.
pub async fn list(executor: impl PgExecutor<'_>) -> Result<Vec<StoredRanges>, StoreError> {
    const SQL: &str = "SELECT provider, source_url, cidrs::text[] AS cidrs, fetched_at, attempted_at, \
             failures, last_error \
         FROM provider_address_ranges ORDER BY provider";
    Ok(sqlx::query_as(SQL).fetch_all(executor).await?)
}

/// Keeps the list just read from `source_url` in place of the provider's last one.
#[tracing::instrument(skip(executor, cidrs), fields(cidrs = cidrs.len()), err)]
pub async fn record_fetched(
    executor: impl PgExecutor<'_>,
    provider: &str,
    source_url: &str,
    cidrs: &[String],
) -> Result<(), StoreError> {
    const SQL: &str = "INSERT INTO provider_address_ranges \
             (provider, source_url, cidrs, fetched_at, attempted_at, failures, last_error) \
         VALUES ($1, $2, $3::text[]::cidr[], now(), now(), 0, NULL) \
         ON CONFLICT (provider) DO UPDATE SET source_url = EXCLUDED.source_url, \
             cidrs = EXCLUDED.cidrs, fetched_at = EXCLUDED.fetched_at, \
             attempted_at = EXCLUDED.attempted_at, failures = 0, last_error = NULL";
    sqlx::query(SQL)
        .bind(provider)
        .bind(source_url)
        .bind(cidrs)
        .execute(executor)
        .await?;
    Ok(())
}

/// Counts a failed try, keeping whatever list the provider has.
#[tracing::instrument(skip(executor), err)]
pub async fn record_failure(
    executor: impl PgExecutor<'_>,
    provider: &str,
    source_url: &str,
    error: &str,
) -> Result<(), StoreError> {
    const SQL: &str = "INSERT INTO provider_address_ranges \
             (provider, source_url, attempted_at, failures, last_error) \
         VALUES ($1, $2, now(), 1, $3) \
         ON CONFLICT (provider) DO UPDATE SET attempted_at = EXCLUDED.attempted_at, \
             failures = provider_address_ranges.failures + 1, last_error = EXCLUDED.last_error";
    sqlx::query(SQL)
        .bind(provider)
        .bind(source_url)
        .bind(error)
        .execute(executor)
        .await?;
    Ok(())
}
