-- Issue 26, after a review of the consistency sweep (20261208000100): what the sweep finds is
-- kept until it is repaired.
--
-- pending_without_queue_row and processed_without_projection reported what the latest window
-- of the sweep found: a fault counted in one run read 0 at the next, with nothing repaired
-- (the whole-day statements before the sweep counted it on every run until it was). Each event
-- the sweep finds faulty is now kept here; every anomaly run checks a bounded batch of them
-- again (least recently checked first) and drops those repaired or no longer of the last day;
-- the two checks count what is kept.
--
-- This build's sweep also walks each cycle newest first. consistency_sweep keeps its columns:
-- through_* is still the last event examined and reached_present says the cycle ended. A
-- previous build rolled back to reads that row as before, and its checks read the latest
-- window's finds from it, which this build still writes.
--
-- A new table: nothing here reads or locks webhook_events.
CREATE TABLE consistency_findings (
    -- The anomaly check the event fails: pending_without_queue_row or processed_without_projection.
    check_name        text NOT NULL,
    tenant_id         text NOT NULL,
    external_id       text NOT NULL,
    first_received_at timestamptz NOT NULL,
    -- When the sweep found it, and when a run last found it still faulty.
    found_at          timestamptz NOT NULL,
    checked_at        timestamptz NOT NULL,
    PRIMARY KEY (check_name, tenant_id, external_id)
);
CREATE INDEX consistency_findings_least_recently_checked ON consistency_findings (checked_at);
