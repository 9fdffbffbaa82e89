-- Validates the gap settings' check replaced NOT VALID by 20261218000100: every stored source
-- passed the stricter check it replaces, so none fails this one. VALIDATE takes a lock that
-- lets reads and writes of `sources` go on.
ALTER TABLE sources VALIDATE CONSTRAINT sources_gap_strategy_complete;
