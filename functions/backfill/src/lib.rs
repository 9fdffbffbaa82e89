//! The backfill Lambda: a scheduled EventBridge event in, the pass's counts out.

use aws_lambda_events::eventbridge::EventBridgeEvent;
use lambda_runtime::{Diagnostic, LambdaEvent};
use shared::backfill::{BackfillRun, Backfiller};

pub async fn handler(
    _event: LambdaEvent<EventBridgeEvent>,
    backfiller: &Backfiller,
) -> Result<BackfillRun, Diagnostic> {
    backfiller
        .run_once("schedule")
        .await
        .map_err(|e| Diagnostic {
            error_type: e.diagnostic_type().into(),
            error_message: e.to_string(),
        })
}
