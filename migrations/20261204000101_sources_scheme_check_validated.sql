-- Validates the sources scheme check added NOT VALID by the previous migration, in its own
-- transaction: SHARE UPDATE EXCLUSIVE while it scans, reads and writes go on.
ALTER TABLE sources VALIDATE CONSTRAINT sources_scheme_check;
