//! The `partner_certificates` table: the client certificates partners' requests came with, when
//! each was first and last seen and when it expires (the `partner_certificates_expiring` check).

use sqlx::PgExecutor;

use super::StoreError;

/// A certificate a partner's admitted request came with.
#[derive(Debug, Clone)]
pub struct Seen<'a> {
    pub source_id: &'a str,
    pub sha256: &'a [u8; 32],
    pub subject: Option<&'a str>,
    pub not_after: Option<chrono::DateTime<chrono::Utc>>,
}

/// Records that `seen` came in a request now.
pub async fn record(executor: impl PgExecutor<'_>, seen: &Seen<'_>) -> Result<(), StoreError> {
    const SQL: &str = "INSERT INTO partner_certificates (source_id, sha256, subject, not_after) \
         VALUES ($1, $2, $3, $4) \
         ON CONFLICT (source_id, sha256) DO UPDATE SET last_seen_at = now(), \
             subject = COALESCE(EXCLUDED.subject, partner_certificates.subject), \
             not_after = COALESCE(EXCLUDED.not_after, partner_certificates.not_after)";
    sqlx::query(SQL)
        .bind(seen.source_id)
        .bind(&seen.sha256[..])
        .bind(seen.subject)
        .bind(seen.not_after)
        .execute(executor)
        .await?;
    Ok(())
}

/// A certificate as `hookctl sources certificates` lists it.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct PartnerCertificate {
    pub source_id: String,
    /// Its SHA-256 fingerprint, lowercase hex (as a source pins it).
    pub sha256: String,
    pub subject: Option<String>,
    pub not_after: Option<chrono::DateTime<chrono::Utc>>,
    pub first_seen_at: chrono::DateTime<chrono::Utc>,
    pub last_seen_at: chrono::DateTime<chrono::Utc>,
    /// Whether its source pins it now.
    pub pinned: bool,
}

/// Every certificate seen, by source and newest first.
pub async fn list(executor: impl PgExecutor<'_>) -> Result<Vec<PartnerCertificate>, StoreError> {
    const SQL: &str = "SELECT c.source_id, encode(c.sha256, 'hex') AS sha256, c.subject, c.not_after, \
             c.first_seen_at, c.last_seen_at, \
             EXISTS (SELECT 1 FROM jsonb_array_elements_text(s.partner -> 'client_certificates') AS p \
                     WHERE p = encode(c.sha256, 'hex')) AS pinned \
         FROM partner_certificates AS c JOIN sources AS s USING (source_id) \
         ORDER BY c.source_id, c.last_seen_at DESC";
    Ok(sqlx::query_as(SQL).fetch_all(executor).await?)
}
