//! The operator Lambda: invoked directly (`hookctl --function`, or `aws lambda invoke`) with
//! the JSON of `shared::operator::OperatorRequest`, answers with the status report, its counts
//! or a listing. The database sits in private subnets: this is the operator's way in.

use lambda_runtime::{Context, Diagnostic, LambdaEvent};
use shared::buffer::BufferQueue;
use shared::effects::EffectRegistry;
use shared::operator::{self, Invocation, OperatorError, OperatorResponse, Via};
use shared::store::PgPool;

pub async fn handler(
    event: LambdaEvent<serde_json::Value>,
    pool: &PgPool,
    registry: &EffectRegistry,
    buffer: Option<&BufferQueue>,
) -> Result<OperatorResponse, Diagnostic> {
    let request = operator::parse(event.payload).map_err(diagnostic)?;
    let invocation = Invocation {
        via: Via::Function,
        context: invocation_context(&event.context),
    };
    // Boxed: the replay path's future is deep enough to overflow the compiler's layout query
    // depth in `main` (seen in the release build).
    Box::pin(operator::handle_invoked(
        pool,
        registry,
        buffer,
        request,
        &invocation,
    ))
    .await
    .map_err(diagnostic)
}

/// What Lambda tells the function about an invocation, recorded with each state change: the
/// request id (to find the caller in CloudTrail's Lambda data events, when the trail records
/// them), the function ARN, the X-Ray trace, and the Cognito identity or mobile client context
/// when the caller had them. Lambda does not pass an IAM caller's identity to the function.
pub fn invocation_context(context: &Context) -> serde_json::Value {
    let mut recorded = serde_json::json!({
        "request_id": context.request_id,
        "invoked_function_arn": context.invoked_function_arn,
    });
    if let Some(trace) = &context.xray_trace_id {
        recorded["xray_trace_id"] = trace.as_str().into();
    }
    if let Some(identity) = &context.identity {
        recorded["cognito_identity"] = serde_json::to_value(identity).unwrap_or_default();
    }
    if let Some(client) = &context.client_context {
        recorded["client_context"] = serde_json::to_value(client).unwrap_or_default();
    }
    recorded
}

fn diagnostic(error: OperatorError) -> Diagnostic {
    let error_type = match &error {
        OperatorError::BadRequest(_) => "BadRequest",
        OperatorError::Store(e) => e.diagnostic_type(),
        OperatorError::Buffer(_) => "BufferUnavailable",
    };
    Diagnostic {
        error_type: error_type.into(),
        error_message: error.to_string(),
    }
}
