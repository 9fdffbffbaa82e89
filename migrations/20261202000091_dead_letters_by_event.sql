-- no-transaction
-- Retention deletes an event together with its closed dead letters, and looks up whether
-- any letter of an event is open or recently closed: by event, which only the open letters'
-- partial index covered. The deletes' foreign-key check uses it as well.
CREATE INDEX CONCURRENTLY IF NOT EXISTS dead_letters_by_event ON dead_letters (tenant_id, external_id);
