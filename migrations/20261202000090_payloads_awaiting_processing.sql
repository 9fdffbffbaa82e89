-- Events the payload purge's cursor walked past while they were still pending (a retry waiting
-- out its backoff, an operator's replay of an old dead letter). The cursor never comes back, so
-- without this list such an event kept its payload until its identity was purged, 30 days
-- instead of 7. Each retention pass purges the payloads of those processed since, and drops
-- the rows whose event is gone or has no payload left. Only events still pending past the
-- payload horizon when a pass reached them are listed: a handful, not a copy of the table.
-- No foreign key: adding one would lock webhook_events, and retention drops rows whose event
-- was deleted.
CREATE TABLE payloads_awaiting_processing (
    tenant_id   text NOT NULL,
    external_id text NOT NULL,
    passed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, external_id)
);
