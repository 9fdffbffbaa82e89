-- no-transaction
-- A sender leases the oldest due messages first and, among those due at once (one drain
-- transaction's), in the order written: this index holds them in exactly that order, so a
-- lease reads the rows it takes. The index on `next_attempt_at` alone left the order of equal
-- times to a sort, and once most pending messages were due (a destination's outage over) the
-- planner sorted every one of them for each batch. Built concurrently: the drain writes the
-- outbox. It replaces `outbox_undelivered` (same rows, one column fewer), dropped next.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_due ON outbox (next_attempt_at, outbox_id) WHERE status = 'pending';
