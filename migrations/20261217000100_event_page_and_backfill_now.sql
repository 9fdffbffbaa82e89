-- Two facts of an event's filing that its page in the console shows (issue 48), kept beside
-- webhook_events rather than in it (adding a column would lock that table against the live
-- writes of a deploy):
--
-- verified_layout: the name of the provider's signature layout that verified the stored payload
-- (HubSpot's `v3`), for a provider with several; no row for a provider with one, a declared
-- source, or an event stored before this table.
--
-- buffered_deliveries: how many of its deliveries the SQS buffer's consumer filed (no row:
-- none, or stored before this table): the event came through the buffer.
--
-- Written by the statements that store events, in the same statement; deleted with the event's
-- identity by retention. A new table.
CREATE TABLE event_filings (
    tenant_id           text NOT NULL,
    external_id         text NOT NULL,
    verified_layout     text,
    buffered_deliveries integer NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, external_id)
);

-- backfill_requested_at: an operator asked for this gap to be fetched now (`backfill_gap`, the
-- console's "Backfill now"): the next backfill pass fetches it without waiting out its
-- source's grace period. A nullable column on a small table.
ALTER TABLE gap_candidates ADD COLUMN backfill_requested_at timestamptz;

-- operator_actions gains the request, its check added NOT VALID and validated by the next
-- migration, as before.
ALTER TABLE operator_actions DROP CONSTRAINT operator_actions_action_check;
ALTER TABLE operator_actions ADD CONSTRAINT operator_actions_action_check
    CHECK (action IN ('replay', 'set_dead_letter_status', 'tombstone', 'resend_outbox',
                      'discard_outbox', 'redrive_buffer', 'file_kept', 'pause_subscription',
                      'resume_subscription', 'replay_to_subscription', 'discard_dead_letters',
                      'abort_job', 'backfill_gap')) NOT VALID;
