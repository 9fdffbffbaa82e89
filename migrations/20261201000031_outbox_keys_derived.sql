-- An outbox row's Idempotency-Key is the SHA-256 of its (tenant_id, external_id, action)
-- (effects::outbox_key), and UNIQUE (tenant_id, external_id, action) already admits each of
-- those once, so the keys are unique without an index of their own. That index was a second
-- unique B-tree over 64-character digests, in random order, that no query reads: every
-- announced change paid an insertion at a random leaf of it (a quarter of the cost of writing
-- an outbox row, measured with pgbench on a million-row outbox), and the table grows with every
-- processed event until retention takes it.
ALTER TABLE outbox DROP CONSTRAINT outbox_idempotency_key_key;
