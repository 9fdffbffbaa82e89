-- Reconciliation, gap detection and backfill, retention.

-- How a source's expected event IDs can be listed, for gap detection and backfill.
--   sequence: the provider numbers its events; external IDs follow id_template ("evt_{seq}")
--             and the sequence is read with sequence_from.
--   list_api: the provider lists its events (Stripe-style GET /v1/events with cursor paging
--             over a created-time window) and serves GET /v1/events/{id}.
ALTER TABLE sources
    ADD COLUMN gap_strategy      text CHECK (gap_strategy IN ('sequence', 'list_api')),
    ADD COLUMN id_template       text CHECK (id_template IS NULL OR strpos(id_template, '{seq}') > 0),
    ADD COLUMN api_base_url      text,
    -- Secrets Manager secret holding the provider API key (sent as a bearer token).
    ADD COLUMN api_secret_ref    text,
    -- A gap younger than this is left alone: late deliveries are normal.
    ADD COLUMN gap_grace_seconds integer NOT NULL DEFAULT 600 CHECK (gap_grace_seconds >= 0),
    -- Sequence strategy: how many sequence numbers above the watermark one pass examines.
    -- List strategy: how far back (seconds) the listed window starts.
    ADD COLUMN gap_window        bigint NOT NULL DEFAULT 100000 CHECK (gap_window > 0),
    ADD CONSTRAINT sources_gap_strategy_complete CHECK (
        gap_strategy IS NULL
        OR (api_base_url IS NOT NULL AND api_secret_ref IS NOT NULL
            AND (gap_strategy <> 'sequence' OR (id_template IS NOT NULL AND sequence_from IS NOT NULL))));

-- Events fetched from the provider's API are stored by the same upsert as deliveries.
ALTER TABLE webhook_events DROP CONSTRAINT webhook_events_verified_with_check;
ALTER TABLE webhook_events ADD CONSTRAINT webhook_events_verified_with_check
    CHECK (verified_with IN ('current', 'previous', 'provider_api'));

-- Gap detection reads only a window of one source's sequence.
CREATE INDEX webhook_events_by_sequence ON webhook_events (source_id, provider_sequence)
    WHERE provider_sequence IS NOT NULL;

-- IDs the provider will never deliver: never flagged as gaps again.
CREATE TABLE tombstones (
    tenant_id   text NOT NULL,
    external_id text NOT NULL,
    source_id   text NOT NULL REFERENCES sources (source_id),
    sequence    bigint,
    reason      text NOT NULL,
    -- 'backfill' (the provider said not found) or 'operator:<who>'.
    created_by  text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, external_id)
);
CREATE INDEX tombstones_by_sequence ON tombstones (source_id, sequence) WHERE sequence IS NOT NULL;

-- Per source, every sequence number at or below this is stored or tombstoned.
CREATE TABLE gap_watermarks (
    source_id          text PRIMARY KEY REFERENCES sources (source_id),
    contiguous_through bigint NOT NULL,
    updated_at         timestamptz NOT NULL DEFAULT now()
);

-- IDs the provider sent (or listed) that never arrived, until backfilled or tombstoned.
CREATE TABLE gap_candidates (
    tenant_id       text NOT NULL,
    external_id     text NOT NULL,
    source_id       text NOT NULL REFERENCES sources (source_id),
    sequence        bigint,
    -- arrived: the delivery came by itself after all; backfilled: fetched from the provider.
    status          text NOT NULL DEFAULT 'open' CHECK (status IN ('open', 'arrived', 'backfilled', 'tombstoned')),
    first_seen_at   timestamptz NOT NULL DEFAULT now(),
    last_checked_at timestamptz,
    attempts        integer NOT NULL DEFAULT 0,
    last_error      text,
    PRIMARY KEY (tenant_id, external_id)
);
CREATE INDEX gap_candidates_open ON gap_candidates (source_id, first_seen_at) WHERE status = 'open';

-- One row per run of a maintenance job, with what it found and what it repaired.
CREATE TABLE maintenance_runs (
    run_id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job         text NOT NULL CHECK (job IN ('reconcile', 'backfill', 'retention')),
    -- 'schedule', 'alarm:<name>', 'operator', ...
    trigger     text NOT NULL,
    status      text NOT NULL CHECK (status IN ('running', 'completed', 'skipped', 'failed')),
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    found       jsonb NOT NULL DEFAULT '{}'::jsonb,
    repaired    jsonb NOT NULL DEFAULT '{}'::jsonb,
    error       text
);
CREATE INDEX maintenance_runs_by_job ON maintenance_runs (job, started_at DESC);

-- Where the reconciler's chunked scan of webhook_events resumes.
CREATE TABLE reconcile_cursors (
    check_name  text PRIMARY KEY,
    tenant_id   text NOT NULL,
    external_id text NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- A delivery whose identity retention already purged is recognised by its effect.
ALTER TABLE ingest_anomalies DROP CONSTRAINT ingest_anomalies_kind_check;
ALTER TABLE ingest_anomalies ADD CONSTRAINT ingest_anomalies_kind_check
    CHECK (kind IN ('digest_conflict', 'unparseable_payload', 'missing_field', 'invalid_field',
                    'redelivered_after_purge'));

-- Reconciliation finds the event that paid an order.
CREATE INDEX orders_paid_by_event ON orders (tenant_id, paid_by_event) WHERE paid_by_event IS NOT NULL;

-- Retention walks events by first receipt, which never changes (completion updates stay HOT).
CREATE INDEX webhook_events_by_first_received ON webhook_events (first_received_at);

-- Where payload purging resumes.
CREATE TABLE retention_cursors (
    name    text PRIMARY KEY,
    through timestamptz NOT NULL
);
