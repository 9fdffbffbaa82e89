//! The `sources` table.

use std::time::Duration;

use sqlx::PgExecutor;

use super::StoreError;
use crate::domain::{FieldLocator, SourceId, TenantId};
use crate::extract::FieldMap;
use crate::sources::{GapConfig, GapStrategy, Source};

#[derive(sqlx::FromRow)]
struct SourceRow {
    source_id: String,
    tenant_id: String,
    scheme: String,
    secret_ref: String,
    tolerance_seconds: i32,
    external_id_from: String,
    event_type_from: String,
    entity_id_from: Option<String>,
    entity_version_from: Option<String>,
    entity_version_fallback_from: Option<String>,
    version_tiebreak_from: Option<String>,
    sequence_from: Option<String>,
    enabled: bool,
    gap_strategy: Option<String>,
    id_template: Option<String>,
    api_base_url: Option<String>,
    api_secret_ref: Option<String>,
    gap_grace_seconds: i32,
    gap_window: i64,
    gap_event_types: Option<Vec<String>>,
    github_hook: Option<String>,
    github_app_id: Option<String>,
}

impl TryFrom<SourceRow> for Source {
    type Error = StoreError;

    fn try_from(row: SourceRow) -> Result<Self, Self::Error> {
        let corrupt = |e: crate::domain::ParseError| StoreError::Corrupt {
            what: "source",
            reason: format!("{}: {e}", row.source_id),
        };
        let locator = |raw: &str| FieldLocator::parse(raw).map_err(corrupt);
        let optional = |raw: &Option<String>| raw.as_deref().map(locator).transpose();
        Ok(Source {
            source_id: SourceId::parse(&row.source_id).map_err(corrupt)?,
            tenant_id: TenantId::parse(&row.tenant_id).map_err(corrupt)?,
            scheme: row.scheme.parse().map_err(corrupt)?,
            secret_ref: row.secret_ref.clone(),
            tolerance: Duration::from_secs(u64::try_from(row.tolerance_seconds).unwrap_or(0)),
            fields: FieldMap {
                external_id: locator(&row.external_id_from)?,
                event_type: locator(&row.event_type_from)?,
                entity_id: optional(&row.entity_id_from)?,
                entity_version: optional(&row.entity_version_from)?,
                entity_version_fallback: optional(&row.entity_version_fallback_from)?,
                version_tiebreak: optional(&row.version_tiebreak_from)?,
                sequence: optional(&row.sequence_from)?,
            },
            enabled: row.enabled,
            gaps: match (
                row.gap_strategy.as_deref(),
                row.api_base_url,
                row.api_secret_ref,
            ) {
                (None, _, _) => None,
                (Some(strategy), Some(api_base_url), Some(api_secret_ref)) => Some(GapConfig {
                    strategy: match (strategy, row.id_template) {
                        ("sequence", Some(id_template)) => GapStrategy::Sequence { id_template },
                        ("list_api", _) => GapStrategy::ListApi,
                        ("github_deliveries", _) => GapStrategy::github_deliveries(
                            row.github_hook.as_deref().unwrap_or_default(),
                            row.github_app_id,
                        )
                        .map_err(|reason| StoreError::Corrupt {
                            what: "source",
                            reason: format!("{}: {reason}", row.source_id),
                        })?,
                        (other, _) => {
                            return Err(StoreError::Corrupt {
                                what: "source",
                                reason: format!("{}: gap strategy {other}", row.source_id),
                            });
                        }
                    },
                    api_base_url,
                    api_secret_ref,
                    grace: Duration::from_secs(u64::try_from(row.gap_grace_seconds).unwrap_or(0)),
                    window: row.gap_window,
                    event_types: row.gap_event_types,
                }),
                _ => {
                    return Err(StoreError::Corrupt {
                        what: "source",
                        reason: format!("{}: incomplete gap settings", row.source_id),
                    });
                }
            },
        })
    }
}

macro_rules! source_columns {
    () => {
        "source_id, tenant_id, scheme, secret_ref, tolerance_seconds, external_id_from, \
         event_type_from, entity_id_from, entity_version_from, sequence_from, enabled, \
         gap_strategy, id_template, api_base_url, api_secret_ref, gap_grace_seconds, gap_window, \
         entity_version_fallback_from, version_tiebreak_from, gap_event_types, github_hook, github_app_id"
    };
}

/// The source with this id, enabled or not.
#[tracing::instrument(skip_all, fields(source_id = %id), err)]
pub async fn find(
    executor: impl PgExecutor<'_>,
    id: &SourceId,
) -> Result<Option<Source>, StoreError> {
    const SQL: &str = concat!(
        "SELECT ",
        source_columns!(),
        " FROM sources WHERE source_id = $1"
    );
    let row: Option<SourceRow> = sqlx::query_as(SQL)
        .bind(id.as_str())
        .fetch_optional(executor)
        .await?;
    row.map(Source::try_from).transpose()
}

/// Every source, by id.
pub async fn list(executor: impl PgExecutor<'_>) -> Result<Vec<Source>, StoreError> {
    const SQL: &str = concat!(
        "SELECT ",
        source_columns!(),
        " FROM sources ORDER BY source_id"
    );
    let rows: Vec<SourceRow> = sqlx::query_as(SQL).fetch_all(executor).await?;
    rows.into_iter().map(Source::try_from).collect()
}

