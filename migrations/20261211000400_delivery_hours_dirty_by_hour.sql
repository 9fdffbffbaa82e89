-- no-transaction
-- The writers of delivery_hours_dirty mark an hour only when no mark of it is there yet (one
-- that rereads changes covering one that does not), so the table holds a mark per source and
-- hour, not one per delivery: while the anomaly pass is down it grows with hours, not traffic.
-- Each writer looks its hour up by this index. Built concurrently: ingest writes the table.
CREATE INDEX CONCURRENTLY IF NOT EXISTS delivery_hours_dirty_by_hour
    ON delivery_hours_dirty (source_id, hour);
