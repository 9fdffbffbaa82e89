-- no-transaction
-- `outbox_due` holds the same rows in the same first column; every read that used this index
-- (status's counts, the oldest undelivered age, reconcile's hurry, the anomaly checks) uses
-- that one, and each write of a pending message no longer maintains two.
DROP INDEX CONCURRENTLY IF EXISTS outbox_undelivered;