/// Inserts the source, or updates it in place when the id exists.
#[tracing::instrument(skip_all, fields(source_id = %source.source_id), err)]
pub async fn upsert(executor: impl PgExecutor<'_>, source: &Source) -> Result<(), StoreError> {
    const SQL: &str = "INSERT INTO sources (source_id, tenant_id, scheme, secret_ref, tolerance_seconds, \
             external_id_from, event_type_from, entity_id_from, entity_version_from, sequence_from, enabled, \
             gap_strategy, id_template, api_base_url, api_secret_ref, gap_grace_seconds, gap_window, \
             entity_version_fallback_from, version_tiebreak_from, gap_event_types, github_hook, github_app_id) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22) \
         ON CONFLICT (source_id) DO UPDATE SET \
             tenant_id = EXCLUDED.tenant_id, scheme = EXCLUDED.scheme, secret_ref = EXCLUDED.secret_ref, \
             tolerance_seconds = EXCLUDED.tolerance_seconds, external_id_from = EXCLUDED.external_id_from, \
             event_type_from = EXCLUDED.event_type_from, entity_id_from = EXCLUDED.entity_id_from, \
             entity_version_from = EXCLUDED.entity_version_from, sequence_from = EXCLUDED.sequence_from, \
             enabled = EXCLUDED.enabled, gap_strategy = EXCLUDED.gap_strategy, id_template = EXCLUDED.id_template, \
             api_base_url = EXCLUDED.api_base_url, api_secret_ref = EXCLUDED.api_secret_ref, \
             gap_grace_seconds = EXCLUDED.gap_grace_seconds, gap_window = EXCLUDED.gap_window, \
             entity_version_fallback_from = EXCLUDED.entity_version_fallback_from, \
             version_tiebreak_from = EXCLUDED.version_tiebreak_from, \
             gap_event_types = EXCLUDED.gap_event_types, github_hook = EXCLUDED.github_hook, \
             github_app_id = EXCLUDED.github_app_id, updated_at = now()";
    let text = |l: &Option<FieldLocator>| l.as_ref().map(ToString::to_string);
    sqlx::query(SQL)
        .bind(source.source_id.as_str())
        .bind(source.tenant_id.as_str())
        .bind(source.scheme.as_str())
        .bind(&source.secret_ref)
        .bind(i32::try_from(source.tolerance.as_secs()).unwrap_or(i32::MAX))
        .bind(source.fields.external_id.to_string())
        .bind(source.fields.event_type.to_string())
        .bind(text(&source.fields.entity_id))
        .bind(text(&source.fields.entity_version))
        .bind(text(&source.fields.sequence))
        .bind(source.enabled)
        .bind(source.gaps.as_ref().map(|g| g.strategy.as_str()))
        .bind(source.gaps.as_ref().and_then(|g| match &g.strategy {
            GapStrategy::Sequence { id_template } => Some(id_template.as_str()),
            GapStrategy::ListApi | GapStrategy::GithubDeliveries { .. } => None,
        }))
        .bind(source.gaps.as_ref().map(|g| g.api_base_url.as_str()))
        .bind(source.gaps.as_ref().map(|g| g.api_secret_ref.as_str()))
        .bind(source.gaps.as_ref().map_or(600, |g| {
            i32::try_from(g.grace.as_secs()).unwrap_or(i32::MAX)
        }))
        .bind(source.gaps.as_ref().map_or(100_000, |g| g.window))
        .bind(text(&source.fields.entity_version_fallback))
        .bind(text(&source.fields.version_tiebreak))
        .bind(source.gaps.as_ref().and_then(|g| g.event_types.as_deref()))
        .bind(source.gaps.as_ref().and_then(|g| match &g.strategy {
            GapStrategy::GithubDeliveries { hook, .. } => Some(hook.as_str()),
            _ => None,
        }))
        .bind(source.gaps.as_ref().and_then(|g| match &g.strategy {
            GapStrategy::GithubDeliveries { app_id, .. } => app_id.as_deref(),
            _ => None,
        }))
        .execute(executor)
        .await?;
    Ok(())
}

/// Seconds since the oldest enabled source was created: how long the system has been expected
/// to run.
pub async fn oldest_age_seconds(executor: impl PgExecutor<'_>) -> Result<Option<f64>, StoreError> {
    const SQL: &str =
        "SELECT EXTRACT(EPOCH FROM now() - min(created_at))::float8 FROM sources WHERE enabled";
    Ok(sqlx::query_scalar(SQL).fetch_one(executor).await?)
}

/// Makes applies of sources take turns, for the rest of the caller's transaction; readers (the
/// ingest path) are not blocked.
pub async fn lock_for_apply(executor: impl PgExecutor<'_>) -> Result<(), StoreError> {
    sqlx::query("LOCK TABLE sources IN SHARE ROW EXCLUSIVE MODE")
        .execute(executor)
        .await?;
    Ok(())
}

/// Sequence sources of one tenant sharing an id template.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct SharedIdTemplate {
    pub tenant_id: String,
    pub id_template: String,
    pub source_ids: Vec<String>,
}

/// Every (tenant, id template) that more than one sequence source uses, enabled or not.
pub async fn shared_id_templates(
    executor: impl PgExecutor<'_>,
) -> Result<Vec<SharedIdTemplate>, StoreError> {
    const SQL: &str = "SELECT tenant_id, id_template, array_agg(source_id ORDER BY source_id) AS source_ids \
         FROM sources WHERE gap_strategy = 'sequence' \
         GROUP BY tenant_id, id_template HAVING count(*) > 1 ORDER BY tenant_id, id_template";
    Ok(sqlx::query_as(SQL).fetch_all(executor).await?)
}
