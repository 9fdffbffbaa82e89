-- Issue 26: the last three statements of the anomaly pass that read a day of webhook_events.
--
-- processing_completions: the drain (and a dead letter's replay) records, in the statement that
-- marks events processed, each event's received → processed latency, one row per statement.
-- processing_latency is the same view over it instead of over webhook_events: the
-- percentiles of the events processed in the last hour, read from an hour's rows, not a day of
-- events. The anomaly pass forgets rows older than two hours.
--
-- consistency_sweep: pending_without_queue_row and processed_without_projection are counted
-- over a bounded window of the last day's events per run, from a cursor that sweeps the day
-- (first_received_at, then the key), instead of over the whole day on every run. The row holds
-- where the sweep stands and what its latest window found.
--
-- New tables, and a materialized view dropped and created again under the same name and
-- columns (a previous build refreshes and reads it as before; its drain does not feed it, so
-- it reads no latency until this build runs). Nothing here reads or locks webhook_events.
CREATE TABLE processing_completions (
    completed_at timestamptz NOT NULL,
    -- Each event's processed_at - received_at, in seconds.
    seconds      double precision[] NOT NULL
);
CREATE INDEX processing_completions_by_time ON processing_completions (completed_at);

DROP MATERIALIZED VIEW processing_latency;
CREATE MATERIALIZED VIEW processing_latency AS
SELECT 1 AS key,
       count(*) AS events,
       percentile_cont(0.50) WITHIN GROUP (ORDER BY s.seconds) AS p50_seconds,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY s.seconds) AS p95_seconds,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY s.seconds) AS p99_seconds
FROM processing_completions AS c CROSS JOIN LATERAL unnest(c.seconds) AS s(seconds)
WHERE c.completed_at >= now() - interval '1 hour';
CREATE UNIQUE INDEX processing_latency_key ON processing_latency (key);

CREATE TABLE consistency_sweep (
    singleton                    boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    -- The last event the sweep examined: the next window starts after it.
    through_at                   timestamptz NOT NULL,
    through_tenant_id            text NOT NULL,
    through_external_id          text NOT NULL,
    -- When the sweep last started again from a day ago.
    cycle_started_at             timestamptz NOT NULL,
    swept_at                     timestamptz NOT NULL,
    -- The latest window: how many events it examined, from when to when, and what it found.
    window_events                bigint NOT NULL,
    window_from                  timestamptz,
    -- It held fewer events than a window may: the next run starts again from a day ago.
    reached_present              boolean NOT NULL,
    pending_without_queue_row    bigint NOT NULL,
    processed_without_projection bigint NOT NULL
);
