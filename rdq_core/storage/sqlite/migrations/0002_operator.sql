-- Operator views: every status of a queue listed in its own order, paused queues, the audit trail.
-- The due index gains the id tie-break, so the claim's ORDER BY and a PENDING listing are served
-- by the index alone; finished tasks get a per-queue index for their listing (retention keeps its
-- own, across queues). IN_FLIGHT listings use the lease index: in-flight tasks are bounded by the
-- workers' batches.
DROP INDEX rdq_tasks_due;
CREATE INDEX rdq_tasks_due ON rdq_tasks (queue, next_attempt_at, id) WHERE status = 'PENDING';
CREATE INDEX rdq_tasks_finished_by_queue ON rdq_tasks (queue, status, updated_at, id)
    WHERE status IN ('SUCCEEDED','CANCELLED');
CREATE TABLE rdq_paused_queues (
    queue     TEXT PRIMARY KEY,
    paused_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE rdq_audit (
    id        TEXT PRIMARY KEY,
    at        INTEGER NOT NULL,
    actor     TEXT NOT NULL,
    action    TEXT NOT NULL,
    queue     TEXT NOT NULL,
    selection TEXT NOT NULL,
    count     INTEGER NOT NULL
);
CREATE INDEX rdq_audit_by_time ON rdq_audit (at, id);
CREATE INDEX rdq_audit_by_queue ON rdq_audit (queue, at, id);
