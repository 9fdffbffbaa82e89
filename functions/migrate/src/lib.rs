//! The migrate Lambda. As a CloudFormation custom resource it applies the migrations on Create
//! and Update (Delete leaves the schema alone) and answers CloudFormation's pre-signed URL;
//! invoked by hand with any other payload (`{}`), it applies them and returns the version.
//! Applying is idempotent: sqlx records what ran in `_sqlx_migrations`.

use aws_lambda_events::cloudformation::{
    CloudFormationCustomResourceRequest, CloudFormationCustomResourceResponse,
    CloudFormationCustomResourceResponseStatus,
};
use lambda_runtime::{Diagnostic, LambdaEvent};
use shared::store::{MIGRATOR, PgPool};

/// The physical id of the one schema a stack owns: stable, so updates never replace it.
pub const PHYSICAL_ID: &str = "schema-migrations";

pub async fn handler(
    event: LambdaEvent<serde_json::Value>,
    pool: &PgPool,
    http: &reqwest::Client,
) -> Result<serde_json::Value, Diagnostic> {
    let Ok(request) =
        serde_json::from_value::<CloudFormationCustomResourceRequest>(event.payload.clone())
    else {
        let version = migrate(pool).await.map_err(|e| Diagnostic {
            error_type: "MigrationFailed".into(),
            error_message: e,
        })?;
        return Ok(serde_json::json!({ "schema_version": version }));
    };
    let (url, stack_id, request_id, logical_id, result) = match request {
        CloudFormationCustomResourceRequest::Create(r) => (
            r.response_url,
            r.stack_id,
            r.request_id,
            r.logical_resource_id,
            migrate(pool).await,
        ),
        CloudFormationCustomResourceRequest::Update(r) => (
            r.response_url,
            r.stack_id,
            r.request_id,
            r.logical_resource_id,
            migrate(pool).await,
        ),
        CloudFormationCustomResourceRequest::Delete(r) => (
            r.response_url,
            r.stack_id,
            r.request_id,
            r.logical_resource_id,
            Ok("left in place".into()),
        ),
        _ => {
            return Err(Diagnostic {
                error_type: "UnknownRequest".into(),
                error_message: "unknown custom resource request".into(),
            });
        }
    };
    let mut response = CloudFormationCustomResourceResponse::default();
    response.physical_resource_id = PHYSICAL_ID.into();
    response.stack_id = stack_id;
    response.request_id = request_id;
    response.logical_resource_id = logical_id;
    match &result {
        Ok(version) => {
            response.status = CloudFormationCustomResourceResponseStatus::Success;
            response
                .data
                .insert("SchemaVersion".into(), version.clone());
        }
        Err(why) => {
            response.status = CloudFormationCustomResourceResponseStatus::Failed;
            response.reason = Some(format!("migrations failed: {why}"));
        }
    }
    // The pre-signed URL signs an empty content type.
    let sent = http
        .put(&url)
        .header("content-type", "")
        .body(serde_json::to_vec(&response).expect("response serializes"))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status);
    if let Err(e) = sent {
        // CloudFormation waits for this answer: a lost one stalls the stack for an hour.
        tracing::error!(error = %e, "could not answer CloudFormation");
        return Err(Diagnostic {
            error_type: "ResponseFailed".into(),
            error_message: e.to_string(),
        });
    }
    Ok(serde_json::to_value(&response).unwrap_or_default())
}

/// Applies pending migrations; returns the newest version applied.
pub async fn migrate(pool: &PgPool) -> Result<String, String> {
    MIGRATOR.run(pool).await.map_err(|e| e.to_string())?;
    let version = MIGRATOR.iter().map(|m| m.version).max().unwrap_or_default();
    tracing::info!(version, "schema is up to date");
    Ok(version.to_string())
}
