-- rdq schema v6: snooze (a SNOOZED outcome) and enqueue-time dedupe (a dedupe_key on tasks).
--
-- The outcome check is replaced in place; the ALTER holds the history table's lock while it
-- re-checks the existing rows (one scan, no rewrite).
ALTER TABLE rdq_attempts
    DROP CONSTRAINT rdq_attempts_outcome_check,
    ADD CONSTRAINT rdq_attempts_outcome_check
        CHECK (outcome IN ('SUCCESS', 'RETRYABLE_FAILURE', 'PERMANENT_FAILURE', 'LEASE_EXPIRED', 'SNOOZED'));

-- Enqueue-time dedupe: the key a task was enqueued with, and the index an enqueue's match walks
-- (newest first within one queue and key). A new nullable column is a catalog change only; the
-- index holds only keyed tasks.
ALTER TABLE rdq_tasks ADD COLUMN dedupe_key text COLLATE "C";
CREATE INDEX rdq_tasks_dedupe_idx ON rdq_tasks (queue, dedupe_key, created_at, id)
    WHERE dedupe_key IS NOT NULL;
