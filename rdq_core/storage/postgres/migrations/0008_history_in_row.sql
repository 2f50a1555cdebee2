-- rdq schema v8: a settle writes one row per task, and the hot statements keep their plans
-- without fresh statistics.
--
-- 1. The attempt history moves into the task row: rdq_tasks.attempts, a jsonb array in attempt
--    order of {attempt_no, outcome, started_at, finished_at, error} (what the API returns). A
--    settle appends its attempt in the same row write that changes the status, numbered from the
--    history (its last attempt_no + 1, never from attempt_count), instead of writing a second row
--    to rdq_attempts with a unique-index entry, a MAX probe and a foreign-key check per task.
--    Numbers stay unique and gap-free: the append happens under the row lock of a fenced settle,
--    and rdq_tasks_attempts_numbered_check holds the last attempt_no equal to the length of the
--    history on every write. Existing history is copied over (every task that has one is
--    rewritten once, which takes a while on a large table) and rdq_attempts is dropped: stop the
--    previous version's workers before migrating, their settles write that table.
-- 2. rdq_tasks_queue_status_idx (queue, status) becomes rdq_tasks_queue_idx (queue) INCLUDE
--    (status): the same index-only counts for stats and the same list_queues skip scan, but
--    status is no longer a key column, so a claim planned without statistics (a new table, or a
--    queue that was empty when it was last analyzed) can no longer pick it and sort the queue's
--    whole backlog instead of walking the claim index.
-- 3. rdq_tasks_in_flight_key_idx folds into rdq_tasks_lease_expiry_idx (INCLUDE
--    (concurrency_key)): a claim writes one index entry fewer per task, and a flow-controlled
--    claim counts in-flight tasks per key with an index-only scan of the same IN_FLIGHT range.
--
-- Like schema 2, the index builds lock rdq_tasks until the migration commits. On a large table
-- build rdq_tasks_queue_idx first with CREATE INDEX CONCURRENTLY under the same name (IF NOT
-- EXISTS then leaves it); the IN_FLIGHT index holds only the tasks in flight and builds quickly.

ALTER TABLE rdq_tasks ADD COLUMN attempts jsonb NOT NULL DEFAULT '[]'::jsonb;

UPDATE rdq_tasks AS t
SET attempts = h.attempts
FROM (
    SELECT a.task_id,
           jsonb_agg(jsonb_build_object(
               'attempt_no', a.attempt_no, 'outcome', a.outcome,
               'started_at', a.started_at, 'finished_at', a.finished_at,
               'error', a.error) ORDER BY a.attempt_no) AS attempts
    FROM rdq_attempts AS a
    GROUP BY a.task_id
) AS h
WHERE t.id = h.task_id;

DROP TABLE rdq_attempts;

ALTER TABLE rdq_tasks ADD CONSTRAINT rdq_tasks_attempts_numbered_check CHECK (
    jsonb_typeof(attempts) = 'array'
    AND (jsonb_array_length(attempts) = 0
         OR (attempts -> -1 ->> 'attempt_no')::integer = jsonb_array_length(attempts))
);

DROP INDEX rdq_tasks_queue_status_idx;
CREATE INDEX IF NOT EXISTS rdq_tasks_queue_idx ON rdq_tasks (queue) INCLUDE (status);

DROP INDEX rdq_tasks_in_flight_key_idx;
DROP INDEX rdq_tasks_lease_expiry_idx;
CREATE INDEX IF NOT EXISTS rdq_tasks_lease_expiry_idx ON rdq_tasks (queue, lease_expires_at, id)
    INCLUDE (concurrency_key) WHERE status = 'IN_FLIGHT';
