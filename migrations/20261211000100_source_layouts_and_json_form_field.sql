-- Two choices a source makes about what it accepts, both optional (NULL: its provider's
-- default):
--
-- accepted_layouts: the names of its provider's signature layouts the source accepts
-- (`layouts = ["v3"]` in a sources file). By default a source accepts every layout of its
-- provider except the legacy ones (HubSpot's v1 and v2: a plain SHA-256 of the secret and the
-- body, no timestamp), so a captured request whose stronger signature was removed is refused.
--
-- json_form_field: the form field a provider's JSON arrives in when it posts a form
-- (`payload` for a GitHub webhook created with content type application/x-www-form-urlencoded,
-- its default). The event is read from, and stored as, that field's JSON; the signature is
-- still verified over the raw form bytes.
--
-- Adding nullable columns without a default changes only the catalog: the ACCESS EXCLUSIVE
-- lock on sources (read through a cache, written by `hookctl sources apply`) is held for the
-- catalog update alone.
ALTER TABLE sources
    ADD COLUMN accepted_layouts text[],
    ADD COLUMN json_form_field text;
