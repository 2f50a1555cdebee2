-- The rdq schema as all of migrations/ leave it, in one file: what to read to know the tables.
-- `rdq migrate` is what installs and upgrades a store (it applies migrations/ in order and
-- records them in rdq_schema_version, a table of its own); tests/backends/test_postgres_schema.py
-- checks that this file and the migrations give the same catalog. A new migration updates this
-- file in the same change.
--
-- Objects are created unqualified so they land in the connection's current schema
-- (search_path); several rdq installations can share one database in separate schemas.
-- Ids and queue names use the "C" collation: byte order is what ULIDs sort by, and it keeps
-- DLQ keyset paging independent of the database's locale.

CREATE TABLE rdq_tasks (
    id               text COLLATE "C" NOT NULL,
    queue            text COLLATE "C" NOT NULL,
    handler          text NOT NULL,
    payload          jsonb,
    headers          jsonb NOT NULL DEFAULT '{}'::jsonb,
    status           text NOT NULL,
    attempt_count    integer NOT NULL DEFAULT 0,
    redrive_count    integer NOT NULL DEFAULT 0,
    max_attempts     integer,
    backoff          jsonb,
    next_attempt_at  timestamptz NOT NULL,
    claim_token      text,
    claimed_at       timestamptz,           -- when the current (or last) claim was stamped
    lease_expires_at timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    dead_at          timestamptz,
    result           jsonb,
    last_error       jsonb,
    -- flow control (docs/flow-control.md)
    priority         smallint NOT NULL DEFAULT 0,   -- lower runs first
    concurrency_key  text COLLATE "C",
    rate_key         text COLLATE "C",
    task_group       text COLLATE "C",
    -- enqueue-time dedupe (docs/flow-control.md)
    dedupe_key       text COLLATE "C",
    -- the attempt history in attempt order (schema 8): {attempt_no, outcome, started_at,
    -- finished_at, error} each, appended by the settle that ends the attempt
    attempts         jsonb NOT NULL DEFAULT '[]'::jsonb,
    -- who holds the claim, as the claimer named itself (schema 9); NULL: no name, or no claim
    claimed_by       text,

    CONSTRAINT rdq_tasks_pkey PRIMARY KEY (id),
    CONSTRAINT rdq_tasks_status_check
        CHECK (status IN ('PENDING', 'IN_FLIGHT', 'SUCCEEDED', 'DEAD', 'CANCELLED')),
    CONSTRAINT rdq_tasks_attempt_count_check CHECK (attempt_count >= 0),
    CONSTRAINT rdq_tasks_redrive_count_check CHECK (redrive_count >= 0),
    CONSTRAINT rdq_tasks_max_attempts_check CHECK (max_attempts IS NULL OR max_attempts >= 1),
    -- A claim exists exactly while the task is in flight: fencing relies on a settled or
    -- released task holding no token that could still match.
    CONSTRAINT rdq_tasks_claim_check CHECK (
        (status = 'IN_FLIGHT' AND claim_token IS NOT NULL AND lease_expires_at IS NOT NULL)
        OR (status <> 'IN_FLIGHT' AND claim_token IS NULL AND lease_expires_at IS NULL)
    ),
    CONSTRAINT rdq_tasks_dead_at_check CHECK ((status = 'DEAD') = (dead_at IS NOT NULL)),
    CONSTRAINT rdq_tasks_priority_check CHECK (priority BETWEEN 0 AND 9),
    -- History is unique and gap-free per task: attempt_no is the last attempt_no + 1 (never a
    -- counter), so the last one always equals the number of attempts.
    CONSTRAINT rdq_tasks_attempts_numbered_check CHECK (
        jsonb_typeof(attempts) = 'array'
        AND (jsonb_array_length(attempts) = 0
             OR (attempts -> -1 ->> 'attempt_no')::integer = jsonb_array_length(attempts))
    )
);

-- Partial indexes: each hot path scans only the rows in the state it looks for, so its cost
-- follows the batch size, not the size of the backlog or of the retained history.

