-- Every statement the PostgreSQL backend sends, one "-- name:" block each (read by
-- rdq_core.storage.querytext). Values always travel as bind parameters (%(name)s); the only
-- text spliced in is the dead-letter selection, built from the fixed fragments below.
--
-- Rows come back as the model's field names (id, queue, payload, ...), which is what the shared
-- codec reads. A task's history is a jsonb array in its own row (rdq_tasks.attempts, schema 8),
-- so a task and its attempts cost one round trip and a settle writes one row.
--
-- Fenced batch writes (extend_leases, release, settle) match a task by id and claim token only:
-- a token exists exactly while the task is IN_FLIGHT (rdq_tasks_claim_check), so the token match
-- is the in-flight check, and a statement that does not name the status keeps the planner on the
-- primary key (without fresh statistics it took a partial IN_FLIGHT index for id = ANY(...) and
-- read all of it: 16 ms instead of 0.5 ms for a settle of 100 over 20,000 tasks).
--
-- They lock their rows up front, in id order, inside an uncorrelated ARRAY(...) that runs
-- before the update: two batches overlapping in a different order (a late worker and a reaper,
-- two racing reapers) then queue behind each other instead of deadlocking. It also lets the update probe the primary key for the batch rather than
-- hash-joining the whole table (the planner cannot see how many rows unnest() yields).
--
-- task_columns and task_history are fragments: "{{task_columns}}" in a statement stands for
-- that block's text (substituted when the file is loaded).
--
-- Listing, counting and the bulk actions (page, page_with_history, count, cancel_selected,
-- redrive, purge_dead) share one selection: the selection fragment (queue and status), followed
-- by the filter_* fragments a filter asks for (and after_cursor for a later page), replaces the
-- {where} in those statements. The only other text spliced in comes from fixed tables in
-- backend.py, never from a request: the status, as a literal so the planner can match the
-- status's partial index, and the column the status is ordered by ({order}).

-- name: task_columns
-- Fragment: a task row as every statement returns it, from a relation aliased t.
t.id, t.queue, t.handler, t.payload, t.headers, t.status, t.attempt_count, t.redrive_count,
t.max_attempts, t.backoff, t.next_attempt_at, t.lease_expires_at, t.created_at, t.updated_at,
t.dead_at, t.result, t.last_error, t.claim_token, t.claimed_at, t.claimed_by, t.priority, t.concurrency_key,
t.rate_key, t.task_group AS "group", t.dedupe_key

-- name: task_history
-- Fragment: the history of task t as a jsonb array, in attempt order (kept in the row since
-- schema 8; the claim paths leave it out).
t.attempts

