-- A source's scheme names an entry of the provider catalogue (shared/providers/*.toml), which
-- grows by adding a file: the list of five the baseline checked would refuse every provider
-- added since. `hookctl sources apply` and the sources cache refuse a name the catalogue does
-- not hold; the table keeps only the name's shape. NOT VALID: every stored row passes the old,
-- narrower check, so nothing is scanned under this migration's lock (sources is written only by
-- operators); the next migration validates the old rows.
ALTER TABLE sources DROP CONSTRAINT sources_scheme_check;
ALTER TABLE sources ADD CONSTRAINT sources_scheme_check
    CHECK (scheme ~ '^[a-z0-9_]{1,64}$') NOT VALID;
