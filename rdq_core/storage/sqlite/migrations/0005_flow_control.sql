-- Flow control (docs/flow-control.md): priority, concurrency and rate keys, tenant groups on
-- tasks; the rate log and the fairness cursor a flow-controlled claim keeps.
ALTER TABLE rdq_tasks ADD COLUMN priority INTEGER NOT NULL DEFAULT 0 CHECK (priority BETWEEN 0 AND 9);
ALTER TABLE rdq_tasks ADD COLUMN concurrency_key TEXT;
ALTER TABLE rdq_tasks ADD COLUMN rate_key TEXT;
ALTER TABLE rdq_tasks ADD COLUMN task_group TEXT;
CREATE INDEX rdq_tasks_claim ON rdq_tasks (queue, priority, next_attempt_at, id) WHERE status = 'PENDING';
CREATE INDEX rdq_tasks_in_flight_key ON rdq_tasks (queue, concurrency_key) WHERE status = 'IN_FLIGHT';
CREATE INDEX rdq_tasks_pending_group ON rdq_tasks (queue, task_group, priority, next_attempt_at, id)
    WHERE status = 'PENDING' AND task_group IS NOT NULL;
CREATE TABLE rdq_rate_log (
    queue      TEXT NOT NULL,
    rate_key   TEXT NOT NULL,
    claimed_at INTEGER NOT NULL,
    task_id    TEXT NOT NULL
);
CREATE INDEX rdq_rate_log_key ON rdq_rate_log (queue, rate_key, claimed_at);
CREATE TABLE rdq_fair_cursor (
    queue      TEXT PRIMARY KEY,
    last_group TEXT NOT NULL
) WITHOUT ROWID;
