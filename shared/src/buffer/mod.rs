//! The second durable buffer: SQS takes a verified delivery when PostgreSQL cannot (or, in
//! `queue` mode, always), and the buffer's consumer files it later with the direct path's
//! semantics.
//!
//! A buffered delivery is everything the upsert needs, exactly: the raw body bytes, the source,
//! the headers kept beside the payload (those the field map and the signature read, the
//! provider's retry marks, content type, user agent), which of them the signature covers, the
//! received time, and the secret that verified it. The consumer derives the event's fields from
//! them with the source's field map, as ingest does ([`crate::prepare::prepare`]).
//!
//! On the wire: the SQS message body is [`Envelope`] as JSON; the raw body travels as the
//! binary message attribute [`BODY_ATTRIBUTE`], never re-encoded in the JSON.

pub mod accounting;
pub mod age;
pub mod consumer;
pub mod filing;
pub mod queue;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use accounting::{BufferDepth, BufferReading, DeadLetter, Redriven};
pub use age::OldestAge;
pub use queue::{BufferQueue, QueueError, QueueSettings};

/// SQS's limit on one message: the body plus every attribute's name, type and value.
pub const SQS_MAX_MESSAGE_BYTES: usize = 1_048_576;

/// The message attribute that carries the raw delivery body.
pub const BODY_ATTRIBUTE: &str = "body";
const BODY_ATTRIBUTE_TYPE: &str = "Binary";

/// The version of [`Envelope`]: a consumer refuses (as unfilable) a version it does not know.
pub const ENVELOPE_VERSION: u32 = 1;

/// Where ingest puts a verified delivery (`BUFFER_MODE`, the stack's `BufferMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferMode {
    /// PostgreSQL only: a delivery the database cannot take is answered 503.
    Database,
    /// PostgreSQL first; what it cannot take within `SPILLOVER_AFTER_MS` goes to SQS.
    Spillover,
    /// SQS first (the consumer files it); PostgreSQL directly when SQS cannot take it.
    Queue,
}

impl BufferMode {
    pub fn as_str(self) -> &'static str {
        match self {
            BufferMode::Database => "database",
            BufferMode::Spillover => "spillover",
            BufferMode::Queue => "queue",
        }
    }
}

impl std::str::FromStr for BufferMode {
    type Err = String;

    fn from_str(raw: &str) -> Result<Self, String> {
        match raw {
            "database" => Ok(BufferMode::Database),
            "spillover" => Ok(BufferMode::Spillover),
            "queue" => Ok(BufferMode::Queue),
            other => Err(format!("{other:?}: expected database, spillover or queue")),
        }
    }
}

/// A verified delivery, buffered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferedDelivery {
    pub envelope: Envelope,
    /// The raw body bytes, exactly as signed.
    pub body: Vec<u8>,
}

/// Everything of a buffered delivery but its body: the SQS message body, as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    pub v: u32,
    /// Made by ingest for this delivery: the consumer files each delivery id once
    /// (`buffer_receipts`), so a message SQS delivers twice, or a send the SDK retried, is one
    /// delivery.
    pub delivery_id: String,
    pub source_id: String,
    /// When ingest received it, as Unix microseconds: the stored row's received time.
    pub received_at_micros: i64,
    /// `current` or `previous`: the secret that verified it.
    pub verified_with: String,
    /// The kept headers (lowercase names).
    pub headers: BTreeMap<String, String>,
    /// Which of the kept headers the signature covers (lowercase names).
    pub signed_headers: Vec<String>,
    /// The hex SHA-256 of the signed string, for a layout that signs values rather than the
    /// body (`signature::Verified::signed_digest`): the consumer claims it as ingest would have.
    /// Absent from envelopes of other layouts and of releases before it existed (the body's
    /// digest is claimed then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signed_digest: Option<String>,
    /// For a batch whose elements each carry their own signature (Adyen's items): each
    /// element's signed digest, hex, in order (`prepare::Prepared::sign_each`). Absent
    /// otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub element_digests: Vec<String>,
    /// The name of the provider's layout that verified it, for a provider with several: the
    /// stored row's `verified_layout`. Absent otherwise and from envelopes of earlier releases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verified_layout: Option<String>,
}

/// Why a message cannot be read as a buffered delivery.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("the message body is not a buffered delivery: {0}")]
    Envelope(#[source] serde_json::Error),
    #[error("envelope version {0} is not one this build reads")]
    Version(u32),
    #[error("the message has no `{BODY_ATTRIBUTE}` attribute")]
    NoBody,
}

impl BufferedDelivery {
    /// The envelope's digest of the signed string, when it carries one that reads as 32 bytes
    /// (anything else is claimed as the body's digest, as before the envelope carried it).
    pub fn signed_digest(&self) -> Option<[u8; 32]> {
        let mut digest = [0u8; 32];
        hex::decode_to_slice(self.envelope.signed_digest.as_deref()?, &mut digest).ok()?;
        Some(digest)
    }

