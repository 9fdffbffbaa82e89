-- A sequence the provider offers no API for: Xero numbers a webhook subscription's events
-- (firstEventSequence..lastEventSequence) and serves none of them by its number. Such a source's
-- gap detection finds and alarms its gaps and never fetches one, so it names neither
-- api_base_url nor api_secret_ref; every other strategy still names both. `sources` is written
-- only by operators (`hookctl sources apply`): the check is replaced NOT VALID here (no scan
-- under the lock) and validated by the next migration.
ALTER TABLE sources DROP CONSTRAINT sources_gap_strategy_complete;
ALTER TABLE sources ADD CONSTRAINT sources_gap_strategy_complete CHECK (
    gap_strategy IS NULL
    OR ((api_base_url IS NULL) = (api_secret_ref IS NULL)
        AND (api_base_url IS NOT NULL OR gap_strategy = 'sequence')
        AND (gap_strategy <> 'sequence' OR (id_template IS NOT NULL AND sequence_from IS NOT NULL)))) NOT VALID;
