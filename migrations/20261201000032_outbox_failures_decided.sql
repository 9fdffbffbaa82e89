-- An outbox message that failed for good is an effect that never reached the target: it waits
-- for an operator, who resends it (due again with a fresh attempt budget, once the target is
-- fixed) or discards it (the effect is not wanted). Each decision is recorded on the row.
-- Adding columns with constant defaults rewrites nothing.
ALTER TABLE outbox
    ADD COLUMN resent_count integer NOT NULL DEFAULT 0,
    ADD COLUMN resent_at    timestamptz,
    ADD COLUMN discarded_at timestamptz;

-- 'discarded' joins the statuses. NOT VALID: every stored row already passes the narrower old
-- check, so the table is not scanned under this migration's ACCESS EXCLUSIVE lock; new and
-- updated rows are checked at once, and the next migration validates the old ones without
-- blocking writes.
ALTER TABLE outbox DROP CONSTRAINT outbox_status_check;
ALTER TABLE outbox ADD CONSTRAINT outbox_status_check
    CHECK (status IN ('pending', 'delivered', 'failed', 'discarded')) NOT VALID;