    /// Each element's own signed digest, as ingest verified them ([`Envelope::element_digests`]).
    pub fn element_digests(&self) -> Vec<Option<[u8; 32]>> {
        self.envelope
            .element_digests
            .iter()
            .map(|hex_digest| {
                let mut digest = [0u8; 32];
                hex::decode_to_slice(hex_digest, &mut digest).ok()?;
                Some(digest)
            })
            .collect()
    }

    /// The SQS message body.
    pub fn envelope_json(&self) -> String {
        serde_json::to_string(&self.envelope).expect("an envelope of strings and integers")
    }

    /// The size SQS counts for this message: the body, and the attribute's name, type and value.
    pub fn sqs_size(&self) -> usize {
        self.size_with(&self.envelope_json())
    }

    /// Whether it fits one SQS message.
    pub fn fits(&self) -> bool {
        self.sqs_size() <= SQS_MAX_MESSAGE_BYTES
    }

    /// The message body (the envelope's JSON), once, when the whole message fits one SQS
    /// message; else the size it would have.
    pub fn message_body(&self) -> Result<String, usize> {
        let json = self.envelope_json();
        match self.size_with(&json) {
            size if size <= SQS_MAX_MESSAGE_BYTES => Ok(json),
            size => Err(size),
        }
    }

    fn size_with(&self, envelope_json: &str) -> usize {
        envelope_json.len() + BODY_ATTRIBUTE.len() + BODY_ATTRIBUTE_TYPE.len() + self.body.len()
    }

    /// Reads a message back: its body (the envelope) and its `body` attribute.
    pub fn decode(message_body: &str, body: Option<Vec<u8>>) -> Result<Self, DecodeError> {
        let envelope: Envelope =
            serde_json::from_str(message_body).map_err(DecodeError::Envelope)?;
        if envelope.v != ENVELOPE_VERSION {
            return Err(DecodeError::Version(envelope.v));
        }
        let body = body.ok_or(DecodeError::NoBody)?;
        Ok(Self { envelope, body })
    }

    /// The kept headers as a header map (names and values that do not parse are left out: they
    /// were read from one when buffered, so none is).
    pub fn header_map(&self) -> http::HeaderMap {
        let mut map = http::HeaderMap::new();
        for (name, value) in &self.envelope.headers {
            if let (Ok(name), Ok(value)) = (
                http::HeaderName::from_bytes(name.as_bytes()),
                http::HeaderValue::from_str(value),
            ) {
                map.insert(name, value);
            }
        }
        map
    }

    /// Whether the signature covers this header (lowercase name).
    pub fn signs_header(&self, name: &str) -> bool {
        self.envelope.signed_headers.iter().any(|h| h == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(body: Vec<u8>) -> BufferedDelivery {
        BufferedDelivery {
            envelope: Envelope {
                v: ENVELOPE_VERSION,
                delivery_id: "d1".into(),
                verified_layout: None,
                source_id: "gh".into(),
                received_at_micros: 1_764_000_000_123_456,
                verified_with: "current".into(),
                headers: [("x-github-delivery".to_owned(), "abc".to_owned())].into(),
                signed_headers: vec![],
                signed_digest: None,
                element_digests: Vec::new(),
            },
            body,
        }
    }

    #[test]
    fn a_message_reads_back_as_it_was_written() {
        let d = delivery(b"\x00\xffnot utf-8".to_vec());
        let back = BufferedDelivery::decode(&d.envelope_json(), Some(d.body.clone())).unwrap();
        assert_eq!(back, d);
        assert_eq!(back.header_map()["x-github-delivery"], "abc");
    }

    #[test]
    fn the_size_counts_envelope_and_attribute() {
        let d = delivery(vec![0; 1000]);
        assert_eq!(d.sqs_size(), d.envelope_json().len() + 4 + 6 + 1000);
        assert!(d.fits());
        assert!(!delivery(vec![0; SQS_MAX_MESSAGE_BYTES]).fits());
    }

    #[test]
    fn an_unknown_version_or_a_missing_body_is_refused() {
        let mut d = delivery(vec![]);
        d.envelope.v = 9;
        assert!(matches!(
            BufferedDelivery::decode(&d.envelope_json(), Some(vec![])),
            Err(DecodeError::Version(9))
        ));
        assert!(matches!(
            BufferedDelivery::decode("{", None),
            Err(DecodeError::Envelope(_))
        ));
        let d = delivery(vec![]);
        assert!(matches!(
            BufferedDelivery::decode(&d.envelope_json(), None),
            Err(DecodeError::NoBody)
        ));
    }
}
