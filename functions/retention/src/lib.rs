//! The retention Lambda: a scheduled EventBridge event in, the purge counts out. The work is
//! `shared::retention`; this adapter turns the invocation's deadline into the pass's.

use std::time::Duration;

use aws_lambda_events::eventbridge::EventBridgeEvent;
use lambda_runtime::{Diagnostic, LambdaEvent};
use shared::drain::stop_before;
use shared::retention::{self, RetentionOutcome, RetentionSettings};
use shared::store::PgPool;

/// Purges until nothing is past its horizons or the invocation is `margin` from its deadline.
pub async fn handler(
    event: LambdaEvent<EventBridgeEvent>,
    pool: &PgPool,
    settings: &RetentionSettings,
    margin: Duration,
) -> Result<RetentionOutcome, Diagnostic> {
    let stop_at = stop_before(event.context.deadline(), margin);
    retention::run_until(pool, settings, "schedule", stop_at)
        .await
        .map_err(|e| Diagnostic {
            error_type: e.diagnostic_type().into(),
            error_message: e.to_string(),
        })
}
