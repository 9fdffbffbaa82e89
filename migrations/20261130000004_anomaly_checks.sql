-- Anomaly checks: materialized views refreshed CONCURRENTLY on the checks' schedule, and the
-- results of every check of every run.

ALTER TABLE maintenance_runs DROP CONSTRAINT maintenance_runs_job_check;
ALTER TABLE maintenance_runs ADD CONSTRAINT maintenance_runs_job_check
    CHECK (job IN ('reconcile', 'backfill', 'retention', 'anomaly'));

-- Events per source per hour of first receipt, for four weeks and a day: the per-source
-- hour-of-week baselines (silence, spikes) and the duplicate and backfill rates read this.
CREATE MATERIALIZED VIEW delivery_hourly AS
SELECT source_id,
       date_trunc('hour', first_received_at) AS hour,
       count(*) AS events,
       sum(delivery_count - 1) AS redeliveries,
       sum(conflict_count) AS conflicts,
       count(*) FILTER (WHERE verified_with = 'provider_api') AS backfilled,
       count(*) FILTER (WHERE attempts > 1) AS retried
FROM webhook_events
WHERE first_received_at >= now() - interval '29 days'
GROUP BY 1, 2;
CREATE UNIQUE INDEX delivery_hourly_key ON delivery_hourly (source_id, hour);

-- Received → processed latency of the last hour's processed events.
CREATE MATERIALIZED VIEW processing_latency AS
SELECT 1 AS key,
       count(*) AS events,
       percentile_cont(0.50) WITHIN GROUP (ORDER BY extract(epoch FROM processed_at - received_at)) AS p50_seconds,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM processed_at - received_at)) AS p95_seconds,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM processed_at - received_at)) AS p99_seconds
FROM webhook_events
WHERE first_received_at >= now() - interval '1 day'
  AND status = 'processed' AND processed_at >= now() - interval '1 hour';
CREATE UNIQUE INDEX processing_latency_key ON processing_latency (key);

-- When each view was last refreshed (the views themselves cannot say).
CREATE TABLE view_refreshes (
    view_name    text PRIMARY KEY,
    refreshed_at timestamptz NOT NULL
);

-- Every check of every anomaly run: what was measured, what was expected, whether it breached.
CREATE TABLE anomaly_results (
    run_id        bigint NOT NULL REFERENCES maintenance_runs (run_id) ON DELETE CASCADE,
    check_name    text NOT NULL,
    family        text NOT NULL CHECK (family IN ('latency', 'referential', 'integrity', 'flow', 'machinery')),
    -- The source a per-source check is about; '' for global checks.
    subject       text NOT NULL DEFAULT '',
    value         double precision,
    expected_low  double precision,
    expected_high double precision,
    breached      boolean NOT NULL,
    detail        text NOT NULL DEFAULT '',
    PRIMARY KEY (run_id, check_name, subject)
);
CREATE INDEX anomaly_results_breaches ON anomaly_results (check_name, run_id) WHERE breached;

-- Outbox rows that failed for good, for the check that counts them.
CREATE INDEX outbox_failed ON outbox (created_at) WHERE status = 'failed';
