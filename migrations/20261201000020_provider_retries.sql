-- Deliveries the provider marked as its own retries (Slack's X-Slack-Retry-Num), per event. A
-- provider retries when the receiver failed or answered too slowly; Slack turns an app's events
-- off when too many fail, so the rate is watched (anomaly check provider_retry_rate_last_day).
ALTER TABLE webhook_events ADD COLUMN provider_retries integer NOT NULL DEFAULT 0
    CHECK (provider_retries >= 0);

-- delivery_hourly gains the provider retries of each hour's events.
DROP MATERIALIZED VIEW delivery_hourly;
CREATE MATERIALIZED VIEW delivery_hourly AS
SELECT source_id,
       date_trunc('hour', first_received_at) AS hour,
       count(*) AS events,
       sum(delivery_count - 1) AS redeliveries,
       sum(conflict_count) AS conflicts,
       count(*) FILTER (WHERE verified_with = 'provider_api') AS backfilled,
       count(*) FILTER (WHERE attempts > 1) AS retried,
       sum(provider_retries) AS provider_retries
FROM webhook_events
WHERE first_received_at >= now() - interval '29 days'
GROUP BY 1, 2;
CREATE UNIQUE INDEX delivery_hourly_key ON delivery_hourly (source_id, hour);
