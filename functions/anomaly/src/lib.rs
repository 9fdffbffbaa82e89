//! The anomaly Lambda: a scheduled EventBridge event in, the run's report out.

use aws_lambda_events::eventbridge::EventBridgeEvent;
use lambda_runtime::{Diagnostic, LambdaEvent};
use shared::anomaly::{self, AnomalyReport, AnomalySettings};
use shared::buffer::BufferQueue;
use shared::store::PgPool;

/// One scheduled run, beside the SQS buffer when the stack has one.
pub async fn handler(
    _event: LambdaEvent<EventBridgeEvent>,
    pool: &PgPool,
    settings: &AnomalySettings,
    buffer: Option<&BufferQueue>,
) -> Result<AnomalyReport, Diagnostic> {
    // Boxed: the run's future is deep enough to overflow the compiler's layout depth inline.
    Box::pin(anomaly::run_once_with_buffer(
        pool, settings, "schedule", buffer,
    ))
    .await
    .map_err(|e| Diagnostic {
        error_type: e.diagnostic_type().into(),
        error_message: e.to_string(),
    })
}
