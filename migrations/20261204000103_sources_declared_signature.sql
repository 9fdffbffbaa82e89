-- A source for a provider not in the catalogue declares its signature from the catalogue's
-- primitives (`[source.signature]` in a sources file, scheme = "declared"): the layout, as JSON,
-- validated by `hookctl sources apply` before it is stored. NULL: the scheme's own layouts.
-- A nullable column without a default: no rewrite, no scan.
ALTER TABLE sources ADD COLUMN declared_signature jsonb;
