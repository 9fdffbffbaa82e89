-- Who asked for each operator state change and why: replay, a dead letter's triage, tombstone,
-- outbox resend and discard each write one row, in the action's own transaction (a replay,
-- which commits letter by letter, writes its row first and finishes it with its counts).
-- `actor` is what the request claims; `invocation` is what the runtime said about the caller
-- (the Lambda request id and function), `{}` for a direct database connection. A new table:
-- nothing else is locked.
CREATE TABLE operator_actions (
    action_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    action text NOT NULL CHECK (action IN ('replay', 'set_dead_letter_status', 'tombstone', 'resend_outbox', 'discard_outbox')),
    actor text NOT NULL CHECK (btrim(actor) <> ''),
    reason text NOT NULL CHECK (btrim(reason) <> ''),
    via text NOT NULL CHECK (via IN ('hookctl', 'function', 'local_runner', 'direct')),
    invocation jsonb NOT NULL DEFAULT '{}',
    request jsonb NOT NULL,
    affected jsonb NOT NULL CHECK (jsonb_typeof(affected) = 'array'),
    outcome jsonb,
    requested_at timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);

COMMENT ON TABLE operator_actions IS 'Every operator state change: who asked (claimed), why, how it came in, what it touched. Kept: retention does not prune it.';
