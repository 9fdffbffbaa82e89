-- GitHub never retries a failed delivery; its recovery is to list the hook's deliveries and ask
-- for the failed ones again. A github_deliveries source names its hook (a repository's,
-- an organisation's, or a GitHub App's /app/hook with the App's id).
ALTER TABLE sources
    ADD COLUMN github_hook text,
    ADD COLUMN github_app_id text;
ALTER TABLE sources DROP CONSTRAINT sources_gap_strategy_check;
ALTER TABLE sources ADD CONSTRAINT sources_gap_strategy_check
    CHECK (gap_strategy IN ('sequence', 'list_api', 'github_deliveries'));
ALTER TABLE sources ADD CONSTRAINT sources_github_hook_complete
    CHECK ((gap_strategy = 'github_deliveries') = (github_hook IS NOT NULL)
           AND (github_app_id IS NULL OR github_hook = '/app/hook'));

-- A GitHub gap is filled by GitHub: provider_ref is the delivery to redeliver (its numeric id),
-- redelivery_requested_at when it was last asked for. A candidate whose redelivery arrived is
-- closed as 'redelivered'.
ALTER TABLE gap_candidates
    ADD COLUMN provider_ref text,
    ADD COLUMN redelivery_requested_at timestamptz;
ALTER TABLE gap_candidates DROP CONSTRAINT gap_candidates_status_check;
ALTER TABLE gap_candidates ADD CONSTRAINT gap_candidates_status_check
    CHECK (status IN ('open', 'arrived', 'backfilled', 'tombstoned', 'redelivered'));