-- name: create_version_table
CREATE TABLE IF NOT EXISTS rdq_schema_version (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: migration_lock
-- Keyed by schema so installations in different schemas of one database never wait for each
-- other. current_schema() is NULL when no search_path schema exists; the CREATE then fails.
SELECT pg_advisory_xact_lock(%(namespace)s, hashtext(current_schema()))

-- name: applied_versions
SELECT version FROM rdq_schema_version

-- name: record_version
INSERT INTO rdq_schema_version (version, name) VALUES (%(version)s, %(name)s)

-- name: task_event_detail
-- What a task event records (s: the changed task, with its attempt_no); the payload only when
-- asked (RDQ_EVENTS_INCLUDE_PAYLOAD), the error not for a success.
jsonb_build_object('handler', s.handler, 'attempt', s.attempt_no, 'redrive_count', s.redrive_count,
                   'error', CASE WHEN s.status <> 'SUCCEEDED' THEN s.last_error END,
                   'payload', CASE WHEN %(with_payload)s THEN s.payload END)

-- name: task_event_incarnation
-- The changed task's creation instant in microseconds since the epoch (s: the changed task):
-- the part of a task event's id that tells apart two tasks that had the same id one after the
-- other (rdq_core/events.py task_event_id). Exact: extract() is numeric, and a double would
-- still round back to the integer it stands for.
(extract(epoch FROM s.created_at) * 1000000)::bigint

-- name: now
SELECT now()

-- name: enqueue
-- DISTINCT ON keeps the first occurrence of an id repeated inside the batch. The main query's
-- snapshot predates the INSERT, so the second branch sees only rows that existed before it:
-- each input row comes back once, either freshly inserted or as the pre-existing task.
WITH request AS (
    SELECT *
    FROM unnest(
        %(ids)s::text[], %(queues)s::text[], %(handlers)s::text[], %(payloads)s::text[],
        %(headers)s::text[], %(max_attempts)s::int[], %(backoffs)s::text[],
        %(delays)s::float8[], %(run_ats)s::timestamptz[], %(priorities)s::smallint[],
        %(concurrency_keys)s::text[], %(rate_keys)s::text[], %(groups)s::text[], %(dedupe_keys)s::text[]
    ) WITH ORDINALITY AS r(id, queue, handler, payload, headers, max_attempts, backoff,
                           delay_seconds, run_at, priority, concurrency_key, rate_key, task_group, dedupe_key, ord)
),
inserted AS (
    INSERT INTO rdq_tasks (id, queue, handler, payload, headers, status, max_attempts,
                           backoff, next_attempt_at, priority, concurrency_key, rate_key, task_group, dedupe_key)
    SELECT DISTINCT ON (r.id)
           r.id, r.queue, r.handler, r.payload::jsonb, r.headers::jsonb, 'PENDING',
           r.max_attempts, r.backoff::jsonb,
           coalesce(r.run_at, now() + r.delay_seconds * interval '1 second'),
           r.priority, r.concurrency_key, r.rate_key, r.task_group, r.dedupe_key
    FROM request AS r
    ORDER BY r.id, r.ord
    ON CONFLICT (id) DO NOTHING
    RETURNING *
)
SELECT r.ord, true AS inserted,
       {{task_columns}},
       '[]'::jsonb AS attempts
FROM request AS r JOIN inserted AS t ON t.id = r.id
UNION ALL
SELECT r.ord, false AS inserted,
       {{task_columns}},
       {{task_history}}
FROM request AS r JOIN rdq_tasks AS t ON t.id = r.id
WHERE t.id = ANY(%(ids)s::text[])
ORDER BY ord

-- name: dedupe_lock
-- Serialises enqueues of one queue and dedupe_key until the transaction ends (a hash collision
-- only serialises two keys more than needed). The next statement runs after it with a snapshot
-- that sees every task an earlier holder committed: the match below can never miss one.
SELECT pg_advisory_xact_lock(%(namespace)s, hashtext(%(queue)s || ' ' || %(key)s))

-- name: dedupe_match
-- Under dedupe_lock: the task holding the id (an idempotent repeat), else the newest task of the
-- queue and key in one of the states or created within the window, with the mode applied to it
-- when it is PENDING (replace: the payload and headers; debounce: the run time, capped at created_at + the
-- max wait). No row: nothing matches, insert. rdq_tasks_dedupe_idx serves the match.
WITH holder AS (
    SELECT t.id FROM rdq_tasks AS t WHERE t.id = %(id)s
),
match AS (
    SELECT t.id FROM rdq_tasks AS t
    WHERE NOT EXISTS (SELECT 1 FROM holder)
      AND t.queue = %(queue)s AND t.dedupe_key = %(key)s
      AND (t.status = ANY(%(states)s::text[])
           OR t.created_at >= now() - %(window_seconds)s::float8 * interval '1 second')
    ORDER BY t.created_at DESC, t.id DESC
    LIMIT 1
    FOR UPDATE
),
applied AS (
    UPDATE rdq_tasks AS t
    SET payload = CASE WHEN %(mode)s = 'replace' THEN %(payload)s::jsonb ELSE t.payload END,
        headers = CASE WHEN %(mode)s = 'replace' THEN %(headers)s::jsonb ELSE t.headers END,
        next_attempt_at = CASE WHEN %(mode)s = 'debounce'
                               THEN least(coalesce(%(run_at)s::timestamptz, now() + %(delay_seconds)s::float8 * interval '1 second'),
                                          t.created_at + %(max_wait_seconds)s::float8 * interval '1 second')
                               ELSE t.next_attempt_at END,
        updated_at = now()
    FROM match AS m
    WHERE t.id = m.id AND t.status = 'PENDING' AND %(mode)s <> 'skip'
    RETURNING t.*
)
SELECT false AS deduplicated, {{task_columns}}, {{task_history}}
FROM rdq_tasks AS t JOIN holder AS h ON h.id = t.id
UNION ALL
SELECT true, {{task_columns}}, {{task_history}} FROM applied AS t
UNION ALL
SELECT true, {{task_columns}}, {{task_history}}
FROM rdq_tasks AS t JOIN match AS m ON m.id = t.id
WHERE NOT EXISTS (SELECT 1 FROM applied)

-- name: tasks_by_ids
-- enqueue's rare second trip: ids a concurrent transaction inserted while the enqueue ran.
SELECT {{task_columns}},
       {{task_history}}
FROM rdq_tasks AS t WHERE t.id = ANY(%(ids)s::text[])

-- name: claim
-- The classic "UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED LIMIT n)", with the
-- locking subquery as an uncorrelated ARRAY(...): it runs exactly once (an IN subquery may be
-- re-scanned by some plans, and SKIP LOCKED is not repeatable), and "id = ANY(array)" makes the
-- update probe the primary key per claimed row instead of joining against the whole table.
-- Claim order is priority, then due time, then id: the lateral walks the claim index once per
-- priority, in priority order (each walk a range scan that stops at the first task not yet due),
-- and the outer LIMIT stops the walk as soon as the batch is full -- with every task at
-- priority 0, exactly one walk, as before priorities.
-- A paused queue claims nothing: the NOT EXISTS is uncorrelated, so it runs once per statement
-- (one primary-key probe of rdq_paused_queues, a one-time filter above the scans), in the
-- claim's own snapshot -- a claim that starts after set_paused committed sees the row.
WITH claimed AS (
    UPDATE rdq_tasks
    SET status = 'IN_FLIGHT',
        claim_token = gen_random_uuid()::text,
        claimed_at = now(),
        claimed_by = NULLIF(%(worker)s::text, ''),  -- NULL: the claimer gave no name
        lease_expires_at = now() + %(lease_seconds)s * interval '1 second',
        updated_at = now()
    WHERE id = ANY (ARRAY(
        SELECT due.id
        FROM generate_series(0, 9) AS p(priority)
        CROSS JOIN LATERAL (
            SELECT id
            FROM rdq_tasks
            WHERE queue = %(queue)s AND status = 'PENDING' AND priority = p.priority
              AND next_attempt_at <= now()
            ORDER BY next_attempt_at, id
            LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED
        ) AS due
        WHERE NOT EXISTS (SELECT FROM rdq_paused_queues AS q WHERE q.queue = %(queue)s)
        LIMIT %(limit)s
    ))
    RETURNING *
)
SELECT {{task_columns}}
FROM claimed AS t
ORDER BY t.priority, t.next_attempt_at, t.id

-- name: flow_lock
-- A flow-controlled claim serialises with the other flow-controlled claims of its queue: a
-- transaction-scoped advisory lock (released by COMMIT, no session state, so it holds behind a
-- transaction-mode pooler too). The statements after it take their snapshots once it is held.
SELECT pg_advisory_xact_lock(%(namespace)s, hashtext(%(queue)s))

-- name: flow_state
-- What the claim's decision reads, in one row: the clock (read after the lock, so claim times
-- follow the order claims commit in), whether the queue is paused, IN_FLIGHT tasks per
-- concurrency key ('' for none), rate-log claims within the period per rate key, and the group
-- the last fair claim served.
WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS now)
SELECT clock.now,
       EXISTS (SELECT FROM rdq_paused_queues AS q WHERE q.queue = %(queue)s) AS paused,
       (SELECT coalesce(jsonb_object_agg(f.key, f.n), '{}'::jsonb)
          FROM (SELECT coalesce(concurrency_key, '') AS key, count(*) AS n FROM rdq_tasks
                 WHERE queue = %(queue)s AND status = 'IN_FLIGHT' AND %(read_in_flight)s
                 GROUP BY concurrency_key) AS f) AS in_flight,
       (SELECT coalesce(jsonb_object_agg(r.key, r.n), '{}'::jsonb)
          FROM (SELECT rate_key AS key, count(*) AS n FROM rdq_rate_log
                 WHERE queue = %(queue)s AND %(rate_period)s::float8 IS NOT NULL
                   AND claimed_at > clock.now - %(rate_period)s::float8 * interval '1 second'
                 GROUP BY rate_key) AS r) AS recent,
       (SELECT c.last_group FROM rdq_fair_cursor AS c WHERE c.queue = %(queue)s AND %(fair)s) AS last_group
