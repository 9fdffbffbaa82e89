//! What became of one event, for an operator reading its page (the console, `event_history`):
//! the stored row beyond what a subscriber fetches, its place in the queue, its outbox messages
//! and where each went, its dead letters and replays, and the anomalies it raised. Every read
//! is by the event's key, through an index that starts with it.

use super::StoreError;

/// The stored row's own account: how it was verified and filed, and where processing stands.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct Filing {
    /// The headers kept beside the payload (never a signature's secret).
    pub headers: serde_json::Value,
    /// Which signing secret verified the stored payload: `current` or `previous`.
    pub verified_with: String,
    /// SHA-256 of the stored payload (of its steady part for a provider with volatile
    /// fields), hex.
    pub payload_sha256: String,
    /// The digest of the payload a conflicting delivery replaced, hex.
    pub superseded_sha256: Option<String>,
    pub last_delivery_outcome: String,
    /// When the stored payload arrived (a conflict that replaced it moves it).
    pub received_at: chrono::DateTime<chrono::Utc>,
    /// Its id came from outside the signature (a header), so its body is stored once only.
    pub id_outside_signature: bool,
    /// Processing tries so far, and the last one's error.
    pub attempts: i32,
    pub last_error: Option<String>,
    pub provider_sequence: Option<i64>,
    /// The source's scheme (its provider, or `declared`), and the name of the provider's
    /// layout that verified the stored payload when the provider has several (`None`: its only
    /// layout, or stored before layouts were recorded).
    pub scheme: String,
    pub verified_layout: Option<String>,
    /// How many of its deliveries came through the SQS buffer (`None`: none recorded).
    pub buffered_deliveries: Option<i32>,
    /// The entity it names, and the version it carries.
    pub entity_id: Option<String>,
    pub entity_version: Option<i64>,
    pub event_type: String,
}

/// The event waiting in the queue.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct Queued {
    pub enqueued_at: chrono::DateTime<chrono::Utc>,
    /// When the drain may next claim it.
    pub ready_at: chrono::DateTime<chrono::Utc>,
}

/// One outbox message the event's processing wrote, and where it was sent.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct Message {
    pub outbox_id: i64,
    pub action: String,
    pub status: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub delivered_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Where it went (or was last tried): `http https://…`, `sqs …`; none before a try.
    pub destination: Option<String>,
    pub tried_at: Option<chrono::DateTime<chrono::Utc>>,
    /// An `entity.changed` message's payload: the entity's version before and after the event.
    pub change: Option<serde_json::Value>,
}

/// A dead letter of the event, open or closed.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct Letter {
    pub dead_letter_id: i64,
    pub status: String,
    pub reason: String,
    pub error: String,
    pub attempts: i32,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub replay_count: i32,
    pub replayed_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// An anomaly the event raised at ingest (a digest conflict, a replayed body, ...).
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct Anomaly {
    pub detected_at: chrono::DateTime<chrono::Utc>,
    pub kind: String,
    pub detail: String,
    /// The delivery's digest, and the stored one's at the time, hex.
    pub payload_sha256: String,
    pub stored_sha256: Option<String>,
    pub payload_replaced: Option<bool>,
}

/// Everything [`of`] reads.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct EventHistory {
    pub filing: Filing,
    /// The entity the event names, as projected now (`None`: it names none, or the projection
    /// holds no such entity). Read by the caller, which knows the entity's type
    /// ([`super::entities::current`]).
    #[serde(default)]
    pub entity: Option<super::entities::Entity>,
    pub queued: Option<Queued>,
    pub outbox: Vec<Message>,
    pub dead_letters: Vec<Letter>,
    pub anomalies: Vec<Anomaly>,
}

/// The history of the event `(tenant_id, external_id)`; `None` when no such event is stored.
pub async fn of(
    conn: &mut sqlx::PgConnection,
    tenant_id: &str,
    external_id: &str,
) -> Result<Option<EventHistory>, StoreError> {
    const FILING: &str = "SELECT e.headers, e.verified_with, encode(e.payload_sha256, 'hex') AS payload_sha256, \
             encode(e.superseded_sha256, 'hex') AS superseded_sha256, e.last_delivery_outcome, e.received_at, \
             e.id_outside_signature, e.attempts, e.last_error, e.provider_sequence, s.scheme, \
             f.verified_layout, NULLIF(f.buffered_deliveries, 0) AS buffered_deliveries, e.entity_id, e.entity_version, e.event_type \
         FROM webhook_events AS e JOIN sources AS s USING (source_id) \
         LEFT JOIN event_filings AS f ON f.tenant_id = e.tenant_id AND f.external_id = e.external_id \
         WHERE e.tenant_id = $1 AND e.external_id = $2";
    const QUEUED: &str = "SELECT enqueued_at, ready_at FROM event_queue \
         WHERE tenant_id = $1 AND external_id = $2";
    const OUTBOX: &str = "SELECT o.outbox_id, o.action, o.status, o.attempts, o.last_error, o.created_at, \
             o.delivered_at, d.destination, d.tried_at, \
             CASE WHEN o.action = 'entity.changed' THEN o.payload END AS change \
         FROM outbox AS o LEFT JOIN outbox_destinations AS d USING (outbox_id) \
         WHERE o.tenant_id = $1 AND o.external_id = $2 ORDER BY o.outbox_id";
    const LETTERS: &str = "SELECT dead_letter_id, status, reason, error, attempts, created_at, replay_count, \
             replayed_at \
         FROM dead_letters WHERE tenant_id = $1 AND external_id = $2 ORDER BY dead_letter_id";
    const ANOMALIES: &str = "SELECT detected_at, kind, detail, encode(payload_sha256, 'hex') AS payload_sha256, \
             encode(stored_sha256, 'hex') AS stored_sha256, payload_replaced \
         FROM ingest_anomalies WHERE tenant_id = $1 AND external_id = $2 \
         ORDER BY anomaly_id DESC LIMIT 100";
    let Some(filing) = sqlx::query_as::<_, Filing>(FILING)
        .bind(tenant_id)
        .bind(external_id)
        .fetch_optional(&mut *conn)
        .await?
    else {
        return Ok(None);
    };
    let queued = sqlx::query_as(QUEUED)
        .bind(tenant_id)
        .bind(external_id)
        .fetch_optional(&mut *conn)
        .await?;
    let outbox = sqlx::query_as(OUTBOX)
        .bind(tenant_id)
        .bind(external_id)
        .fetch_all(&mut *conn)
        .await?;
    let dead_letters = sqlx::query_as(LETTERS)
        .bind(tenant_id)
        .bind(external_id)
        .fetch_all(&mut *conn)
        .await?;
    let anomalies = sqlx::query_as(ANOMALIES)
        .bind(tenant_id)
        .bind(external_id)
        .fetch_all(&mut *conn)
        .await?;
    Ok(Some(EventHistory {
        filing,
        entity: None,
        queued,
        outbox,
        dead_letters,
        anomalies,
    }))
}
