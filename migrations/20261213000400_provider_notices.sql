-- Signed messages a provider sends about the subscription rather than an event of it: Twitch's
-- `revocation` (the subscription was revoked: its events stop until it is created again). They
-- are answered 2xx as the provider requires, never stored as events, and kept here for the
-- operator, with their signed body: a check breaches on any in the last day.
--
-- Bounded per source: each insert keeps that source's newest 100 and deletes the rest, so the
-- table holds at most 100 rows a source on day 60 as on day one. A new table: no lock on any
-- table the pipeline writes.
CREATE TABLE provider_notices (
    notice_id   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    received_at timestamptz NOT NULL DEFAULT now(),
    tenant_id   text NOT NULL,
    source_id   text NOT NULL,
    -- The catalogue entry's name for it (`revocation`).
    kind        text NOT NULL,
    -- What it is about and what it says, as the entry reads them (Twitch: the subscription's
    -- type and its status, `authorization_revoked`).
    subject     text,
    detail      text,
    payload     bytea NOT NULL
);

CREATE INDEX provider_notices_by_source ON provider_notices (source_id, notice_id);
