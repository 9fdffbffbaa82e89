//! The anomaly Lambda: a scheduled EventBridge event in, the run's report out.

use aws_lambda_events::eventbridge::EventBridgeEvent;
use lambda_runtime::{Diagnostic, LambdaEvent};
use shared::anomaly::{self, AnomalyReport, AnomalySettings};
use shared::store::PgPool;

pub async fn handler(
    _event: LambdaEvent<EventBridgeEvent>,
    pool: &PgPool,
    settings: &AnomalySettings,
) -> Result<AnomalyReport, Diagnostic> {
    anomaly::run_once(pool, settings, "schedule")
        .await
        .map_err(|e| Diagnostic {
            error_type: e.diagnostic_type().into(),
            error_message: e.to_string(),
        })
}
