-- rdq schema v7: wake idle workers when tasks are enqueued (LISTEN/NOTIFY).
--
-- A statement-level trigger: one NOTIFY per queue that an INSERT made a due task in, on the
-- channel of this schema, payload = the queue name. NOTIFY is delivered when the inserting
-- transaction commits (never before, never for a rolled-back one), and PostgreSQL folds
-- repeats of one channel and payload within a transaction, so a batch costs one notification
-- per queue. Workers listen on one extra connection and keep polling as the fallback.
--
-- Only when the queue had no other due task: a committing NOTIFY holds a cluster-wide lock
-- through its commit's WAL flush, so notifying every enqueue would serialise concurrent
-- producers (measured: 8 producers 520 -> 135 enqueues/s). A queue with due tasks has no idle
-- worker to wake (a worker that finds work claims again before it idles; rdq_core/engine/claiming.py
-- re-checks soon after its last task, for an enqueue that raced its last claim).
-- Nothing existing is rewritten; the enqueue statement itself is unchanged.
CREATE FUNCTION rdq_wake_workers() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(left('rdq_enqueued:' || TG_TABLE_SCHEMA, 63), q.queue)
    FROM (SELECT DISTINCT e.queue FROM rdq_enqueued AS e WHERE e.next_attempt_at <= now()) AS q
    WHERE NOT EXISTS (
        SELECT 1 FROM rdq_tasks AS t
        WHERE t.queue = q.queue AND t.status = 'PENDING' AND t.next_attempt_at <= now()
          AND NOT EXISTS (SELECT 1 FROM rdq_enqueued AS mine WHERE mine.id = t.id));
    RETURN NULL;
END
$$;

CREATE TRIGGER rdq_tasks_wake_workers AFTER INSERT ON rdq_tasks
    REFERENCING NEW TABLE AS rdq_enqueued
    FOR EACH STATEMENT EXECUTE FUNCTION rdq_wake_workers();