-- Each status of a queue is listed by (its instant, id); one index per status serves that
-- order: PENDING by next_attempt_at, IN_FLIGHT by lease_expires_at, DEAD by dead_at, SUCCEEDED and
-- CANCELLED by updated_at.

-- stats: oldest due age; PENDING listings.
CREATE INDEX rdq_tasks_pending_due_idx ON rdq_tasks (queue, next_attempt_at, id)
    WHERE status = 'PENDING';

-- claim: due PENDING tasks of one queue by priority, then due time, then id; the claim walks it
-- one priority at a time, each walk a range scan that stops at the first task not yet due.
CREATE INDEX rdq_tasks_pending_claim_idx ON rdq_tasks (queue, priority, next_attempt_at, id)
    WHERE status = 'PENDING';

-- fair_groups: the groups of a queue with PENDING tasks (a skip scan), then each group's next
-- due tasks.
CREATE INDEX rdq_tasks_pending_group_idx ON rdq_tasks (queue, task_group, priority, next_attempt_at, id)
    WHERE status = 'PENDING' AND task_group IS NOT NULL;

-- dedupe: an enqueue's match, newest first within one queue and dedupe_key (keyed tasks only).
CREATE INDEX rdq_tasks_dedupe_idx ON rdq_tasks (queue, dedupe_key, created_at, id)
    WHERE dedupe_key IS NOT NULL;

-- reaper: IN_FLIGHT tasks whose lease expired, oldest expiry first, in one queue or queue by
-- queue (a skip scan over this index); IN_FLIGHT listings; a flow-controlled claim's in-flight
-- counts per concurrency key (index-only, hence the INCLUDE).
CREATE INDEX rdq_tasks_lease_expiry_idx ON rdq_tasks (queue, lease_expires_at, id)
    INCLUDE (concurrency_key) WHERE status = 'IN_FLIGHT';

-- DLQ keyset paging by (dead_at, id) within a queue.
CREATE INDEX rdq_tasks_dead_idx ON rdq_tasks (queue, dead_at, id)
    WHERE status = 'DEAD';

-- SUCCEEDED and CANCELLED listings of one queue.
CREATE INDEX rdq_tasks_finished_idx ON rdq_tasks (queue, status, updated_at, id)
    WHERE status IN ('SUCCEEDED', 'CANCELLED');

-- retention: finished tasks by age.
CREATE INDEX rdq_tasks_retention_idx ON rdq_tasks (updated_at)
    WHERE status IN ('SUCCEEDED', 'CANCELLED');

-- stats counts per status and the list_queues skip scan, both index-only. status is included,
-- not a key column: a claim planned without statistics must not be able to pick this index over
-- the claim index (and sort the queue's backlog).
CREATE INDEX rdq_tasks_queue_idx ON rdq_tasks (queue) INCLUDE (status);

-- A row per paused queue: the claim reads it by primary key inside its own statement, and a
-- paused queue's claim returns nothing.
CREATE TABLE rdq_paused_queues (
    queue     text COLLATE "C" NOT NULL,
    paused_at timestamptz NOT NULL DEFAULT now(),

    CONSTRAINT rdq_paused_queues_pkey PRIMARY KEY (queue)
);

-- The operators' audit trail, append-only: who did what to which queue, when (the database
-- clock), with what selection (JSON text, kept as given) and how many tasks it changed.
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

-- Engine documents: small versioned JSON documents (bulk operations and their per-queue locks),
-- written by compare-and-set on version. The body is the JSON text as given (text, not jsonb,
-- so it reads back byte for byte); the primary key serves get, put, delete and paging by key
-- in byte order.
CREATE TABLE rdq_documents (
    kind    text COLLATE "C" NOT NULL,
    key     text COLLATE "C" NOT NULL,
    version bigint NOT NULL,
    body    text NOT NULL,

    CONSTRAINT rdq_documents_pkey PRIMARY KEY (kind, key),
    CONSTRAINT rdq_documents_version_check CHECK (version >= 1)
);

