-- rdq schema v5: flow control (docs/flow-control.md) -- priority, concurrency and rate keys,
-- tenant groups on tasks; the rate log and the fairness cursor a flow-controlled claim keeps.
--
-- The new columns have constant defaults (or none): adding them rewrites nothing. The new
-- claim index is built while the table is locked for writes; on a large installation build it
-- first with CREATE INDEX CONCURRENTLY under the same name (this step then skips it).
ALTER TABLE rdq_tasks
    ADD COLUMN priority        smallint NOT NULL DEFAULT 0,
    ADD COLUMN concurrency_key text COLLATE "C",
    ADD COLUMN rate_key        text COLLATE "C",
    ADD COLUMN task_group      text COLLATE "C",
    ADD CONSTRAINT rdq_tasks_priority_check CHECK (priority BETWEEN 0 AND 9);

-- claim: due PENDING tasks of one queue by priority, then due time, then id; the claim walks it
-- one priority at a time, each walk a range scan that stops at the first task not yet due.
CREATE INDEX IF NOT EXISTS rdq_tasks_pending_claim_idx ON rdq_tasks (queue, priority, next_attempt_at, id)
    WHERE status = 'PENDING';

-- a flow-controlled claim's in-flight counts per concurrency key.
CREATE INDEX IF NOT EXISTS rdq_tasks_in_flight_key_idx ON rdq_tasks (queue, concurrency_key)
    WHERE status = 'IN_FLIGHT';

-- fair_groups: the groups of a queue with PENDING tasks (a skip scan), then each group's next
-- due tasks.
CREATE INDEX IF NOT EXISTS rdq_tasks_pending_group_idx ON rdq_tasks (queue, task_group, priority, next_attempt_at, id)
    WHERE status = 'PENDING' AND task_group IS NOT NULL;

-- rate_limit: the claim times of one queue's rate keys within the longest period, a sliding log
-- (rows older than the period are deleted by the claims that read them).
CREATE TABLE rdq_rate_log (
    queue      text COLLATE "C" NOT NULL,
    rate_key   text COLLATE "C" NOT NULL,
    claimed_at timestamptz NOT NULL,
    task_id    text COLLATE "C" NOT NULL
);
CREATE INDEX rdq_rate_log_key_idx ON rdq_rate_log (queue, rate_key, claimed_at);

-- fair_groups: the group a queue's last claim served last; the next one starts after it.
CREATE TABLE rdq_fair_cursor (
    queue      text COLLATE "C" NOT NULL,
    last_group text COLLATE "C" NOT NULL,

    CONSTRAINT rdq_fair_cursor_pkey PRIMARY KEY (queue)
);
