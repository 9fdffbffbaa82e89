-- The drain: a narrow queue of pending work, versioned effects, the outbox, dead letters.

-- Pending work only. A row exists from the moment ingest accepts an event until the drain
-- processes or dead-letters it, so the claim index covers only what is waiting and finished
-- work leaves by DELETE. webhook_events keeps the record (status, attempts, last_error); its
-- completion updates touch no indexed column and can stay HOT.
CREATE TABLE event_queue (
    tenant_id   text NOT NULL,
    external_id text NOT NULL,
    -- When the event may next be claimed: arrival, or arrival of its next retry.
    ready_at    timestamptz NOT NULL DEFAULT now(),
    enqueued_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, external_id),
    FOREIGN KEY (tenant_id, external_id) REFERENCES webhook_events (tenant_id, external_id) ON DELETE CASCADE
) WITH (
    -- Small and churned: vacuum after a fixed number of dead rows, not a fraction of the table,
    -- and without cost-based sleeping. The drain also vacuums it itself as it works.
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 2000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 2000,
    autovacuum_vacuum_cost_delay = 0
);

CREATE INDEX event_queue_ready ON event_queue (ready_at);

-- Events accepted before this migration and not yet processed join the queue.
INSERT INTO event_queue (tenant_id, external_id, ready_at, enqueued_at)
SELECT tenant_id, external_id, next_attempt_at, received_at
FROM webhook_events
WHERE status = 'pending';

-- Leave room on each page for HOT updates when events complete.
ALTER TABLE webhook_events SET (fillfactor = 90);

-- The generic versioned projection: one row per entity, updated only by a higher version.
-- Deletes are versioned soft deletes; nothing is ever physically deleted here.
CREATE TABLE entities (
    tenant_id     text NOT NULL,
    entity_type   text NOT NULL,
    entity_id     text NOT NULL,
    version       bigint NOT NULL,
    state         jsonb NOT NULL,
    deleted       boolean NOT NULL DEFAULT false,
    deleted_at    timestamptz,
    -- The event whose version the row holds.
    last_event_id text NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, entity_type, entity_id)
);

-- The payments reference flow: orders the merchant created, paid by a provider event.
CREATE TABLE orders (
    tenant_id          text NOT NULL,
    order_id           text NOT NULL,
    merchant_reference text NOT NULL,
    gateway_order_id   text,
    amount_minor       bigint NOT NULL CHECK (amount_minor >= 0),
    currency           text NOT NULL,
    state              text NOT NULL DEFAULT 'awaiting_payment'
                       CHECK (state IN ('awaiting_payment', 'paid', 'fulfilled', 'cancelled')),
    paid_by_event      text,
    paid_at            timestamptz,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, order_id)
);

-- A payment event that disagreed with its order: never marked paid, never fulfilled.
CREATE TABLE payment_exceptions (
    exception_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id    text NOT NULL,
    external_id  text NOT NULL,
    order_id     text,
    kind         text NOT NULL CHECK (kind IN (
                     'unmappable_event', 'unknown_order', 'amount_mismatch', 'currency_mismatch',
                     'reference_mismatch', 'gateway_mismatch', 'invalid_state', 'already_paid')),
    detail       text NOT NULL,
    detected_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, external_id, kind)
);

-- Side effects to deliver, written in the transaction that processed the event.
CREATE TABLE outbox (
    outbox_id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id       text NOT NULL,
    external_id     text NOT NULL,
    action          text NOT NULL,
    payload         jsonb NOT NULL,
    -- Sent as the Idempotency-Key header: the receiver deduplicates retries with it.
    idempotency_key text NOT NULL UNIQUE,
    status          text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'delivered', 'failed')),
    attempts        integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    delivered_at    timestamptz,
    UNIQUE (tenant_id, external_id, action)
);

CREATE INDEX outbox_undelivered ON outbox (next_attempt_at) WHERE status = 'pending';

-- Events the drain gave up on: everything needed to understand and replay them.
CREATE TABLE dead_letters (
    dead_letter_id    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id         text NOT NULL,
    external_id       text NOT NULL,
    source_id         text NOT NULL,
    event_type        text NOT NULL,
    payload           bytea,
    headers           jsonb NOT NULL,
    error             text NOT NULL,
    -- fatal: rejected on sight; exhausted: retryable failures used up the attempt budget.
    reason            text NOT NULL CHECK (reason IN ('fatal', 'exhausted')),
    attempts          integer NOT NULL,
    status            text NOT NULL DEFAULT 'new'
                      CHECK (status IN ('new', 'investigating', 'replayed', 'discarded')),
    replay_count      integer NOT NULL DEFAULT 0,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    replayed_at       timestamptz,
    FOREIGN KEY (tenant_id, external_id) REFERENCES webhook_events (tenant_id, external_id)
);

-- At most one open dead letter per event.
CREATE UNIQUE INDEX dead_letters_open ON dead_letters (tenant_id, external_id)
    WHERE status IN ('new', 'investigating');
CREATE INDEX dead_letters_by_status ON dead_letters (status, created_at);
