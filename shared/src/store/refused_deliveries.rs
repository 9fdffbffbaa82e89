//! The `refused_deliveries` table: deliveries of a known source refused before anything was
//! stored, with their reason and the safe parts of the request (never the body, a signature or
//! a header's value beyond the user agent and content type), the newest 100 of each source.

use sqlx::PgExecutor;

use super::StoreError;

/// How many refusals of one source are kept.
pub const KEPT_PER_SOURCE: i64 = 100;

/// A refusal as ingest saw it.
#[derive(Debug, Clone)]
pub struct NewRefusal<'a> {
    pub tenant_id: &'a str,
    pub source_id: &'a str,
    pub status: u16,
    pub reason: &'a str,
    pub check_failed: &'a str,
    pub detail: &'a str,
    pub method: &'a str,
    pub body_bytes: usize,
    pub body_sha256: [u8; 32],
    pub header_names: Vec<String>,
    pub user_agent: Option<&'a str>,
    pub content_type: Option<&'a str>,
    /// Refusals of the source and reason not kept since the last one kept.
    pub also_refused: u32,
}

/// Records a refusal and keeps its source's newest [`KEPT_PER_SOURCE`], in one statement.
pub async fn record(
    executor: impl PgExecutor<'_>,
    refusal: &NewRefusal<'_>,
) -> Result<i64, StoreError> {
    const SQL: &str = "WITH added AS (INSERT INTO refused_deliveries (tenant_id, source_id, status, reason, \
                 check_failed, detail, method, body_bytes, body_sha256, header_names, user_agent, \
                 content_type, also_refused) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) RETURNING refusal_id), \
         older AS (DELETE FROM refused_deliveries WHERE source_id = $2 AND refusal_id <= \
             (SELECT refusal_id FROM refused_deliveries WHERE source_id = $2 \
              ORDER BY refusal_id DESC OFFSET $14 - 1 LIMIT 1)) \
         SELECT refusal_id FROM added";
    Ok(sqlx::query_scalar(SQL)
        .bind(refusal.tenant_id)
        .bind(refusal.source_id)
        .bind(i16::try_from(refusal.status).unwrap_or(i16::MAX))
        .bind(refusal.reason)
        .bind(refusal.check_failed)
        .bind(refusal.detail)
        .bind(refusal.method)
        .bind(i32::try_from(refusal.body_bytes).unwrap_or(i32::MAX))
        .bind(refusal.body_sha256.as_slice())
        .bind(&refusal.header_names)
        .bind(refusal.user_agent)
        .bind(refusal.content_type)
        .bind(i32::try_from(refusal.also_refused).unwrap_or(i32::MAX))
        .bind(KEPT_PER_SOURCE)
        .fetch_one(executor)
        .await?)
}

/// One kept refusal.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct Refusal {
    pub refusal_id: i64,
    pub refused_at: chrono::DateTime<chrono::Utc>,
    pub tenant_id: String,
    pub source_id: String,
    pub status: i16,
    pub reason: String,
    pub check_failed: String,
    pub detail: String,
    pub method: String,
    pub body_bytes: i32,
    /// Hex.
    pub body_sha256: String,
    pub header_names: Vec<String>,
    pub user_agent: Option<String>,
    pub content_type: Option<String>,
    pub also_refused: i32,
}

/// The newest refusals, of one source or all, newest first.
pub async fn list(
    executor: impl PgExecutor<'_>,
    source_id: Option<&str>,
    limit: i64,
) -> Result<Vec<Refusal>, StoreError> {
    const SQL: &str = "SELECT refusal_id, refused_at, tenant_id, source_id, status, reason, check_failed, \
             detail, method, body_bytes, encode(body_sha256, 'hex') AS body_sha256, header_names, \
             user_agent, content_type, also_refused \
         FROM refused_deliveries WHERE ($1::text IS NULL OR source_id = $1) \
         ORDER BY refusal_id DESC LIMIT $2";
    Ok(sqlx::query_as(SQL)
        .bind(source_id)
        .bind(limit)
        .fetch_all(executor)
        .await?)
}

/// What a source's refusals add up to: how many of each check failed in the last day, and
/// whether any delivery of the source was stored since its first refusal of the day. A source
/// whose every delivery is refused with `no_match` is one whose secret is wrong; refusals
/// beside stored deliveries are not the provider's.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct SourceRefusals {
    pub source_id: String,
    pub tenant_id: String,
    pub check_failed: String,
    /// Refusals in the last day (kept ones and those counted beside them).
    pub refused_last_day: i64,
    pub first_refused_at: chrono::DateTime<chrono::Utc>,
    pub last_refused_at: chrono::DateTime<chrono::Utc>,
    /// Whether any delivery of the source was stored since the first of these refusals.
    pub stored_since: bool,
    /// What they suggest ([`SourceRefusals::reading`]).
    #[sqlx(skip)]
    #[serde(default)]
    pub reading: String,
}

impl SourceRefusals {
    /// What a source's refusals of one check suggest: every delivery refused for a signature
    /// that does not match, none stored since, is a secret that is not the provider's;
    /// refusals beside stored deliveries are someone else's requests.
    pub fn reading(&self) -> &'static str {
        match (self.check_failed.as_str(), self.stored_since) {
            ("unusable_secret", _) => "the source's secret cannot be used: fix it",
            ("outside_provider_ranges", _) => {
                "signed, but from outside the provider's published addresses: the secret used \
                 elsewhere, or a range the list lacks (hookctl providers ranges)"
            }
            ("no_match", false) => {
                "nothing stored since the first: is the source's secret the provider's?"
            }
            ("stale_timestamp" | "future_timestamp", false) => {
                "nothing stored since the first: is a clock (this one or the provider's) off?"
            }
            (_, true) => "deliveries were stored meanwhile: these are not the provider's own",
            (_, false) => "nothing stored since the first",
        }
    }
}

/// Every source's refusals of the last day, by the check that failed.
pub async fn last_day(executor: impl PgExecutor<'_>) -> Result<Vec<SourceRefusals>, StoreError> {
    const SQL: &str = "SELECT r.source_id, r.tenant_id, r.check_failed, \
             sum(1 + r.also_refused)::bigint AS refused_last_day, \
             min(r.refused_at) AS first_refused_at, max(r.refused_at) AS last_refused_at, \
             EXISTS (SELECT 1 FROM webhook_events AS w WHERE w.source_id = r.source_id \
                AND w.first_received_at >= min(r.refused_at)) AS stored_since \
         FROM refused_deliveries AS r WHERE r.refused_at > now() - interval '1 day' \
         GROUP BY r.source_id, r.tenant_id, r.check_failed \
         ORDER BY r.source_id, refused_last_day DESC";
    let mut rows: Vec<SourceRefusals> = sqlx::query_as(SQL).fetch_all(executor).await?;
    for row in &mut rows {
        row.reading = row.reading().to_owned();
    }
    Ok(rows)
}
