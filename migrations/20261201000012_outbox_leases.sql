-- An outbox row a sender holds: until this time no other sender may take it, and reconcile does
-- not make it due. NULL when no sender holds it. `attempts` counts tries (requests sent), not
-- leases: a lease expires or is handed back without spending one.
ALTER TABLE outbox ADD COLUMN leased_until timestamptz;