FROM clock

-- name: flow_candidate_columns
-- Fragment: a candidate of a flow-controlled claim, as rdq_core.flow.Candidate takes it.
id, priority, next_attempt_at AS due, concurrency_key, rate_key, task_group AS "group"

-- name: flow_keys_not_full
-- Fragment: the task's keys are not among those flow_state found full.
(concurrency_key IS NULL OR concurrency_key <> ALL (%(full_keys)s::text[]))
AND (rate_key IS NULL OR rate_key <> ALL (%(full_rates)s::text[]))

-- name: flow_candidates
-- Due tasks whose keys are not known to be full, by priority then due time: up to %(limit)s of
-- each priority, walked in priority order; %(total)s caps them all (without aging, the first
-- priorities fill the claim; with aging every priority's oldest may rank first).
SELECT due.*
FROM generate_series(0, 9) AS p(priority)
CROSS JOIN LATERAL (
    SELECT {{flow_candidate_columns}}
    FROM rdq_tasks
    WHERE queue = %(queue)s AND status = 'PENDING' AND priority = p.priority
      AND next_attempt_at <= %(now)s
      AND {{flow_keys_not_full}}
    ORDER BY next_attempt_at, id
    LIMIT %(limit)s
) AS due
LIMIT %(total)s

-- name: flow_group_candidates
-- fair_groups: the groups after %(after)s and up to %(until)s (by name) with a due task whose
-- keys are not known to be full -- a skip scan of the group index, one probe per group found, at
-- most %(groups)s; a probe walks past the entries of groups holding only delayed or blocked
-- tasks, so they never take a claim's turn -- then up to %(limit)s such tasks of each. Tasks
-- without a group: %(ungrouped)s.
WITH RECURSIVE grp AS (
    (SELECT task_group AS name, 1 AS n FROM rdq_tasks
      WHERE queue = %(queue)s AND status = 'PENDING' AND task_group > %(after)s
        AND next_attempt_at <= %(now)s AND {{flow_keys_not_full}}
      ORDER BY task_group LIMIT 1)
    UNION ALL
    SELECT (SELECT t.task_group FROM rdq_tasks AS t
             WHERE t.queue = %(queue)s AND t.status = 'PENDING' AND t.task_group > grp.name
               AND t.next_attempt_at <= %(now)s AND {{flow_keys_not_full}}
             ORDER BY t.task_group LIMIT 1), grp.n + 1
    FROM grp WHERE grp.name IS NOT NULL AND grp.n < %(groups)s
)
SELECT due.*
FROM grp
CROSS JOIN LATERAL (
    SELECT {{flow_candidate_columns}}
    FROM rdq_tasks
    WHERE queue = %(queue)s AND status = 'PENDING' AND task_group = grp.name
      AND next_attempt_at <= %(now)s
      AND {{flow_keys_not_full}}
    ORDER BY priority, next_attempt_at, id
    LIMIT %(limit)s
) AS due
WHERE grp.name IS NOT NULL AND (%(until)s::text IS NULL OR grp.name <= %(until)s)
UNION ALL
SELECT * FROM (
    SELECT {{flow_candidate_columns}}
    FROM rdq_tasks
    WHERE %(ungrouped)s AND queue = %(queue)s AND status = 'PENDING' AND task_group IS NULL
      AND next_attempt_at <= %(now)s
      AND {{flow_keys_not_full}}
    ORDER BY priority, next_attempt_at, id
    LIMIT %(limit)s
) AS ungrouped

-- name: flow_claim
-- The decision applied, in the same transaction: the chosen tasks flip to IN_FLIGHT (each
-- re-checked PENDING, locked in id order first like every multi-row write, so a concurrent
-- batch write queues instead of deadlocking), stamped with the clock flow_state read;
-- rate-keyed claims go in the rate log and its rows older than the period go out; the fairness
-- cursor moves.
WITH claimed AS (
    UPDATE rdq_tasks
    SET status = 'IN_FLIGHT',
        claim_token = gen_random_uuid()::text,
        claimed_at = %(now)s,
        claimed_by = NULLIF(%(worker)s::text, ''),
        lease_expires_at = %(now)s + %(lease_seconds)s * interval '1 second',
        updated_at = %(now)s
    WHERE id = ANY (ARRAY(
        SELECT id FROM rdq_tasks
        WHERE id = ANY (%(ids)s::text[]) AND status = 'PENDING'
        ORDER BY id
        FOR UPDATE
    )) AND status = 'PENDING'
    RETURNING *
),
logged AS (
    INSERT INTO rdq_rate_log (queue, rate_key, claimed_at, task_id)
    SELECT c.queue, c.rate_key, %(now)s, c.id FROM claimed AS c
    WHERE c.rate_key IS NOT NULL AND %(rate_period)s::float8 IS NOT NULL
),
trimmed AS (
    DELETE FROM rdq_rate_log
    WHERE queue = %(queue)s AND %(rate_period)s::float8 IS NOT NULL
      AND claimed_at <= %(now)s - %(rate_period)s::float8 * interval '1 second'
),
cursor_moved AS (
    INSERT INTO rdq_fair_cursor (queue, last_group)
    SELECT %(queue)s, %(served_group)s::text WHERE %(served_group)s::text IS NOT NULL
    ON CONFLICT (queue) DO UPDATE SET last_group = excluded.last_group
)
SELECT {{task_columns}}
FROM claimed AS t
ORDER BY t.priority, t.next_attempt_at, t.id

-- name: flow_claim_at_once
-- A claim under concurrency limits (and max_in_flight, priority aging; not a rate limit or fair
-- groups, which keep flow_state .. flow_claim), decided and applied by one call of
-- rdq_flow_claim_at_once (schema.sql; migrations/0010 says why a function): the queue's lock,
-- then a statement that chooses as rdq_core.flow.choose does and claims, passing again when its
-- candidate window was cut short with allowed tasks behind it. Run between BEGIN and COMMIT in
-- one pipeline, so the lock is held only while the function runs.
SELECT {{task_columns}}
FROM rdq_flow_claim_at_once(%(queue)s, %(limit)s, %(lease_seconds)s, %(worker)s, %(key_limits)s::jsonb,
                            %(default_limit)s, %(max_in_flight)s, %(aging)s, %(candidates)s, %(total)s,
                            %(namespace)s) AS t

-- name: extend_leases
-- A ref is honoured only while its token still owns an IN_FLIGHT task (fencing). GREATEST: an
-- extension never moves an expiry earlier (a short heartbeat must not hand a long-leased task to
-- the reaper); RETURNING reports the expiry as stored.
WITH ref AS (
    SELECT *
    FROM unnest(%(task_ids)s::text[], %(claim_tokens)s::text[])
         WITH ORDINALITY AS ref(task_id, claim_token, ord)
)
UPDATE rdq_tasks AS t
SET lease_expires_at = GREATEST(t.lease_expires_at, now() + %(lease_seconds)s * interval '1 second'),
    updated_at = now()
FROM ref
WHERE t.id = ANY (ARRAY(
        SELECT id FROM rdq_tasks WHERE id = ANY(%(task_ids)s::text[]) ORDER BY id FOR UPDATE
    ))
  AND t.id = ref.task_id AND t.claim_token = ref.claim_token
RETURNING ref.ord, t.id, t.lease_expires_at

-- name: release
-- Back to PENDING without an attempt: budget and next_attempt_at are left as they were. A
-- released task never started, so its claim leaves the rate log too (the claim's row: same key,
-- same claim time, same task): a rate limit counts starts.
WITH ref AS (
    SELECT *
    FROM unnest(%(task_ids)s::text[], %(claim_tokens)s::text[])
         WITH ORDINALITY AS ref(task_id, claim_token, ord)
),
released AS (
    UPDATE rdq_tasks AS t
    SET status = 'PENDING', claim_token = NULL, claimed_by = NULL, lease_expires_at = NULL, updated_at = now()
    FROM ref
    WHERE t.id = ANY (ARRAY(
            SELECT id FROM rdq_tasks WHERE id = ANY(%(task_ids)s::text[]) ORDER BY id FOR UPDATE
        ))
      AND t.id = ref.task_id AND t.claim_token = ref.claim_token
    RETURNING ref.ord, t.id, t.queue, t.rate_key, t.claimed_at
),
unlogged AS (
    DELETE FROM rdq_rate_log AS l
    USING released AS r
    WHERE r.rate_key IS NOT NULL AND l.queue = r.queue AND l.rate_key = r.rate_key
      AND l.claimed_at = r.claimed_at AND l.task_id = r.id
)
SELECT ord FROM released

-- name: settle
-- One statement for the whole batch. The row lock serialises racing settles of one task; a
-- loser re-checks the fence against the committed row, finds the token cleared and matches
-- nothing. The attempt goes into the task's own history in the same row write, numbered from
-- that history (its last attempt_no + 1; rdq_tasks_attempts_numbered_check holds that equal to
-- MAX + 1) -- never from attempt_count, which redrive resets. claimed_at is the attempt's
-- started_at. dead_at uses clock_timestamp() so tasks dead-lettered by one statement still get
-- distinct, ordered DLQ positions. A SNOOZED attempt spends no budget.
--
-- The batch arrives as one JSON array of [task_id, claim_token, outcome, status,
-- retry_delay_seconds, error, result] (error and result as JSON text, error null for none):
-- one text parameter, where seven arrays cost the client a Python array dumper per element;
-- jsonb, parsed once, unpacks faster than the arrays did (json would re-parse per field).
WITH decision AS (
    SELECT e.item ->> 0 AS task_id, e.item ->> 1 AS claim_token, e.item ->> 2 AS outcome,
           e.item ->> 3 AS status, (e.item ->> 4)::float8 AS retry_delay_seconds,
           e.item ->> 5 AS error, e.item ->> 6 AS result, (e.item ->> 7)::float8 AS started_after, e.ord
    FROM jsonb_array_elements(%(settlements)s::jsonb) WITH ORDINALITY AS e(item, ord)
),
settled AS (
    UPDATE rdq_tasks AS t
    SET status = d.status,
        attempt_count = t.attempt_count + CASE WHEN d.outcome = 'SNOOZED' THEN 0 ELSE 1 END,
        next_attempt_at = CASE WHEN d.status = 'PENDING'
                               THEN now() + d.retry_delay_seconds * interval '1 second'
                               ELSE t.next_attempt_at END,
        dead_at = CASE WHEN d.status = 'DEAD' THEN clock_timestamp() END,
        result = CASE WHEN d.status = 'SUCCEEDED' THEN d.result::jsonb ELSE t.result END,
        last_error = CASE WHEN d.outcome = 'SUCCESS' THEN t.last_error
                          ELSE coalesce(d.error::jsonb, t.last_error) END,
        attempts = t.attempts || jsonb_build_array(jsonb_build_object(
            'attempt_no', coalesce((t.attempts -> -1 ->> 'attempt_no')::integer, 0) + 1,
            'outcome', d.outcome,
            'started_at', LEAST(t.claimed_at + coalesce(d.started_after, 0) * interval '1 second', now()),
            'finished_at', now(),
            'error', d.error::jsonb)),
        claim_token = NULL,
        claimed_by = NULL,  -- the claim has ended: no worker holds it
        lease_expires_at = NULL,
        updated_at = now()
    FROM decision AS d
    WHERE t.id = ANY (ARRAY(
        SELECT id FROM rdq_tasks WHERE id = ANY(ARRAY(SELECT task_id FROM decision)) ORDER BY id FOR UPDATE
    ))
      AND t.id = d.task_id
      AND t.claim_token = d.claim_token
      AND (d.outcome <> 'LEASE_EXPIRED' OR t.lease_expires_at <= now())
    RETURNING d.ord, t.id, t.status, t.queue, t.handler, t.redrive_count, t.payload, t.last_error, t.created_at,
              (t.attempts -> -1 ->> 'attempt_no')::integer AS attempt_no
),
-- The lifecycle events of this settle (rdq_core/events.py), in the same statement: none unless
-- event_statuses names the task's new status.
events AS (
    INSERT INTO rdq_outbox (id, type, queue, task_id, at, detail)
    SELECT s.id || ':' || lower(s.status) || ':' || s.attempt_no || ':' || {{task_event_incarnation}},
           'rdq.task.' || lower(s.status), s.queue, s.id, now(),
           {{task_event_detail}}
    FROM settled AS s
    WHERE s.status = ANY(%(event_statuses)s::text[])
    ORDER BY s.id
    ON CONFLICT (id) DO NOTHING
)
SELECT ord FROM settled

-- name: find_expired_leases
-- The reaper across queues, oldest expiry first. rdq_tasks_lease_expiry_idx is led by the queue
-- (one index serves the reaper and IN_FLIGHT listings, so a claim adds one entry per task, not
-- two): a skip scan finds each queue holding an IN_FLIGHT task (one probe per queue), each queue
-- offers at most limit expired tasks in expiry order, and the first limit of those are the
-- answer. The cost follows the number of queues with tasks in flight and the batch, never the
-- number of tasks.
-- (ORDER BY queue, lease_expires_at is the order of that index alone: a probe of the (queue,
-- status) index could walk every other-status row of a queue to find none in flight.)
WITH RECURSIVE queues AS (
    (SELECT queue FROM rdq_tasks WHERE status = 'IN_FLIGHT' ORDER BY queue, lease_expires_at LIMIT 1)
    UNION ALL
    SELECT (SELECT i.queue FROM rdq_tasks AS i
            WHERE i.status = 'IN_FLIGHT' AND i.queue > q.queue
            ORDER BY i.queue, i.lease_expires_at LIMIT 1)
    FROM queues AS q
    WHERE q.queue IS NOT NULL
)
SELECT {{task_columns}}
FROM queues AS q
CROSS JOIN LATERAL (
    SELECT *
    FROM rdq_tasks AS e
    WHERE e.queue = q.queue AND e.status = 'IN_FLIGHT' AND e.lease_expires_at <= now()
    ORDER BY e.lease_expires_at, e.id
    LIMIT %(limit)s
) AS t
ORDER BY t.lease_expires_at, t.id
LIMIT %(limit)s

-- name: find_expired_leases_in_queue
-- The reaper of one queue: a range of rdq_tasks_lease_expiry_idx.
SELECT {{task_columns}}
FROM rdq_tasks AS t
WHERE t.queue = %(queue)s AND t.status = 'IN_FLIGHT' AND t.lease_expires_at <= now()
ORDER BY t.lease_expires_at, t.id
LIMIT %(limit)s

-- name: get
SELECT {{task_columns}},
       {{task_history}}
FROM rdq_tasks AS t
WHERE t.id = %(task_id)s

-- name: cancel
WITH cancelled AS (
    UPDATE rdq_tasks
    SET status = 'CANCELLED', updated_at = now()
    WHERE id = %(task_id)s AND status = 'PENDING'
    RETURNING *
)
SELECT {{task_columns}},
       {{task_history}}
FROM cancelled AS t

-- name: selection
t.queue = %(queue)s AND t.status = '{status}'

-- name: filter_ids
AND t.id = ANY(%(ids)s::text[])

-- name: filter_error_type
AND t.last_error->>'type' = %(error_type)s

-- name: filter_handler
AND t.handler = %(handler)s

-- name: after_cursor
AND (t.{order}, t.id) > (%(after_time)s, %(after_id)s)

-- name: page
-- One keyset page of a status, walking that status's (queue, status, instant, id) index.
SELECT {{task_columns}}
FROM rdq_tasks AS t
WHERE {where}
ORDER BY t.{order}, t.id
LIMIT %(limit)s

-- name: page_with_history
-- The same page, each task with its history (the DLQ shows why a task died).
SELECT {{task_columns}},
       {{task_history}}
FROM rdq_tasks AS t
WHERE {where}
ORDER BY t.{order}, t.id
LIMIT %(limit)s

-- name: count
SELECT count(*) AS n FROM rdq_tasks AS t WHERE {where}

-- name: cancel_selected
-- What cancel does, for every selected PENDING task, in one statement. The rows are locked in id
-- order first (like the fenced batch writes, so a concurrent batch never deadlocks with this
-- one); a row a claim changed meanwhile is re-checked after its lock is granted and no longer
-- matches status = 'PENDING', so a task claimed concurrently is never cancelled.
UPDATE rdq_tasks AS t
SET status = 'CANCELLED', updated_at = now()
WHERE t.id = ANY (ARRAY(
        SELECT t.id FROM rdq_tasks AS t WHERE {where} ORDER BY t.id FOR UPDATE
    ))
  AND t.status = 'PENDING'

-- name: redrive
-- With one rdq.task.redriven event per task when redriven_events is true (same statement).
WITH redriven AS (
    UPDATE rdq_tasks AS t
    SET status = 'PENDING', attempt_count = 0, redrive_count = t.redrive_count + 1,
        next_attempt_at = now(), dead_at = NULL, updated_at = now()
    WHERE {where}
    RETURNING t.id, t.queue, t.handler, t.redrive_count, t.payload, t.last_error, t.created_at, 'PENDING' AS status,
              (t.attempts -> -1 ->> 'attempt_no')::integer AS attempt_no
),
events AS (
    INSERT INTO rdq_outbox (id, type, queue, task_id, at, detail)
    SELECT s.id || ':redriven:' || s.redrive_count || ':' || {{task_event_incarnation}}, 'rdq.task.redriven', s.queue,
           s.id, now(), {{task_event_detail}}
    FROM redriven AS s
    WHERE %(redriven_events)s
    ORDER BY s.id
    ON CONFLICT (id) DO NOTHING
)
SELECT count(*) AS n FROM redriven

-- name: purge_dead
DELETE FROM rdq_tasks AS t WHERE {where}

-- name: stats
SELECT count(*) FILTER (WHERE status = 'PENDING')   AS pending,
       count(*) FILTER (WHERE status = 'IN_FLIGHT') AS in_flight,
       count(*) FILTER (WHERE status = 'DEAD')      AS dead,
       count(*) FILTER (WHERE status = 'SUCCEEDED') AS succeeded,
       count(*) FILTER (WHERE status = 'CANCELLED') AS cancelled,
       coalesce((SELECT extract(epoch FROM now() - min(p.next_attempt_at))::float8
                 FROM rdq_tasks AS p
                 WHERE p.queue = %(queue)s AND p.status = 'PENDING'
                   AND p.next_attempt_at <= now()), 0) AS oldest_pending_age_seconds,
       EXISTS (SELECT 1 FROM rdq_paused_queues AS q WHERE q.queue = %(queue)s) AS paused
FROM rdq_tasks
WHERE queue = %(queue)s

-- name: live_stats
-- Each count walks the partial index holding only its status (rdq_tasks_pending_due_idx,
-- rdq_tasks_lease_expiry_idx, rdq_tasks_dead_idx): the cost follows the queue's live work, not
-- the finished tasks it keeps.
SELECT (SELECT count(*) FROM rdq_tasks WHERE queue = %(queue)s AND status = 'PENDING')   AS pending,
       (SELECT count(*) FROM rdq_tasks WHERE queue = %(queue)s AND status = 'IN_FLIGHT') AS in_flight,
       (SELECT count(*) FROM rdq_tasks WHERE queue = %(queue)s AND status = 'DEAD')      AS dead,
       coalesce((SELECT extract(epoch FROM now() - min(p.next_attempt_at))::float8
                 FROM rdq_tasks AS p
                 WHERE p.queue = %(queue)s AND p.status = 'PENDING'
                   AND p.next_attempt_at <= now()), 0) AS oldest_pending_age_seconds,
       EXISTS (SELECT 1 FROM rdq_paused_queues AS q WHERE q.queue = %(queue)s) AS paused

-- name: list_queues
-- A skip scan over the (queue, status) index: one index probe per distinct queue, not a scan
-- of every task.
WITH RECURSIVE queues AS (
    (SELECT queue FROM rdq_tasks ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM rdq_tasks AS t WHERE t.queue > q.queue ORDER BY t.queue LIMIT 1)
    FROM queues AS q
    WHERE q.queue IS NOT NULL
)
SELECT queue FROM queues WHERE queue IS NOT NULL

-- name: purge_succeeded
-- Bounded batch; SKIP LOCKED so two retention runs split the work instead of queueing.
DELETE FROM rdq_tasks
WHERE id IN (
    SELECT id
    FROM rdq_tasks
    WHERE status IN ('SUCCEEDED', 'CANCELLED')
      AND updated_at < now() - %(older_than_seconds)s * interval '1 second'
    ORDER BY updated_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)

-- name: pause
INSERT INTO rdq_paused_queues (queue) VALUES (%(queue)s) ON CONFLICT (queue) DO NOTHING

-- name: resume
DELETE FROM rdq_paused_queues WHERE queue = %(queue)s

-- name: paused
SELECT queue FROM rdq_paused_queues

-- name: audit_append
-- Stamped by the database clock; RETURNING hands back the time exactly as stored.
INSERT INTO rdq_audit_log (id, at, actor, action, queue, selection, count)
VALUES (%(id)s, now(), %(actor)s, %(action)s, %(queue)s, %(selection)s, %(count)s)
RETURNING at

-- name: audit_page
-- Newest first by (at, id), strictly before the cursor; a backward walk of
-- rdq_audit_log_queue_at_idx (one queue) or rdq_audit_log_at_idx (all).
SELECT id, at, actor, action, queue, selection, count
FROM rdq_audit_log
WHERE (%(queue)s::text IS NULL OR queue = %(queue)s::text)
  AND (%(before_at)s::timestamptz IS NULL OR (at, id) < (%(before_at)s::timestamptz, %(before_id)s::text))
ORDER BY at DESC, id DESC
LIMIT %(limit)s

-- name: doc_get
SELECT version, body FROM rdq_documents WHERE kind = %(kind)s AND key = %(key)s

-- name: doc_insert
-- Only if absent: a concurrent insert of the same key waits for the first to commit, then
-- does nothing and returns no row.
INSERT INTO rdq_documents (kind, key, version, body) VALUES (%(kind)s, %(key)s, 1, %(body)s)
ON CONFLICT (kind, key) DO NOTHING
RETURNING version

-- name: doc_replace
-- Only at the expected version: a concurrent writer waits on the row lock, then re-checks the
-- version against the row as committed, so exactly one of them replaces it.
UPDATE rdq_documents SET version = version + 1, body = %(body)s
WHERE kind = %(kind)s AND key = %(key)s AND version = %(expected)s
RETURNING version

-- name: doc_delete
DELETE FROM rdq_documents WHERE kind = %(kind)s AND key = %(key)s AND version = %(expected)s

-- name: doc_page
-- Keyset by key in byte order (the "C" collation), a range scan of the primary key.
SELECT key, version, body FROM rdq_documents
WHERE kind = %(kind)s AND key > %(after)s
ORDER BY key
LIMIT %(limit)s

-- name: outbox_put
INSERT INTO rdq_outbox (id, type, queue, task_id, at, detail)
SELECT e.id, e.type, e.queue, e.task_id, now(), e.detail::jsonb
FROM unnest(%(ids)s::text[], %(types)s::text[], %(queues)s::text[], %(task_ids)s::text[], %(details)s::text[])
     WITH ORDINALITY AS e(id, type, queue, task_id, detail, ord)
ORDER BY e.ord
ON CONFLICT (id) DO NOTHING

-- name: outbox_take
-- The oldest events not leased to another deliverer (a batch being taken concurrently is
-- skipped, not waited for), leased in the same statement.
UPDATE rdq_outbox AS o
SET leased_until = now() + %(lease_seconds)s * interval '1 second'
WHERE o.seq = ANY (ARRAY(
        SELECT seq FROM rdq_outbox WHERE leased_until <= now() ORDER BY seq LIMIT %(limit)s FOR UPDATE SKIP LOCKED
    ))
RETURNING o.seq, o.id, o.type, o.queue, o.task_id, o.at, o.detail

-- name: outbox_ack
DELETE FROM rdq_outbox WHERE id = ANY(%(ids)s::text[])

-- name: wake_channel
-- The channel rdq_wake_workers() notifies for the tables of this connection's schema.
SELECT left('rdq_enqueued:' || current_schema(), 63) AS channel
