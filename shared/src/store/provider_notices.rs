//! The `provider_notices` table: signed messages a provider sends about a subscription, not an
//! event of it (Twitch's `revocation`), kept for the operator, the newest 100 of each source.

use sqlx::PgExecutor;

use super::StoreError;

/// How many notices of one source are kept.
pub const KEPT_PER_SOURCE: i64 = 100;

/// A notice as received.
#[derive(Debug, Clone)]
pub struct NewNotice<'a> {
    pub tenant_id: &'a str,
    pub source_id: &'a str,
    pub kind: &'a str,
    pub subject: Option<&'a str>,
    pub detail: Option<&'a str>,
    pub payload: &'a [u8],
}

/// Records a notice and keeps its source's newest [`KEPT_PER_SOURCE`], in one statement.
pub async fn record(
    executor: impl PgExecutor<'_>,
    notice: &NewNotice<'_>,
) -> Result<i64, StoreError> {
    const SQL: &str = "WITH added AS (INSERT INTO provider_notices (tenant_id, source_id, kind, subject, detail, payload) \
             VALUES ($1, $2, $3, $4, $5, $6) RETURNING notice_id), \
         older AS (DELETE FROM provider_notices WHERE source_id = $2 AND notice_id <= \
             (SELECT notice_id FROM provider_notices WHERE source_id = $2 \
              ORDER BY notice_id DESC OFFSET $7 - 1 LIMIT 1)) \
         SELECT notice_id FROM added";
    Ok(sqlx::query_scalar(SQL)
        .bind(notice.tenant_id)
        .bind(notice.source_id)
        .bind(notice.kind)
        .bind(notice.subject)
        .bind(notice.detail)
        .bind(notice.payload)
        .bind(KEPT_PER_SOURCE)
        .fetch_one(executor)
        .await?)
}
