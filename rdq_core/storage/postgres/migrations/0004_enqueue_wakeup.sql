-- rdq schema v4: wake idle workers when tasks are enqueued (LISTEN/NOTIFY).
--
-- A statement-level trigger: one NOTIFY per queue that an INSERT made a due task in, on the
-- channel of this schema, payload = the queue name. NOTIFY is delivered when the inserting
-- transaction commits (never before, never for a rolled-back one), and PostgreSQL folds
-- repeats of one channel and payload within a transaction, so a batch costs one notification
-- per queue. Workers listen on one extra connection and keep polling as the fallback.
-- Nothing existing is rewritten; the enqueue statement itself is unchanged.
CREATE FUNCTION rdq_wake_workers() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(left('rdq_enqueued:' || TG_TABLE_SCHEMA, 63), q.queue)
    FROM (SELECT DISTINCT e.queue FROM rdq_enqueued AS e WHERE e.next_attempt_at <= now()) AS q;
    RETURN NULL;
END
$$;

CREATE TRIGGER rdq_tasks_wake_workers AFTER INSERT ON rdq_tasks
    REFERENCING NEW TABLE AS rdq_enqueued
    FOR EACH STATEMENT EXECUTE FUNCTION rdq_wake_workers();
