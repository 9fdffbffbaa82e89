-- Validates the checks the previous migration added NOT VALID (sources.address_check, and
-- maintenance_runs.job with `address_ranges`), in their own transaction: SHARE UPDATE
-- EXCLUSIVE while each scans, reads and writes go on.
ALTER TABLE sources VALIDATE CONSTRAINT sources_address_check_check;
ALTER TABLE maintenance_runs VALIDATE CONSTRAINT maintenance_runs_job_check;
