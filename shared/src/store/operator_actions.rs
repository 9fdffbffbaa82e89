//! The `operator_actions` table: every state change an operator asked for (replay, a dead
//! letter's triage, tombstone, outbox resend and discard), with who asked, why, how the request
//! came in, what it asked for and what it touched.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use super::StoreError;

/// One action about to be recorded.
#[derive(Debug, Clone)]
pub struct NewAction<'a> {
    /// The operator request's action (`replay`, `tombstone`, ...).
    pub action: &'a str,
    /// Who the request says asked: a name the caller gives, not an identity anyone proved.
    pub actor: &'a str,
    pub reason: &'a str,
    /// `hookctl` (straight to the database), `function` (the operator Lambda) or
    /// `local_runner`.
    pub via: &'a str,
    /// What the runtime said about the invocation (the Lambda request id, the function, a
    /// Cognito identity when there is one); `{}` straight to the database.
    pub invocation: &'a serde_json::Value,
    /// What was asked: the filter, the ids, the status.
    pub request: &'a serde_json::Value,
    /// What it acted on: dead letter or outbox ids, or the tombstoned event id.
    pub affected: &'a serde_json::Value,
    /// What came of it, when the action reports more than what it touched (a replay's counts).
    pub outcome: Option<&'a serde_json::Value>,
    /// Whether it is finished when recorded (a replay records itself first, then finishes).
    pub finished: bool,
}

/// Records an action; in the action's own transaction where it has one. Returns its id.
pub async fn record(executor: impl PgExecutor<'_>, a: &NewAction<'_>) -> Result<i64, StoreError> {
    const SQL: &str = "INSERT INTO operator_actions \
             (action, actor, reason, via, invocation, request, affected, outcome, finished_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, CASE WHEN $9 THEN now() END) \
         RETURNING action_id";
    Ok(sqlx::query_scalar(SQL)
        .bind(a.action)
        .bind(a.actor)
        .bind(a.reason)
        .bind(a.via)
        .bind(a.invocation)
        .bind(a.request)
        .bind(a.affected)
        .bind(a.outcome)
        .bind(a.finished)
        .fetch_one(executor)
        .await?)
}

/// Closes an action recorded before it ran, with what came of it.
pub async fn finish(
    executor: impl PgExecutor<'_>,
    action_id: i64,
    outcome: &serde_json::Value,
) -> Result<(), StoreError> {
    const SQL: &str =
        "UPDATE operator_actions SET outcome = $2, finished_at = now() WHERE action_id = $1";
    sqlx::query(SQL)
        .bind(action_id)
        .bind(outcome)
        .execute(executor)
        .await?;
    Ok(())
}

/// Adds what a running action touched in one of its steps (a job's letters) to its record.
pub async fn add_affected(
    executor: impl PgExecutor<'_>,
    action_id: i64,
    affected: &serde_json::Value,
) -> Result<(), StoreError> {
    const SQL: &str =
        "UPDATE operator_actions SET affected = affected || $2::jsonb WHERE action_id = $1";
    sqlx::query(SQL)
        .bind(action_id)
        .bind(affected)
        .execute(executor)
        .await?;
    Ok(())
}

/// A recorded action, as `hookctl actions list` shows it.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct RecordedAction {
    pub action_id: i64,
    pub action: String,
    pub actor: String,
    pub reason: String,
    pub via: String,
    pub invocation: serde_json::Value,
    pub request: serde_json::Value,
    pub affected: serde_json::Value,
    pub outcome: Option<serde_json::Value>,
    pub requested_at: DateTime<Utc>,
    /// `None`: it started and never finished (a replay interrupted part-way).
    pub finished_at: Option<DateTime<Utc>>,
}

/// The latest actions, newest first.
pub async fn list(
    executor: impl PgExecutor<'_>,
    limit: i64,
) -> Result<Vec<RecordedAction>, StoreError> {
    const SQL: &str = "SELECT action_id, action, actor, reason, via, invocation, request, affected, outcome, \
                requested_at, finished_at \
         FROM operator_actions ORDER BY action_id DESC LIMIT $1";
    Ok(sqlx::query_as(SQL)
        .bind(limit.clamp(1, 100_000))
        .fetch_all(executor)
        .await?)
}
