-- Subscriptions: a route whose action is `event` forwards the verified event itself to its
-- destination, one outbox message per (event, subscription), written by the drain in the
-- transaction that marks the event processed. A table of its own beside `outbox_routes`: a
-- tenant has many subscriptions, each named, where it has one route per (source, action); the
-- route file holds both and `hookctl routes apply` replaces both in one transaction.
CREATE TABLE outbox_subscriptions (
    tenant_id          text NOT NULL,
    -- The subscription's name, unique in its tenant: its messages' action is `event:<name>`,
    -- so their idempotency key is stable per (tenant, event, subscription).
    name               text NOT NULL CHECK (name ~ '^[a-z0-9][a-z0-9._-]{0,62}$'),
    -- NULL: every source of the tenant.
    source_id          text,
    -- Exact event types or globs (`issues.*`); empty: every type.
    event_types        text[] NOT NULL DEFAULT '{}',
    -- Optional predicate: the JSON pointer's value in the event's data is one of these values
    -- (a JSON array).
    payload_pointer    text,
    payload_values     jsonb,
    kind               text NOT NULL CHECK (kind IN ('http', 'eventbridge', 'sqs', 'sns')),
    target             text NOT NULL CHECK (length(target) > 0),
    event_source       text,
    -- HTTP only: the Standard Webhooks secret (`whsec_...`) its deliveries are signed with.
    signing_secret_ref text,
    -- At most this many deliveries a second (NULL: the destination's pace).
    rate_limit         double precision CHECK (rate_limit > 0),
    applied_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, name),
    CHECK ((payload_pointer IS NULL) = (payload_values IS NULL))
);

-- A paused subscription's messages wait (pending, parked) until it is resumed; nothing is
-- dropped. Kept apart from the subscription so that applying the route file again does not
-- resume it. Paused by an operator or by the sender when the subscriber answered 410 Gone.
CREATE TABLE subscription_pauses (
    tenant_id  text NOT NULL,
    name       text NOT NULL,
    paused_at  timestamptz NOT NULL DEFAULT now(),
    reason     text NOT NULL,
    actor      text NOT NULL,
    PRIMARY KEY (tenant_id, name)
);

-- A replay of stored events to one subscription (`hookctl events replay`): resumable from its
-- cursor (the last event queued, in first-received order), safe to run again.
CREATE TABLE subscription_replays (
    replay_id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id           text NOT NULL,
    name                text NOT NULL,
    source_id           text,
    event_types         text[] NOT NULL DEFAULT '{}',
    since               timestamptz NOT NULL,
    until               timestamptz NOT NULL CHECK (until > since),
    rate                double precision NOT NULL CHECK (rate > 0),
    cursor_received_at  timestamptz,
    cursor_tenant_id    text,
    cursor_external_id  text,
    queued              bigint NOT NULL DEFAULT 0,
    skipped_purged      bigint NOT NULL DEFAULT 0,
    status              text NOT NULL DEFAULT 'running' CHECK (status IN ('running', 'finished')),
    actor               text NOT NULL,
    reason              text,
    started_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    finished_at         timestamptz
);
CREATE INDEX subscription_replays_running ON subscription_replays (tenant_id, name) WHERE status = 'running';

-- An entity.changed or fulfil_order route to HTTP may name a signing secret too. A nullable
-- column without a default: a catalog change only.
ALTER TABLE outbox_routes ADD COLUMN signing_secret_ref text;

-- Pausing, resuming and replaying a subscription are operators' actions, recorded like every
-- other. NOT VALID: every stored row passes the narrower old check; the next migration
-- validates them.
ALTER TABLE operator_actions DROP CONSTRAINT operator_actions_action_check;
ALTER TABLE operator_actions ADD CONSTRAINT operator_actions_action_check
    CHECK (action IN ('replay', 'set_dead_letter_status', 'tombstone', 'resend_outbox',
                      'discard_outbox', 'redrive_buffer', 'file_kept', 'pause_subscription',
                      'resume_subscription', 'replay_to_subscription')) NOT VALID;
