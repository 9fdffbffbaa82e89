-- A listing source lists only the event types its endpoint subscribes to (Stripe's types[]):
-- the account's other events, another endpoint's among them, are never taken for its gaps.
-- NULL: every type (an endpoint enabled for all events, and sources applied before this).
ALTER TABLE sources ADD COLUMN gap_event_types text[]
    CHECK (gap_event_types IS NULL OR cardinality(gap_event_types) > 0);