-- The outbox of lifecycle events: written by the settle and redrive statements with the change,
-- taken in write order (seq) under a short lease, deleted once delivered; one row per event id.
CREATE TABLE rdq_outbox (
    seq          bigint GENERATED ALWAYS AS IDENTITY,
    id           text COLLATE "C" NOT NULL,
    type         text NOT NULL,
    queue        text NOT NULL,
    task_id      text,
    at           timestamptz NOT NULL,
    detail       jsonb NOT NULL,
    leased_until timestamptz NOT NULL DEFAULT '-infinity',

    CONSTRAINT rdq_outbox_pkey PRIMARY KEY (seq),
    CONSTRAINT rdq_outbox_id_key UNIQUE (id)
);

-- rate_limit: the claim times of one queue's rate keys within the period, a sliding log (rows
-- older than the period are deleted by the claims that read them).
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

-- Idle workers wake on enqueue: one NOTIFY per queue that an INSERT made a due task in and that
-- had no other due task, on this schema's channel (payload: the queue), delivered at commit.
-- See migrations/0007 (why only then).
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

-- The flow-controlled claim under concurrency limits (migrations/0010 says why a function).
CREATE FUNCTION rdq_flow_claim_at_once(
    p_queue text, p_limit integer, p_lease_seconds double precision, p_worker text, p_key_limits jsonb,
    p_default_limit integer, p_max_in_flight integer, p_aging double precision, p_candidates integer,
    p_total integer, p_lock_namespace integer
) RETURNS SETOF rdq_tasks LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz;
    v_left integer := p_limit;
    v_pass record;
    v_more boolean;
    v_taken integer;
