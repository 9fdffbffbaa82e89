-- What reconciliation checks of a processed event, as declared by the handler that processed
-- it (recorded when the event is completed or replayed):
--   projection: the versioned projection holds the event's version or a newer one, and a change
--               this event made after its row existed has its announcement in the outbox;
--   fulfilment: an order this event paid after its row existed has its fulfilment row;
--   nothing:    no effect reconciliation can check.
-- NULL while the event is not processed.
ALTER TABLE webhook_events ADD COLUMN expects text
    CHECK (expects IN ('nothing', 'projection', 'fulfilment'));

-- Events processed before this migration: what the standard registry's handlers declare (Stripe
-- payment_intent.succeeded is the payments flow; any other event naming an entity and a
-- version is the projection).
UPDATE webhook_events AS e SET expects = CASE
        WHEN s.scheme = 'stripe' AND e.event_type = 'payment_intent.succeeded' THEN 'fulfilment'
        WHEN e.entity_id IS NOT NULL AND e.entity_version IS NOT NULL THEN 'projection'
        ELSE 'nothing' END
FROM sources AS s
WHERE s.source_id = e.source_id AND e.status = 'processed';
