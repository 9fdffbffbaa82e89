-- A delivery kept as an ingest anomaly with its signed payload, for which no event was stored
-- (the buffer's consumer could not read it, or, before such deliveries were filed, its source
-- was disabled meanwhile), filed later by an operator (`hookctl buffer file-kept`): when, and
-- under which event id. The anomaly check that counts unfiled buffered deliveries stops counting
-- it, and filing it twice is refused.
--
-- Nullable columns without a default: a catalog change only, under a lock held for that alone.
ALTER TABLE ingest_anomalies
    ADD COLUMN filed_at timestamptz,
    ADD COLUMN filed_as text;

-- Filing one is an operator's state change, recorded like every other. NOT VALID: every stored
-- row passes the narrower old check, so nothing is scanned under this lock (operator_actions is
-- written only by operators); the next migration validates the old rows.
ALTER TABLE operator_actions DROP CONSTRAINT operator_actions_action_check;
ALTER TABLE operator_actions ADD CONSTRAINT operator_actions_action_check
    CHECK (action IN ('replay', 'set_dead_letter_status', 'tombstone', 'resend_outbox',
                      'discard_outbox', 'redrive_buffer', 'file_kept')) NOT VALID;
