-- An operator's redrive of the SQS buffer's dead letters (`hookctl buffer redrive`) is recorded
-- like every other state change. NOT VALID: every stored row passes the narrower old check, so
-- nothing is scanned under this migration's lock (operator_actions is written only by operators);
-- the next migration validates the old rows.
ALTER TABLE operator_actions DROP CONSTRAINT operator_actions_action_check;
ALTER TABLE operator_actions ADD CONSTRAINT operator_actions_action_check
    CHECK (action IN ('replay', 'set_dead_letter_status', 'tombstone', 'resend_outbox',
                      'discard_outbox', 'redrive_buffer')) NOT VALID;
