-- `hookctl status` reads, per source, its newest event and its last hour and day of events. Both
-- columns are written once when the row is inserted and never updated, so completions and
-- redeliveries stay HOT updates: the index costs ingest one more entry per new event.
CREATE INDEX webhook_events_by_source_first_received ON webhook_events (source_id, first_received_at);
