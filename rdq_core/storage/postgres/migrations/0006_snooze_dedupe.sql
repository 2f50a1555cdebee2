-- rdq schema v6: a handler may snooze a task (a SNOOZED attempt in its history, no budget spent).
--
-- The outcome check is replaced in place; the ALTER holds the history table's lock while it
-- re-checks the existing rows (one scan, no rewrite).
ALTER TABLE rdq_attempts
    DROP CONSTRAINT rdq_attempts_outcome_check,
    ADD CONSTRAINT rdq_attempts_outcome_check
        CHECK (outcome IN ('SUCCESS', 'RETRYABLE_FAILURE', 'PERMANENT_FAILURE', 'LEASE_EXPIRED', 'SNOOZED'));
