-- The URL a provider that signs the URL it calls (Twilio, Square, HubSpot v2/v3) has configured
-- for a source, when it is not the one API Gateway sees (a custom domain, a proxy in front).
-- NULL: the URL is the request's own. A nullable column without a default: no rewrite, no scan.
ALTER TABLE sources ADD COLUMN signed_url text;
