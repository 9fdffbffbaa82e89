-- Validates the outbox status check added NOT VALID by the previous migration. In its own
-- migration (its own transaction) it holds only SHARE UPDATE EXCLUSIVE while it scans: the
-- drain keeps writing outbox rows and the sender keeps delivering them meanwhile.
ALTER TABLE outbox VALIDATE CONSTRAINT outbox_status_check;
