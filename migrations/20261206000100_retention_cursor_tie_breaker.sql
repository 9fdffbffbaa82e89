-- The payload purge's cursor names an instant (`through`); more events received at one instant
-- than a batch held it there for good, and every run stopped at the same place. It now also
-- names the last event examined at that instant (`after_*`), so a batch resumes after it.
--
-- The three columns are read only when `after_at` equals `through`: a previous build rolled back
-- to moves `through` alone, and the cursor it leaves is then read as it reads it (every event
-- at `through` examined again).
--
-- retention_cursors is a table of one row per purge: no lock here touches webhook_events.
ALTER TABLE retention_cursors
    ADD COLUMN after_at timestamptz,
    ADD COLUMN after_tenant_id text,
    ADD COLUMN after_external_id text;
