-- rdq schema v2: operator features -- keyset listing of any status, paused queues, audit trail.
--
-- Every status of a queue is now listed by (its instant, id), so each needs an index that
-- serves (queue, status, instant, id): PENDING gains id as the tie-break (tasks enqueued by one
-- statement share next_attempt_at, and the claim walks the same order); the IN_FLIGHT index is
-- led by the queue instead of shared by all queues (the reaper across queues walks it queue by
-- queue), so a claim still adds one index entry per task; the finished statuses get one of their
-- own; DEAD already has one.
--
-- The runner applies a migration in one transaction, and DROP INDEX locks rdq_tasks against
-- reads and writes until it commits, so workers wait for the index builds below. The two
-- redefined indexes hold only PENDING and IN_FLIGHT rows; rdq_tasks_finished_idx holds every
-- retained finished task. On a large table, build that one first with CREATE INDEX CONCURRENTLY
-- under the same name and definition (IF NOT EXISTS then leaves it as it is).

-- claim (oldest due first, then id) and PENDING listings.
DROP INDEX rdq_tasks_pending_due_idx;
CREATE INDEX rdq_tasks_pending_due_idx ON rdq_tasks (queue, next_attempt_at, id)
    WHERE status = 'PENDING';

-- The reaper (of one queue, or queue by queue) and IN_FLIGHT listings.
DROP INDEX rdq_tasks_lease_expiry_idx;
CREATE INDEX rdq_tasks_lease_expiry_idx ON rdq_tasks (queue, lease_expires_at, id)
    WHERE status = 'IN_FLIGHT';

-- SUCCEEDED and CANCELLED listings of one queue (retention keeps rdq_tasks_retention_idx).
CREATE INDEX IF NOT EXISTS rdq_tasks_finished_idx ON rdq_tasks (queue, status, updated_at, id)
    WHERE status IN ('SUCCEEDED', 'CANCELLED');

-- A row per paused queue. The claim reads it by primary key inside its own statement.
CREATE TABLE rdq_paused_queues (
    queue     text COLLATE "C" NOT NULL,
    paused_at timestamptz NOT NULL DEFAULT now(),

    CONSTRAINT rdq_paused_queues_pkey PRIMARY KEY (queue)
);

-- Append-only: who did what to which queue, when (the database clock), with what selection
-- (JSON text, kept as given) and how many tasks it changed.
CREATE TABLE rdq_audit_log (
    id        text COLLATE "C" NOT NULL,
    at        timestamptz NOT NULL DEFAULT now(),
    actor     text NOT NULL,
    action    text NOT NULL,
    queue     text COLLATE "C" NOT NULL,
    selection text NOT NULL,
    count     bigint NOT NULL,

    CONSTRAINT rdq_audit_log_pkey PRIMARY KEY (id),
    CONSTRAINT rdq_audit_log_count_check CHECK (count >= 0)
);

-- Newest first by (at, id): across queues, and within one.
CREATE INDEX rdq_audit_log_at_idx ON rdq_audit_log (at, id);
CREATE INDEX rdq_audit_log_queue_at_idx ON rdq_audit_log (queue, at, id);
