-- Jobs an operator starts over a whole filter of dead letters (replay or discard them all, the
-- console's bulk actions): the estimate counted when it started, its progress, and a cursor
-- (letters are taken in id order), so a job runs in steps of a few seconds (the operator
-- function answers within its timeout) and resumes where it stopped. An abort is seen between
-- steps. A new table; operator_actions gains the two actions, its check added NOT VALID and
-- validated by the next migration, as before.
CREATE TABLE operator_jobs (
    job_id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind          text NOT NULL CHECK (kind IN ('replay_dead_letters', 'discard_dead_letters')),
    filter        jsonb NOT NULL,
    actor         text NOT NULL CHECK (btrim(actor) <> ''),
    reason        text NOT NULL CHECK (btrim(reason) <> ''),
    -- The operator action recording it, finished with the job's counts.
    action_id     bigint NOT NULL,
    -- Open letters matching the filter when it started.
    estimate      bigint NOT NULL,
    done          bigint NOT NULL DEFAULT 0,
    failed        bigint NOT NULL DEFAULT 0,
    skipped       bigint NOT NULL DEFAULT 0,
    -- Letters up to this id were taken.
    after_id      bigint NOT NULL DEFAULT 0,
    status        text NOT NULL DEFAULT 'running' CHECK (status IN ('running', 'finished', 'aborted')),
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz
);

ALTER TABLE operator_actions DROP CONSTRAINT operator_actions_action_check;
ALTER TABLE operator_actions ADD CONSTRAINT operator_actions_action_check
    CHECK (action IN ('replay', 'set_dead_letter_status', 'tombstone', 'resend_outbox',
                      'discard_outbox', 'redrive_buffer', 'file_kept', 'pause_subscription',
                      'resume_subscription', 'replay_to_subscription', 'discard_dead_letters',
                      'abort_job')) NOT VALID;