BEGIN
    -- Serialised with the queue's other flow-controlled claims until COMMIT; every statement
    -- below takes its snapshot once the lock is held, and the claim's time is read after it.
    PERFORM pg_advisory_xact_lock(p_lock_namespace, hashtext(p_queue));
    v_now := clock_timestamp();
    IF EXISTS (SELECT FROM rdq_paused_queues AS q WHERE q.queue = p_queue) THEN
        RETURN;
    END IF;
    LOOP
        v_taken := 0;
        v_more := false;
        FOR v_pass IN
            WITH clock AS MATERIALIZED (SELECT v_now AS now),
            running AS MATERIALIZED (
                SELECT concurrency_key AS key, count(*) AS n,
                       coalesce((p_key_limits::jsonb ->> concurrency_key)::int, p_default_limit::int) AS cap
                FROM rdq_tasks
                WHERE queue = p_queue AND status = 'IN_FLIGHT'
                GROUP BY concurrency_key
            ),
            budget AS MATERIALIZED (
                SELECT greatest(0, least(v_left, coalesce(p_max_in_flight - (SELECT coalesce(sum(n), 0) FROM running)::int,
                                                          v_left))) AS n
            ),
            full_keys AS MATERIALIZED (
                SELECT coalesce(array_agg(key), '{}'::text[]) AS keys FROM running
                WHERE key IS NOT NULL AND cap IS NOT NULL AND n >= cap
            ),
            candidates AS MATERIALIZED (
                SELECT due.*
                FROM generate_series(0, 9) AS p(priority)
                CROSS JOIN LATERAL (
                    SELECT id, priority, next_attempt_at, concurrency_key
                    FROM rdq_tasks
                    WHERE queue = p_queue AND status = 'PENDING' AND priority = p.priority
                      AND next_attempt_at <= (SELECT now FROM clock)
                      AND (concurrency_key IS NULL OR concurrency_key <> ALL ((SELECT keys FROM full_keys)::text[]))
                    ORDER BY next_attempt_at, id
                    LIMIT p_candidates
                ) AS due
                WHERE (SELECT n FROM budget) > 0
                LIMIT p_total
            ),
            ranked AS (
                -- cap: the task's key's limit (NULL: the key is not limited).
                SELECT c.id, c.concurrency_key,
                       coalesce((p_key_limits::jsonb ->> c.concurrency_key)::int, p_default_limit::int) AS cap,
                       CASE WHEN p_aging::float8 IS NULL THEN c.priority ELSE 0 END AS first,
                       c.next_attempt_at + coalesce(p_aging::float8, 0) * c.priority * interval '1 second' AS second
                FROM candidates AS c
            ),
            allowed AS (
                SELECT r.id
                FROM (SELECT r.*, row_number() OVER (PARTITION BY r.concurrency_key ORDER BY r.first, r.second, r.id) AS nth
                      FROM ranked AS r) AS r
                LEFT JOIN running ON running.key = r.concurrency_key
                WHERE r.concurrency_key IS NULL OR r.cap IS NULL OR coalesce(running.n, 0) + r.nth <= r.cap
                ORDER BY r.first, r.second, r.id
                LIMIT (SELECT n FROM budget)
            ),
            claimed AS (
                UPDATE rdq_tasks
                SET status = 'IN_FLIGHT',
                    claim_token = gen_random_uuid()::text,
                    claimed_at = (SELECT now FROM clock),
                    claimed_by = NULLIF(p_worker::text, ''),
                    lease_expires_at = (SELECT now FROM clock) + p_lease_seconds * interval '1 second',
                    updated_at = (SELECT now FROM clock)
                WHERE id = ANY (ARRAY(
                    SELECT id FROM rdq_tasks
                    WHERE id IN (SELECT id FROM allowed) AND status = 'PENDING'
                    ORDER BY id
                    FOR UPDATE
                )) AND status = 'PENDING'
                RETURNING *
            ),
            -- A pass cut short where a candidate window filled up (with tasks of keys that filled
            -- during this choice) may have left allowed tasks behind the window: more_behind says
            -- whether one exists, and the loop then passes again.
            filled AS MATERIALIZED (
                SELECT coalesce(array_agg(k.key), '{}'::text[]) AS keys
                FROM (SELECT r.concurrency_key AS key, r.cap, count(*) AS chosen FROM ranked AS r
                      WHERE r.concurrency_key IS NOT NULL AND r.id IN (SELECT id FROM allowed)
                      GROUP BY r.concurrency_key, r.cap) AS k
                LEFT JOIN running ON running.key = k.key
                WHERE coalesce(running.n, 0) + k.chosen >= k.cap
            ),
            more_behind AS MATERIALIZED (
                SELECT (SELECT count(*) FROM allowed) < (SELECT n FROM budget)
                   AND ((SELECT count(*) FROM candidates) >= p_total
                        OR EXISTS (SELECT FROM candidates GROUP BY priority HAVING count(*) >= p_candidates))
                   AND EXISTS (
                       SELECT FROM rdq_tasks AS b
                       WHERE b.queue = p_queue AND b.status = 'PENDING' AND b.next_attempt_at <= (SELECT now FROM clock)
                         AND (b.concurrency_key IS NULL
                              OR (b.concurrency_key <> ALL ((SELECT keys FROM full_keys)::text[])
                                  AND b.concurrency_key <> ALL ((SELECT keys FROM filled)::text[])))
                         AND b.id NOT IN (SELECT id FROM candidates)) AS more
            )
            SELECT ROW(t.*)::rdq_tasks AS task, (SELECT more FROM more_behind) AS more
            FROM claimed AS t
            ORDER BY t.priority, t.next_attempt_at, t.id
        LOOP
            v_taken := v_taken + 1;
            v_more := v_pass.more;
            RETURN NEXT v_pass.task;
        END LOOP;
        v_left := v_left - v_taken;
        -- Again only when the window was cut short with allowed tasks behind it: the next pass
        -- sees this one's claims in flight, so the keys they filled are left out of its window.
        EXIT WHEN v_left <= 0 OR v_taken = 0 OR NOT coalesce(v_more, false);
    END LOOP;
END
$$;
