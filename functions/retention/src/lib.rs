//! The retention Lambda: a scheduled EventBridge event in, the purge counts out.

use aws_lambda_events::eventbridge::EventBridgeEvent;
use lambda_runtime::{Diagnostic, LambdaEvent};
use shared::retention::{self, RetentionOutcome, RetentionSettings};
use shared::store::PgPool;

pub async fn handler(
    _event: LambdaEvent<EventBridgeEvent>,
    pool: &PgPool,
    settings: &RetentionSettings,
) -> Result<RetentionOutcome, Diagnostic> {
    retention::run_once(pool, settings, "schedule")
        .await
        .map_err(|e| Diagnostic {
            error_type: e.diagnostic_type().into(),
            error_message: e.to_string(),
        })
}
