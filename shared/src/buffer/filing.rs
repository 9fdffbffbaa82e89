//! Filing a batch of buffered deliveries. For now one row at a time through the direct path's
//! upsert, so the semantics are the direct path's by construction; the set-wise statement
//! replaces this loop.
use sqlx::PgPool;

use super::{BufferedDelivery, DecodeError};
use crate::store::StoreError;
use crate::store::webhook_events::{self, Upserted};

pub struct Message {
    pub message_id: String,
    pub delivery: Result<BufferedDelivery, DecodeError>,
}

pub enum Filed {
    Stored(Upserted),
    AlreadyFiled,
    Unfilable { kind: &'static str, detail: String },
    Retry { reason: String },
}

pub async fn file_batch(pool: &PgPool, messages: &[Message]) -> Result<Vec<Filed>, StoreError> {
    let mut out = Vec::new();
    for m in messages {
        let d = match &m.delivery {
            Ok(d) => d,
            Err(e) => {
                out.push(Filed::Retry {
                    reason: e.to_string(),
                });
                continue;
            }
        };
        let Ok(id) = crate::domain::SourceId::parse(&d.envelope.source_id) else {
            out.push(Filed::Retry {
                reason: "not a source id".into(),
            });
            continue;
        };
        let Some(source) = crate::sources::find(pool, &id).await? else {
            out.push(Filed::Retry {
                reason: "no source".into(),
            });
            continue;
        };
        let headers = d.header_map();
        let signed = |h: &str| d.signs_header(h);
        let prepared = match crate::ingest::prepare(
            &source,
            &headers,
            &d.body,
            &signed,
            d.envelope.received_at_micros,
        ) {
            Ok(p) => p,
            Err(e) => {
                out.push(Filed::Unfilable {
                    kind: e.anomaly_kind(),
                    detail: e.to_string(),
                });
                continue;
            }
        };
        let event = prepared.event(&source, &d.body, &d.envelope.verified_with);
        match webhook_events::upsert(pool, &event).await {
            Ok(u) => out.push(Filed::Stored(u)),
            Err(webhook_events::UpsertError::Store(e)) => return Err(e),
            Err(e) => out.push(Filed::Retry {
                reason: e.to_string(),
            }),
        }
    }
    Ok(out)
}
