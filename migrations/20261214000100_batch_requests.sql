-- Batches are events: a request that carries several events (HubSpot's array, SendGrid's,
-- Okta's data.events, Mandrill's mandrill_events) files each element as its own event row, with
-- the element's own JSON as its payload. The request's bytes, which the signature covers, are
-- kept once here for audit and re-verification, not copied into every element, with the ids of
-- the events it carried, in order. `webhook_events` itself is not altered: an ALTER would wait
-- behind every live ingest and drain transaction, and hold up all that queue behind it.
--
-- Bounded by retention: a request is deleted with the payloads of its day (the same
-- PAYLOAD_RETENTION_DAYS), so the table holds a retention window's requests on day 60 as on
-- day 10. A new table, and a nullable column without a default on `sources` (read through
-- ingest's cache, written by operators only): a catalogue change, no rewrite.
CREATE TABLE batch_requests (
    batch_request_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    received_at      timestamptz NOT NULL,
    tenant_id        text NOT NULL,
    source_id        text NOT NULL,
    -- The ids of the events it carried (`webhook_events.external_id` of its tenant), in the
    -- order sent: an id twice when the batch held an element twice.
    external_ids     text[] NOT NULL CHECK (cardinality(external_ids) > 0),
    -- The bytes as received and signed.
    body             bytea NOT NULL,
    body_sha256      bytea NOT NULL,
    -- The headers kept beside an event's payload (signature, timestamp, content type, ...).
    headers          jsonb NOT NULL,
    -- `current` or `previous`: the secret that verified it.
    verified_with    text NOT NULL
);

CREATE INDEX batch_requests_by_age ON batch_requests (received_at);
-- An event's requests: `WHERE source_id = $1 AND $2 = ANY (external_ids)` over the requests of
-- the days around its first receipt.
CREATE INDEX batch_requests_by_source ON batch_requests (source_id, received_at);

-- Where a source's batched deliveries carry their events (`json:/`, `json:/data/events`,
-- `form:mandrill_events`); NULL: a delivery is one event. Every source stored before this
-- migration keeps filing a request as one event until its sources file is applied again.
ALTER TABLE sources ADD COLUMN elements_from text;
