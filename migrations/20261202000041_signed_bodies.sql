-- Replay protection outlives the identity horizon. GitHub and Shopify sign only the body, so a
-- signed body stays replayable forever under fresh ids; the body's digest in webhook_events went
-- with the event's identity after 30 days, and with it the refusal. signed_bodies keeps, per
-- source, the digest of every body whose event id came from outside the signature and the event
-- first stored with it: no payload, about 150 bytes a row with its primary key entry. The event
-- upsert claims it in the same statement (INSERT ... ON CONFLICT DO UPDATE: concurrent replays
-- of one body wait on its key, and all but the first see the first's event id). Retention keeps
-- a row for RETENTION_REPLAY_SECONDS (default 400 days) after its first sight.
--
-- A delivery whose bytes are claimed by another event id is stored held: processed without
-- effects (status 'processed', expects 'nothing', never queued, no payload copy) and recorded
-- as a `replayed_body` anomaly naming the event whose bytes they are (replay_of). It may be a
-- distinct delivery (one Shopify endpoint subscribed to orders/updated and orders/paid gets one
-- order JSON under two webhook ids) or a replay; the bytes cannot tell, so it is kept, never
-- dropped, and never makes a second effect. It is stored with id_outside_signature false:
-- webhook_events_body_once still holds one effective row per body, and backs this table up
-- (a body stored before this migration's copy and missing here is copied in on first replay).
CREATE TABLE signed_bodies (
    source_id      text NOT NULL REFERENCES sources (source_id),
    payload_sha256 bytea NOT NULL CHECK (octet_length(payload_sha256) = 32),
    -- The event first stored with these bytes.
    external_id    text NOT NULL,
    first_seen_at  timestamptz NOT NULL DEFAULT now(),
    last_seen_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source_id, payload_sha256)
);
-- Retention's purge order. first_seen_at is never updated, so a redelivery's update of
-- last_seen_at stays HOT.
CREATE INDEX signed_bodies_by_first_seen ON signed_bodies (first_seen_at);

-- The bodies already stored (webhook_events_body_once held each once). A read of webhook_events:
-- no lock that blocks its writers.
INSERT INTO signed_bodies (source_id, payload_sha256, external_id, first_seen_at, last_seen_at)
SELECT DISTINCT ON (source_id, payload_sha256)
       source_id, payload_sha256, external_id, first_received_at, last_seen_at
FROM webhook_events
WHERE id_outside_signature
ORDER BY source_id, payload_sha256, first_received_at;
