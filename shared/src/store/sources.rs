//! The `sources` table.

use sqlx::PgExecutor;

use super::StoreError;

/// A `sources` row, column for column: `crate::sources` turns it into a `Source` and back.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct SourceRow {
    pub source_id: String,
    pub tenant_id: String,
    pub scheme: String,
    pub secret_ref: String,
    pub tolerance_seconds: i32,
    pub external_id_from: String,
    pub event_type_from: String,
    pub entity_id_from: Option<String>,
    pub entity_version_from: Option<String>,
    pub entity_version_fallback_from: Option<String>,
    pub version_tiebreak_from: Option<String>,
    pub sequence_from: Option<String>,
    pub enabled: bool,
    pub gap_strategy: Option<String>,
    pub id_template: Option<String>,
    pub api_base_url: Option<String>,
    pub api_secret_ref: Option<String>,
    pub gap_grace_seconds: i32,
    pub gap_window: i64,
    pub gap_event_types: Option<Vec<String>>,
    pub github_hook: Option<String>,
    pub github_app_id: Option<String>,
    pub signed_url: Option<String>,
    pub declared_signature: Option<serde_json::Value>,
    pub accepted_layouts: Option<Vec<String>>,
    pub json_form_field: Option<String>,
    pub elements_from: Option<String>,
    pub address_check: Option<String>,
    pub partner: Option<serde_json::Value>,
}

macro_rules! source_columns {
    () => {
        "source_id, tenant_id, scheme, secret_ref, tolerance_seconds, external_id_from, \
         event_type_from, entity_id_from, entity_version_from, sequence_from, enabled, \
         gap_strategy, id_template, api_base_url, api_secret_ref, gap_grace_seconds, gap_window, \
         entity_version_fallback_from, version_tiebreak_from, gap_event_types, github_hook, github_app_id, \
         signed_url, declared_signature, accepted_layouts, json_form_field, elements_from, \
         address_check, partner"
    };
}

/// The source with this id, enabled or not.
#[tracing::instrument(skip_all, fields(source_id = %id), err)]
pub async fn find(
    executor: impl PgExecutor<'_>,
    id: &str,
) -> Result<Option<SourceRow>, StoreError> {
    const SQL: &str = concat!(
        "SELECT ",
        source_columns!(),
        " FROM sources WHERE source_id = $1"
    );
    Ok(sqlx::query_as(SQL)
        .bind(id)
        .fetch_optional(executor)
        .await?)
}

/// Every source, by id.
pub async fn list(executor: impl PgExecutor<'_>) -> Result<Vec<SourceRow>, StoreError> {
    const SQL: &str = concat!(
        "SELECT ",
        source_columns!(),
        " FROM sources ORDER BY source_id"
    );
    Ok(sqlx::query_as(SQL).fetch_all(executor).await?)
}

/// Inserts the source, or updates it in place when the id exists.
#[tracing::instrument(skip_all, fields(source_id = %row.source_id), err)]
pub async fn upsert(executor: impl PgExecutor<'_>, row: &SourceRow) -> Result<(), StoreError> {
    const SQL: &str = "INSERT INTO sources (source_id, tenant_id, scheme, secret_ref, tolerance_seconds, \
             external_id_from, event_type_from, entity_id_from, entity_version_from, sequence_from, enabled, \
             gap_strategy, id_template, api_base_url, api_secret_ref, gap_grace_seconds, gap_window, \
             entity_version_fallback_from, version_tiebreak_from, gap_event_types, github_hook, github_app_id, signed_url, declared_signature, \
             accepted_layouts, json_form_field, elements_from, address_check, partner) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29) \
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
             github_app_id = EXCLUDED.github_app_id, signed_url = EXCLUDED.signed_url, \
             declared_signature = EXCLUDED.declared_signature, accepted_layouts = EXCLUDED.accepted_layouts, \
             json_form_field = EXCLUDED.json_form_field, elements_from = EXCLUDED.elements_from, \
             address_check = EXCLUDED.address_check, partner = EXCLUDED.partner, updated_at = now()";
    sqlx::query(SQL)
        .bind(&row.source_id)
        .bind(&row.tenant_id)
        .bind(&row.scheme)
        .bind(&row.secret_ref)
        .bind(row.tolerance_seconds)
        .bind(&row.external_id_from)
        .bind(&row.event_type_from)
        .bind(&row.entity_id_from)
        .bind(&row.entity_version_from)
        .bind(&row.sequence_from)
        .bind(row.enabled)
        .bind(&row.gap_strategy)
        .bind(&row.id_template)
        .bind(&row.api_base_url)
        .bind(&row.api_secret_ref)
        .bind(row.gap_grace_seconds)
        .bind(row.gap_window)
        .bind(&row.entity_version_fallback_from)
        .bind(&row.version_tiebreak_from)
        .bind(&row.gap_event_types)
        .bind(&row.github_hook)
        .bind(&row.github_app_id)
        .bind(&row.signed_url)
        .bind(&row.declared_signature)
        .bind(&row.accepted_layouts)
        .bind(&row.json_form_field)
        .bind(&row.elements_from)
        .bind(&row.address_check)
        .bind(&row.partner)
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

/// How a source reads its event ids, when it has stored events under them (`None`: a new
/// source, or one with no events): the id's locator, and where the elements it reads are in a
/// batched delivery (`None`: a delivery is one event). One index probe
/// (`source_id, first_received_at`).
pub async fn event_id_locator_in_use(
    executor: impl PgExecutor<'_>,
    source_id: &str,
) -> Result<Option<(String, Option<String>)>, StoreError> {
    const SQL: &str = "SELECT s.external_id_from, s.elements_from FROM sources AS s \
         WHERE s.source_id = $1 \
           AND EXISTS (SELECT 1 FROM webhook_events AS e WHERE e.source_id = s.source_id)";
    Ok(sqlx::query_as(SQL)
        .bind(source_id)
        .fetch_optional(executor)
        .await?)
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
