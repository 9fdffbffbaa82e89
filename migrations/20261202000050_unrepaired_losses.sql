-- What reconcile found lost and could not repair: a processed event whose effect or outbox row
-- is missing while its payload is purged (its handler cannot run again), or whose repair
-- failed. One row per event, kept while the loss stands: reconcile clears it when it finds the
-- event consistent again (or no longer stored), a successful repair clears it at once. The
-- status verdict counts these rows: it reads a table as small as the losses, never the events.
CREATE TABLE unrepaired_losses (
    tenant_id      text NOT NULL,
    external_id    text NOT NULL,
    -- What reconcile found: missing_effect or missing_outbox (NULL: a failed repair recorded
    -- before reconcile's scan named it).
    problem        text CHECK (problem IN ('missing_effect', 'missing_outbox')),
    -- Why it stays lost: payload_purged (nothing to re-run) or repair_failed.
    reason         text NOT NULL CHECK (reason IN ('payload_purged', 'repair_failed')),
    last_error     text,
    first_found_at timestamptz NOT NULL DEFAULT now(),
    last_found_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, external_id)
);
