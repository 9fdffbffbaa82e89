//! The reconcile Lambda, triggered two ways: an EventBridge schedule, and an SNS notification
//! carrying a CloudWatch alarm (the anomaly alarms invoke it). Both run the same pass; a
//! trigger that finds a pass running returns `skipped` at once.

use aws_lambda_events::eventbridge::EventBridgeEvent;
use aws_lambda_events::sns::SnsEvent;
use lambda_runtime::{Diagnostic, LambdaEvent};
use shared::drain::Drainer;
use shared::reconcile::{self, ReconcileOutcome, ReconcileSettings};
use shared::store::PgPool;

/// What started the pass: `schedule`, or `alarm:<AlarmName>` for each alarm in the message.
pub fn trigger_of(payload: &serde_json::Value) -> Result<String, Diagnostic> {
    if payload.get("Records").is_some() {
        let sns: SnsEvent = serde_json::from_value(payload.clone()).map_err(bad_event)?;
        let names: Vec<String> = sns
            .records
            .iter()
            .map(|r| {
                serde_json::from_str::<serde_json::Value>(&r.sns.message)
                    .ok()
                    .and_then(|m| m["AlarmName"].as_str().map(str::to_owned))
                    .unwrap_or_else(|| r.sns.topic_arn.clone())
            })
            .collect();
        return Ok(format!("alarm:{}", names.join(",")));
    }
    let _schedule: EventBridgeEvent = serde_json::from_value(payload.clone()).map_err(bad_event)?;
    Ok("schedule".into())
}

fn bad_event(e: serde_json::Error) -> Diagnostic {
    Diagnostic {
        error_type: "UnrecognisedTrigger".into(),
        error_message: e.to_string(),
    }
}

pub async fn handler(
    event: LambdaEvent<serde_json::Value>,
    pool: &PgPool,
    drainer: &Drainer,
    settings: &ReconcileSettings,
) -> Result<ReconcileOutcome, Diagnostic> {
    let trigger = trigger_of(&event.payload)?;
    reconcile::run_once(pool, drainer, settings, &trigger)
        .await
        .map_err(|e| Diagnostic {
            error_type: e.diagnostic_type().into(),
            error_message: e.to_string(),
        })
}
