//! Operator actions, one JSON shape for every entry point: the `operator` Lambda, the local
//! runner's `POST /operator`, and `hookctl operator`.
//!
//! ```json
//! {"action": "replay", "filter": {"event_type": "payment_intent.succeeded", "error_contains": "timeout"}}
//! {"action": "list_dead_letters", "filter": {"tenant_id": "acme"}}
//! {"action": "set_dead_letter_status", "dead_letter_id": 7, "status": "investigating"}
//! {"action": "tombstone", "tenant_id": "acme", "source_id": "stripe-prod", "external_id": "evt_1",
//!  "reason": "test event deleted in the dashboard", "operator": "alice"}
//! ```

use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::drain::{self, ReplayOutcome};
use crate::effects::EffectRegistry;
use crate::sources::GapStrategy;
use crate::store::StoreError;
use crate::store::dead_letters::{self, DeadLetter, ReplayFilter};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "action", rename_all = "snake_case", deny_unknown_fields)]
pub enum OperatorRequest {
    /// Replay open dead letters matching the filter through the normal processing path.
    Replay {
        #[serde(default)]
        filter: ReplayFilter,
    },
    /// List open dead letters matching the filter.
    ListDeadLetters {
        #[serde(default)]
        filter: ReplayFilter,
    },
    /// Triage: `investigating` or `discarded`.
    SetDeadLetterStatus { dead_letter_id: i64, status: String },
    /// Declares an event ID that will never arrive: gap detection stops flagging it. On a
    /// source whose gaps are found by sequence, the sequence is read from the ID with the
    /// source's id template (a given one must agree).
    Tombstone {
        tenant_id: String,
        source_id: String,
        external_id: String,
        #[serde(default)]
        sequence: Option<i64>,
        reason: String,
        operator: String,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("invalid request: {0}")]
    BadRequest(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum OperatorResponse {
    Replay(ReplayOutcome),
    DeadLetters { dead_letters: Vec<DeadLetter> },
    StatusChanged { dead_letter_id: i64, status: String },
    Tombstoned { external_id: String, created: bool },
}

/// Parses a request from JSON, saying what is wrong with it when it does not parse.
pub fn parse(json: serde_json::Value) -> Result<OperatorRequest, OperatorError> {
    serde_json::from_value(json).map_err(|e| OperatorError::BadRequest(e.to_string()))
}

#[tracing::instrument(skip_all, err)]
pub async fn handle(
    pool: &PgPool,
    registry: &EffectRegistry,
    request: OperatorRequest,
) -> Result<OperatorResponse, OperatorError> {
    match request {
        OperatorRequest::Replay { filter } => Ok(OperatorResponse::Replay(
            drain::replay(pool, registry, &filter).await?,
        )),
        OperatorRequest::ListDeadLetters { filter } => {
            let dead_letters = dead_letters::select_open(pool, &filter).await?;
            Ok(OperatorResponse::DeadLetters { dead_letters })
        }
        OperatorRequest::SetDeadLetterStatus {
            dead_letter_id,
            status,
        } => {
            if !matches!(status.as_str(), "investigating" | "discarded") {
                return Err(OperatorError::BadRequest(format!(
                    "status {status:?}: an operator sets investigating or discarded; replayed is set by a successful replay"
                )));
            }
            if !dead_letters::set_status(pool, dead_letter_id, &status).await? {
                return Err(OperatorError::BadRequest(format!(
                    "dead letter {dead_letter_id} is not open"
                )));
            }
            Ok(OperatorResponse::StatusChanged {
                dead_letter_id,
                status,
            })
        }
        OperatorRequest::Tombstone {
            tenant_id,
            source_id,
            external_id,
            sequence,
            reason,
            operator,
        } => {
            if reason.trim().is_empty() || operator.trim().is_empty() {
                return Err(OperatorError::BadRequest(
                    "a tombstone needs a reason and the operator's name".into(),
                ));
            }
            let sequence =
                tombstone_sequence(pool, &tenant_id, &source_id, &external_id, sequence).await?;
            let by = format!("operator:{operator}");
            let created = crate::store::gaps::tombstone(
                pool,
                &tenant_id,
                &source_id,
                &external_id,
                sequence,
                &reason,
                &by,
            )
            .await?;
            Ok(OperatorResponse::Tombstoned {
                external_id,
                created,
            })
        }
    }
}

/// The sequence number a tombstone fills. On a source whose gaps are found by sequence, it is
/// the number the ID stands for under the source's id template (a given `sequence` must agree):
/// a tombstone without one would leave its gap open and the watermark pinned below it forever.
/// Elsewhere it is whatever was given.
async fn tombstone_sequence(
    pool: &PgPool,
    tenant_id: &str,
    source_id: &str,
    external_id: &str,
    given: Option<i64>,
) -> Result<Option<i64>, OperatorError> {
    let id = crate::domain::SourceId::parse(source_id)
        .map_err(|_| OperatorError::BadRequest(format!("no source {source_id:?}")))?;
    let source = crate::store::sources::find(pool, &id)
        .await?
        .ok_or_else(|| OperatorError::BadRequest(format!("no source {source_id:?}")))?;
    if source.tenant_id.as_str() != tenant_id {
        return Err(OperatorError::BadRequest(format!(
            "source {source_id:?} does not belong to tenant {tenant_id:?}"
        )));
    }
    let Some(GapStrategy::Sequence { id_template }) = source.gaps.map(|g| g.strategy) else {
        return Ok(given);
    };
    match (
        crate::sources::sequence_of_id(&id_template, external_id),
        given,
    ) {
        (Some(n), None) => Ok(Some(n)),
        (Some(n), Some(g)) if n == g => Ok(Some(n)),
        (Some(n), Some(g)) => Err(OperatorError::BadRequest(format!(
            "{external_id:?} is sequence {n} under the source's id template {id_template:?}, not {g}"
        ))),
        (None, _) => Err(OperatorError::BadRequest(format!(
            "{external_id:?} does not follow the source's id template {id_template:?}: gap detection could never place it"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_from_the_documented_json() {
        let r = parse(serde_json::json!({"action": "replay", "filter": {"ids": [1, 2], "error_contains": "timeout"}})).unwrap();
        assert!(matches!(r, OperatorRequest::Replay { filter } if filter.ids == [1, 2]));
        assert!(matches!(
            parse(serde_json::json!({"action": "replay"})).unwrap(),
            OperatorRequest::Replay { .. }
        ));
        let err = parse(serde_json::json!({"action": "replay", "filter": {"typo": 1}}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("typo"), "{err}");
        assert!(parse(serde_json::json!({"action": "drop_tables"})).is_err());
    }
}
