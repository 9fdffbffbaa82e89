-- Validates the operator_actions action check added NOT VALID by the previous migration, in its
-- own transaction: SHARE UPDATE EXCLUSIVE while it scans, writes go on.
ALTER TABLE operator_actions VALIDATE CONSTRAINT operator_actions_action_check;
