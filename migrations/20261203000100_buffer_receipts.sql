-- The buffer's consumer files each buffered delivery once. SQS delivers a message at least once
-- and the SDK may retry a send that SQS had taken: the consumer claims the delivery id ingest
-- made for it here, in the transaction that stores the event, so a second copy is skipped
-- rather than counted as a redelivery. SQS keeps a message 14 days at most; retention deletes
-- rows older than 15.
CREATE TABLE buffer_receipts (
    delivery_id text PRIMARY KEY,
    filed_at    timestamptz NOT NULL DEFAULT now()
);
-- Retention's purge order.
CREATE INDEX buffer_receipts_by_filed_at ON buffer_receipts (filed_at);
