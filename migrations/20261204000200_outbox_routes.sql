-- Where each outbox action goes (issue 24): per tenant, or per source of a tenant, one
-- destination (an HTTP URL, an EventBridge bus, an SQS queue or an SNS topic). A table of its
-- own, not columns of `sources`: a route is keyed by (tenant, source or none, action), a tenant's
-- route serves every one of its sources, and `hookctl routes apply` replaces the whole set in one
-- transaction without touching the rows ingest caches. No foreign key to `sources`: creating one
-- would lock that table; the apply checks that a named source exists.
CREATE TABLE outbox_routes (
    tenant_id    text NOT NULL,
    -- NULL: every source of the tenant (a source's own route wins).
    source_id    text,
    action       text NOT NULL,
    kind         text NOT NULL CHECK (kind IN ('http', 'eventbridge', 'sqs', 'sns')),
    -- The URL, the bus name or ARN, the queue URL or the topic ARN.
    target       text NOT NULL CHECK (length(target) > 0),
    -- EventBridge only: the entries' Source.
    event_source text,
    applied_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE NULLS NOT DISTINCT (tenant_id, source_id, action)
);
-- Where a message went (or was last tried): "sqs https://…/orders.fifo"; no row while no try was
-- made. Shown by `hookctl outbox list` and `hookctl outbox sent`. A table of its own, not a
-- column of `outbox`: adding a column takes ACCESS EXCLUSIVE on `outbox`, which every drain
-- batch writes, and a deploy must not wait for live writes (tests/migrate.rs). Written by the
-- sender's settling statements, with the outbox row's own update; deleted by retention with the
-- outbox row. No foreign key, for the same lock.
CREATE TABLE outbox_destinations (
    outbox_id   bigint PRIMARY KEY,
    destination text NOT NULL,
    tried_at    timestamptz NOT NULL DEFAULT now()
);
