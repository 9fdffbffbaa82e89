//! The drain Lambda: a scheduled EventBridge event in, a counted summary out. The work is
//! `shared::drain`; this adapter turns the invocation's deadline into the drain's.

use std::time::Duration;

use aws_lambda_events::eventbridge::EventBridgeEvent;
use lambda_runtime::{Diagnostic, LambdaEvent};
use shared::drain::{DrainOutcome, Drainer, stop_before};

/// Drains until the invocation is `margin` from its deadline, waiting for new work when
/// nothing is ready: started by its schedule, it stays in its minute, so an event ingest
/// commits meanwhile is processed within a poll (`DRAIN_IDLE_POLL_MS`), not at the next
/// schedule.
pub async fn handler(
    event: LambdaEvent<EventBridgeEvent>,
    drainer: &Drainer,
    margin: Duration,
) -> Result<DrainOutcome, Diagnostic> {
    let stop_at = stop_before(event.context.deadline(), margin);
    drainer.stay_until(stop_at).await.map_err(|e| Diagnostic {
        error_type: e.diagnostic_type().into(),
        error_message: e.to_string(),
    })
}
