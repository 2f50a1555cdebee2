-- A handler may snooze a task (a SNOOZED attempt in its history, no budget spent). SQLite cannot
-- change a CHECK in place: the history table is rebuilt with the wider check and its rows copied
-- (nothing references it, so the copy keeps every foreign key true).
CREATE TABLE rdq_attempts_v6 (
    task_id     TEXT NOT NULL REFERENCES rdq_tasks(id) ON DELETE CASCADE,
    attempt_no  INTEGER NOT NULL CHECK (attempt_no >= 1),
    outcome     TEXT NOT NULL CHECK (outcome IN ('SUCCESS','RETRYABLE_FAILURE','PERMANENT_FAILURE','LEASE_EXPIRED','SNOOZED')),
    started_at  INTEGER,
    finished_at INTEGER,
    error       TEXT,
    PRIMARY KEY (task_id, attempt_no)
);
INSERT INTO rdq_attempts_v6 (task_id, attempt_no, outcome, started_at, finished_at, error)
SELECT task_id, attempt_no, outcome, started_at, finished_at, error FROM rdq_attempts;
DROP TABLE rdq_attempts;
ALTER TABLE rdq_attempts_v6 RENAME TO rdq_attempts;
-- Enqueue-time dedupe: the key a task was enqueued with, and the index the match walks (newest
-- first within one queue and key). Tasks without a key are not in it.
ALTER TABLE rdq_tasks ADD COLUMN dedupe_key TEXT;
CREATE INDEX rdq_tasks_dedupe ON rdq_tasks (queue, dedupe_key, created_at, id) WHERE dedupe_key IS NOT NULL;
