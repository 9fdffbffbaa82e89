-- Issue 26: semantic_duplicates_last_day counted from the changes the anomaly pass has read,
-- not by grouping a day of webhook_events on every run.
--
-- recent_changes holds, for each event of the last day (and a margin) that names an entity
-- version, its change (tenant, source, event type, entity, version and tie-break, as one row
-- value in text) and when it was first received; and, from the same table, when the latest
-- and the one before the latest earlier event of the same change were first received. The
-- anomaly pass reads again only the events received since its last run (less a margin), and
-- from an earlier hour when a writer marked it with rereads_changes: an event filed late, or
-- a conflicting delivery that gave a pending event another entity version.
--
-- A change has two or more events in the last day exactly when one event's previous event is
-- in the day and the one before that is not (or there is none): one row per duplicated change.
--
-- Only new, empty tables and a column with a constant default on delivery_hours_dirty (no
-- rewrite): nothing here reads or locks webhook_events. The first run reads the last day.
CREATE TABLE recent_changes (
    tenant_id          text NOT NULL,
    external_id        text NOT NULL,
    change             text NOT NULL,
    first_received_at  timestamptz NOT NULL,
    previous_at        timestamptz,
    before_previous_at timestamptz,
    CONSTRAINT recent_changes_key PRIMARY KEY (tenant_id, external_id)
);
CREATE INDEX recent_changes_by_change ON recent_changes (change, first_received_at, external_id);
CREATE INDEX recent_changes_by_first_received ON recent_changes (first_received_at);
CREATE INDEX recent_changes_repeated ON recent_changes (previous_at) WHERE previous_at IS NOT NULL;

ALTER TABLE delivery_hours_dirty ADD COLUMN rereads_changes boolean NOT NULL DEFAULT false;

-- When the anomaly pass last read the changes: the same instant as delivery_hours_state's
-- rolled_at when this build rolled last. A build that does not keep recent_changes rolls
-- without writing here, and the next run reads the last day again.
CREATE TABLE recent_changes_state (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    read_at   timestamptz NOT NULL
);
