-- Reconcile re-queues a processed event to re-assert its effects without making it pending
-- again: the event row stays `processed` (so no delivery can rewrite its payload, and no failure
-- of the repair can dead-letter it), and its queue row says it is a repair.
ALTER TABLE event_queue ADD COLUMN repair boolean NOT NULL DEFAULT false;
