-- rdq schema v9: who holds a running task's claim. Numbered 9 to share its step with
-- PostgreSQL's 0009_claimed_by.sql (steps 7 and 8 are PostgreSQL's alone).
--
-- A claim stores the claimer's name beside claimed_at (NULL when it gave none); the task page
-- and `rdq task show` read it while the task is in flight. A column that may be NULL: workers
-- of the previous version keep claiming and simply leave it empty.
ALTER TABLE rdq_tasks ADD COLUMN claimed_by TEXT;
