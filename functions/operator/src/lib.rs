//! The operator Lambda: invoked directly (`hookctl --function`, or `aws lambda invoke`) with
//! the JSON of `shared::operator::OperatorRequest`, answers with the status report, its counts
//! or a listing. The database sits in private subnets: this is the operator's way in.

use lambda_runtime::{Diagnostic, LambdaEvent};
use shared::effects::EffectRegistry;
use shared::operator::{self, OperatorError, OperatorResponse};
use shared::store::PgPool;

pub async fn handler(
    event: LambdaEvent<serde_json::Value>,
    pool: &PgPool,
    registry: &EffectRegistry,
) -> Result<OperatorResponse, Diagnostic> {
    let request = operator::parse(event.payload).map_err(diagnostic)?;
    // Boxed: the replay path's future is deep enough to overflow the compiler's layout query
    // depth in `main` (seen in the release build).
    Box::pin(operator::handle(pool, registry, request))
        .await
        .map_err(diagnostic)
}

fn diagnostic(error: OperatorError) -> Diagnostic {
    let error_type = match &error {
        OperatorError::BadRequest(_) => "BadRequest",
        OperatorError::Store(e) => e.diagnostic_type(),
    };
    Diagnostic {
        error_type: error_type.into(),
        error_message: error.to_string(),
    }
}
