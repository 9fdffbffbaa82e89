//! The migrate Lambda. As a CloudFormation custom resource it applies the migrations on Create
//! and Update and answers CloudFormation's pre-signed URL on every path; invoked by hand with
//! any other payload (`{}`), it applies them and returns the version. Applying is idempotent:
//! sqlx records what ran in `_sqlx_migrations`. A Create or Update whose `SchemaVersion` is newer
//! than the newest migration this build holds is answered FAILED, with nothing applied: the
//! function was built before those migrations existed.
//!
//! CloudFormation waits for the answer (up to the resource's `ServiceTimeout`), and a stack
//! that gets none hangs, then hangs again rolling back. So nothing fallible is built at init:
//! settings, the database secret and the connection are read inside Create/Update, under the
//! invocation's deadline less a margin, and whatever goes wrong becomes a FAILED answer with
//! its reason. Delete answers SUCCESS without touching secrets or the database.

use std::time::{Duration, Instant};

use aws_lambda_events::cloudformation::{
    CloudFormationCustomResourceRequest, CloudFormationCustomResourceResponse,
    CloudFormationCustomResourceResponseStatus,
};
use lambda_runtime::{Diagnostic, LambdaEvent};
use shared::config::Vars;
use shared::drain::stop_before;
use shared::schema::{self, MigrateError};

/// The physical id of the one schema a stack owns: stable, so updates never replace it.
pub const PHYSICAL_ID: &str = "schema-migrations";

/// Time kept back from the invocation's deadline to send the answer.
pub const ANSWER_MARGIN: Duration = Duration::from_secs(10);

/// CloudFormation refuses answers over 4096 bytes; the reason is cut well below that.
const MAX_REASON_CHARS: usize = 1500;

pub async fn handler<F: Fn(&str) -> Option<String>>(
    event: LambdaEvent<serde_json::Value>,
    vars: &Vars<F>,
) -> Result<serde_json::Value, Diagnostic> {
    let stop_at = stop_before(event.context.deadline(), ANSWER_MARGIN);
    let Ok(request) =
        serde_json::from_value::<CloudFormationCustomResourceRequest>(event.payload.clone())
    else {
        // Invoked by hand.
        let version = schema::bring_up_to_date(vars, stop_at)
            .await
            .map_err(|e| Diagnostic {
                error_type: e.diagnostic_type().into(),
                error_message: e.to_string(),
            })?;
        return Ok(serde_json::json!({ "schema_version": version.to_string() }));
    };
    let (url, stack_id, request_id, logical_id, result) = match request {
        CloudFormationCustomResourceRequest::Create(r) => (
            r.response_url,
            r.stack_id,
            r.request_id,
            r.logical_resource_id,
            apply(vars, &r.resource_properties, stop_at).await,
        ),
        CloudFormationCustomResourceRequest::Update(r) => (
            r.response_url,
            r.stack_id,
            r.request_id,
            r.logical_resource_id,
            apply(vars, &r.resource_properties, stop_at).await,
        ),
        // The schema outlives the stack's resource: deleting the stack (or rolling back a
        // failed create) must never wait on, or fail for, the database.
        CloudFormationCustomResourceRequest::Delete(r) => (
            r.response_url,
            r.stack_id,
            r.request_id,
            r.logical_resource_id,
            Ok(None),
        ),
        _ => {
            return Err(Diagnostic {
                error_type: "UnknownRequest".into(),
                error_message: "unknown custom resource request type".into(),
            });
        }
    };
    let response = answer(stack_id, request_id, logical_id, &result);
    match &result {
        Ok(_) => tracing::info!(status = "SUCCESS", "answering CloudFormation"),
        Err(e) => tracing::error!(status = "FAILED", error = %e, "answering CloudFormation"),
    }
    if let Err(e) = send(&url, &response, stop_at).await {
        // Reported as an error so Lambda retries the invocation (migrating is idempotent) and
        // the migrate-errors alarm pages: CloudFormation is still waiting.
        tracing::error!(error = %e, "could not answer CloudFormation");
        return Err(Diagnostic {
            error_type: "ResponseFailed".into(),
            error_message: e,
        });
    }
    serde_json::to_value(&response).map_err(|e| Diagnostic {
        error_type: "ResponseFailed".into(),
        error_message: e.to_string(),
    })
}

/// Applies the migrations a Create or Update asks for, once this build is known to hold them.
async fn apply<F: Fn(&str) -> Option<String>>(
    vars: &Vars<F>,
    properties: &serde_json::Value,
    stop_at: Instant,
) -> Result<Option<i64>, MigrateError> {
    schema::check_requested(properties.get("SchemaVersion"))?;
    schema::bring_up_to_date(vars, stop_at).await.map(Some)
}

fn answer(
    stack_id: String,
    request_id: String,
    logical_id: String,
    // The version applied; `None` when the schema was left alone (Delete).
    result: &Result<Option<i64>, MigrateError>,
) -> CloudFormationCustomResourceResponse {
    let mut response = CloudFormationCustomResourceResponse::default();
    response.physical_resource_id = PHYSICAL_ID.into();
    response.stack_id = stack_id;
    response.request_id = request_id;
    response.logical_resource_id = logical_id;
    match result {
        Ok(version) => {
            response.status = CloudFormationCustomResourceResponseStatus::Success;
            if let Some(version) = version {
                response
                    .data
                    .insert("SchemaVersion".into(), version.to_string());
            }
        }
        Err(why) => {
            response.status = CloudFormationCustomResourceResponseStatus::Failed;
            let reason: String = format!("migrations not applied: {why}")
                .chars()
                .take(MAX_REASON_CHARS)
                .collect();
            response.reason = Some(reason);
        }
    }
    response
}

/// PUTs the answer to the pre-signed URL, within what is left of the invocation.
async fn send(
    url: &str,
    response: &CloudFormationCustomResourceResponse,
    stop_at: Instant,
) -> Result<(), String> {
    let body = serde_json::to_vec(response).map_err(|e| e.to_string())?;
    // Whatever the migration left of the budget, plus the margin kept for this.
    let timeout = stop_at.saturating_duration_since(Instant::now()) + ANSWER_MARGIN;
    let http = reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .map_err(|e| format!("building the HTTP client: {e}"))?;
    // The pre-signed URL signs an empty content type.
    http.put(url)
        .header("content-type", "")
        .body(body)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map(drop)
        .map_err(|e| e.to_string())
}
