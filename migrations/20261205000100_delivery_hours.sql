-- Issue 26: the hourly delivery figures behind the anomaly checks, kept incrementally by the
-- anomaly pass (shared::store::delivery_hours) instead of re-aggregating 29 days of
-- webhook_events into the materialized view delivery_hourly on every run. delivery_hourly is
-- left as it was: a previous build, rolled back to, still refreshes and reads it. This build
-- neither refreshes nor reads it.
--
-- Only new, empty tables: nothing here reads or locks webhook_events. The first runs fill the
-- rollup in bounded steps (the hours the checks read at once, the rest a day per run).

-- Per source and hour of first receipt, the figures delivery_hourly has. Each run recomputes
-- the last day's hours (their counters still change as deliveries repeat and events are
-- retried); for an older hour only `events` is read (a source's flow against its own weeks),
-- and it changes only when a writer stores an event received then (the buffer's consumer),
-- which marks the hour in delivery_hours_dirty. The key is checked at the end of each
-- statement, so a statement that moves every hour by the same interval is valid.
CREATE TABLE delivery_hours (
    source_id        text NOT NULL,
    hour             timestamptz NOT NULL,
    events           bigint NOT NULL,
    redeliveries     bigint NOT NULL,
    conflicts        bigint NOT NULL,
    backfilled       bigint NOT NULL,
    retried          bigint NOT NULL,
    provider_retries bigint NOT NULL,
    CONSTRAINT delivery_hours_key PRIMARY KEY (source_id, hour) DEFERRABLE INITIALLY IMMEDIATE
);
CREATE INDEX delivery_hours_by_hour ON delivery_hours (hour);

-- Every hour delivery_hours holds, whatever its sources (an hour without events has no rows
-- there), and when it was computed: an hour computed long enough after it ended is final.
CREATE TABLE delivery_hours_computed (
    hour        timestamptz NOT NULL,
    computed_at timestamptz NOT NULL,
    CONSTRAINT delivery_hours_computed_key PRIMARY KEY (hour) DEFERRABLE INITIALLY IMMEDIATE
);

-- Hours a writer changed after they may have been final: the buffer's consumer filing a
-- delivery received more than an hour before, retention deleting events of the last 29 days.
-- The next anomaly run takes the marks and computes the hours again.
CREATE TABLE delivery_hours_dirty (
    source_id text NOT NULL,
    hour      timestamptz NOT NULL,
    marked_at timestamptz NOT NULL DEFAULT now()
);

-- When this build last brought the rollup up to date; it records the same instant as
-- delivery_hourly's refresh in view_refreshes (views_refresh_age_seconds reads that, in every
-- build). A refresh time that differs was written by a previous build, whose writers do not
-- mark the hours they change: the next run computes every hour older than a day again.
CREATE TABLE delivery_hours_state (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    rolled_at timestamptz NOT NULL
);
