//! The outbox Lambda: a scheduled EventBridge event in, a counted summary out.

use std::time::Duration;

use aws_lambda_events::eventbridge::EventBridgeEvent;
use lambda_runtime::{Diagnostic, LambdaEvent};
use shared::drain::stop_before;
use shared::outbox::{OutboxOutcome, OutboxSender};

/// Delivers until the invocation is `margin` from its deadline, waiting for new work when none
/// is due: started by its schedule, it stays in its minute, so a message the drain writes
/// meanwhile goes out within a poll (`OUTBOX_IDLE_POLL_MS`), not at the next schedule.
pub async fn handler(
    event: LambdaEvent<EventBridgeEvent>,
    sender: &OutboxSender,
    margin: Duration,
) -> Result<OutboxOutcome, Diagnostic> {
    let stop_at = stop_before(event.context.deadline(), margin);
    sender.stay_until(stop_at).await.map_err(|e| Diagnostic {
        error_type: e.diagnostic_type().into(),
        error_message: e.to_string(),
    })
}
