-- Provider address ranges as a second check (issue 50, point 5). Several providers publish the
-- addresses their webhooks come from (GitHub's meta API `hooks`, Stripe's ips_webhooks.json);
-- the catalogue names where (`[address_ranges]`), the ranges pass reads them into this table,
-- and ingest, which caches the table, checks a signed delivery's source address against them.
--
-- One row a provider the pass has tried: the list it last read and when, and what became of
-- the tries since. A failed try keeps the list it has (a provider's outage must not empty it);
-- a list older than the staleness limit never refuses a delivery and is reported
-- (`provider_ranges_stale`). Bounded by the catalogue: a handful of rows.
CREATE TABLE provider_address_ranges (
    -- The catalogue entry's name, as a source's `scheme` names it.
    provider     text PRIMARY KEY,
    -- Where the list was read (the catalogue's URL, or the override the pass was given).
    source_url   text NOT NULL,
    -- The list, NULL until a try succeeded; never empty.
    cidrs        cidr[] CHECK (cidrs IS NULL OR cardinality(cidrs) > 0),
    fetched_at   timestamptz,
    -- The last try, whatever it gave; the tries that failed since the list was read, and why
    -- the last one did.
    attempted_at timestamptz NOT NULL,
    failures     integer NOT NULL DEFAULT 0,
    last_error   text,
    CHECK ((cidrs IS NULL) = (fetched_at IS NULL))
);

-- Signed deliveries whose source address lay outside their provider's fresh ranges: admitted
-- and stored by a source that observes (`address_check = 'observe'`), refused 403 by one that
-- enforces (and kept in refused_deliveries beside it). One row a source and address, counted;
-- the `deliveries_outside_provider_ranges_last_day` check reads it. Bounded twice: each write
-- keeps its source's 100 most recently seen addresses, and only a delivery whose signature
-- verified is counted, so filling it takes the source's secret.
CREATE TABLE deliveries_outside_ranges (
    source_id      text NOT NULL,
    source_address inet NOT NULL,
    tenant_id      text NOT NULL,
    provider       text NOT NULL,
    first_seen_at  timestamptz NOT NULL DEFAULT now(),
    last_seen_at   timestamptz NOT NULL DEFAULT now(),
    -- Deliveries admitted (observe) and refused (enforce) from this address.
    admitted       bigint NOT NULL DEFAULT 0,
    refused        bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (source_id, source_address)
);

CREATE INDEX deliveries_outside_ranges_by_last_seen ON deliveries_outside_ranges (last_seen_at);

-- A source's choice: `observe`, `enforce` or `off`; NULL: its provider's default (`observe` for
-- an entry that publishes ranges, `off` otherwise), so every source stored before this
-- migration observes once its provider's list is read. A nullable column without a default
-- changes only the catalog; the CHECK is added NOT VALID (every stored row is NULL) and
-- validated by the next migration, in its own transaction.
ALTER TABLE sources ADD COLUMN address_check text;
ALTER TABLE sources ADD CONSTRAINT sources_address_check_check
    CHECK (address_check IN ('observe', 'enforce', 'off')) NOT VALID;

-- The ranges pass records its runs as `address_ranges`. NOT VALID: every stored row passes the
-- old, narrower check; the next migration validates them.
ALTER TABLE maintenance_runs DROP CONSTRAINT maintenance_runs_job_check;
ALTER TABLE maintenance_runs ADD CONSTRAINT maintenance_runs_job_check
    CHECK (job IN ('reconcile', 'backfill', 'retention', 'anomaly', 'address_ranges')) NOT VALID;
