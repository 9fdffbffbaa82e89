//! The backfill Lambda: a scheduled EventBridge event in, the passes' counts out. Beside gap
//! detection and backfill, the same schedule (and the same egress to the providers) reads the
//! address ranges providers publish (`shared::address_ranges`), first: it is bounded (a few
//! requests), backfill may use the rest of the invocation.

use aws_lambda_events::eventbridge::EventBridgeEvent;
use lambda_runtime::{Diagnostic, LambdaEvent};
use serde::Serialize;
use shared::address_ranges::{RangeRefresher, RangesRun};
use shared::backfill::{BackfillRun, Backfiller};

/// What one invocation did.
#[derive(Debug, Serialize)]
pub struct Passes {
    pub address_ranges: RangesRun,
    pub backfill: BackfillRun,
}

/// Runs both passes, whatever the first gave; fails (with the first error) if either did.
pub async fn handler(
    _event: LambdaEvent<EventBridgeEvent>,
    backfiller: &Backfiller,
    ranges: &RangeRefresher,
) -> Result<Passes, Diagnostic> {
    let address_ranges = ranges.run_once("schedule").await;
    let backfill = backfiller.run_once("schedule").await;
    let diagnostic = |e: shared::store::StoreError| Diagnostic {
        error_type: e.diagnostic_type().into(),
        error_message: e.to_string(),
    };
    Ok(Passes {
        address_ranges: address_ranges.map_err(diagnostic)?,
        backfill: backfill.map_err(diagnostic)?,
    })
}
