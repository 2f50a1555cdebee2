-- Every statement the SQLite backend sends, one "-- name:" block each (read by
-- rdq_core.storage.querytext). Values always travel as bind parameters (? or :name). Text in
-- braces is spliced in by the backend, never from a value:
--   {task_columns}  the task_columns block below, filled in once when the file is loaded;
--   {marks}         one ? per id of a batch (an IN list);
--   {selection}     the dead-letter selection, built from the dead_* fragments below.
--
-- Instants are integer microseconds since the epoch, read from the host clock by the backend
-- while it holds the write lock (BEGIN IMMEDIATE), so they pass in as :now. Rows come back under
-- the model's field names, which is what the shared codec reads.

-- name: task_columns
id, queue, handler, payload, headers, status, attempt_count, redrive_count, max_attempts, backoff,
next_attempt_at, lease_expires_at, created_at, updated_at, dead_at, result, last_error, claim_token, claimed_at,
claimed_by, priority, concurrency_key, rate_key, task_group AS "group", dedupe_key

-- name: tasks_by_id
SELECT {task_columns} FROM rdq_tasks WHERE id IN ({marks})

-- name: attempts_of
SELECT task_id, attempt_no, outcome, started_at, finished_at, error FROM rdq_attempts
 WHERE task_id IN ({marks}) ORDER BY task_id, attempt_no

-- name: insert
INSERT INTO rdq_tasks (id, queue, handler, payload, headers, status, max_attempts, backoff,
                       next_attempt_at, created_at, updated_at, priority, concurrency_key, rate_key, task_group,
                       dedupe_key)
VALUES (?, ?, ?, ?, ?, 'PENDING', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)

-- name: dedupe_match
-- The newest task of the queue with this dedupe_key in one of :states (a JSON array) or created
-- at or after :since (NULL: no window). rdq_tasks_dedupe serves it.
SELECT {task_columns} FROM rdq_tasks
 WHERE queue = :queue AND dedupe_key = :key
   AND (status IN (SELECT value FROM json_each(:states)) OR created_at >= :since)
 ORDER BY created_at DESC, id DESC LIMIT 1

-- name: dedupe_apply
-- The mode, on a PENDING match only: replace stores the new payload and headers (a payload kept in
-- the payload store travels as a header); debounce moves the run time
-- to the request's, capped at first enqueue + max wait. skip changes nothing (no row returned).
UPDATE rdq_tasks
   SET payload = CASE WHEN :mode = 'replace' THEN :payload ELSE payload END,
       headers = CASE WHEN :mode = 'replace' THEN :headers ELSE headers END,
       next_attempt_at = CASE WHEN :mode = 'debounce'
                              THEN MIN(:due, COALESCE(created_at + :max_wait_us, :due))
                              ELSE next_attempt_at END,
       updated_at = :now
 WHERE id = :id AND status = 'PENDING' AND :mode <> 'skip'
RETURNING {task_columns}

-- name: claim
-- Due tasks by priority, then due time, then id: one walk of the claim index per priority (each
-- a range scan that stops at the first task not yet due), in priority order, until :limit.
-- The placeholder in braces stands for one due_of_priority branch per priority, joined by UNION ALL.
-- claimed_by: the claimer's name, or NULL for a claimer that gave none (never an earlier claim's).
UPDATE rdq_tasks
   SET status = 'IN_FLIGHT', claim_token = lower(hex(randomblob(16))), claimed_at = :now,
       claimed_by = NULLIF(:worker, ''), lease_expires_at = :lease_until, updated_at = :now
 WHERE id IN (SELECT id FROM ({due_of_priority}) LIMIT :limit)
   AND NOT EXISTS (SELECT 1 FROM rdq_paused_queues AS p WHERE p.queue = :queue)
RETURNING {task_columns}

-- name: due_of_priority
SELECT id FROM (SELECT id FROM rdq_tasks
                 WHERE queue = :queue AND status = 'PENDING' AND priority = {priority} AND next_attempt_at <= :now
                 ORDER BY next_attempt_at, id LIMIT :limit)

-- name: flow_paused
SELECT 1 FROM rdq_paused_queues WHERE queue = :queue

-- name: flow_in_flight
-- A flow-controlled claim's view of what runs: IN_FLIGHT tasks per concurrency key (NULL: none).
SELECT concurrency_key AS key, count(*) AS n FROM rdq_tasks
 WHERE queue = :queue AND status = 'IN_FLIGHT' GROUP BY concurrency_key

-- name: flow_rate_trim
DELETE FROM rdq_rate_log WHERE queue = :queue AND claimed_at <= :since

-- name: flow_rate_counts
SELECT rate_key AS key, count(*) AS n FROM rdq_rate_log WHERE queue = :queue GROUP BY rate_key

-- name: flow_rate_log
INSERT INTO rdq_rate_log (queue, rate_key, claimed_at, task_id) VALUES (?, ?, ?, ?)

-- name: flow_last_group
SELECT last_group FROM rdq_fair_cursor WHERE queue = :queue

-- name: flow_served_group
INSERT INTO rdq_fair_cursor (queue, last_group) VALUES (:queue, :group)
ON CONFLICT (queue) DO UPDATE SET last_group = excluded.last_group

-- name: flow_candidate_columns
-- Fragment: a candidate of a flow-controlled claim, as rdq_core.flow.Candidate takes it.
id, priority, next_attempt_at AS due, concurrency_key, rate_key, task_group AS "group"

-- name: flow_keys_not_full
-- Fragment: the task's keys are not among those the claim found full (:full_keys, :full_rates: JSON arrays).
(concurrency_key IS NULL OR concurrency_key NOT IN (SELECT value FROM json_each(:full_keys)))
AND (rate_key IS NULL OR rate_key NOT IN (SELECT value FROM json_each(:full_rates)))

-- name: flow_candidates
-- Due tasks of one priority whose keys are not known to be full.
SELECT {{flow_candidate_columns}} FROM rdq_tasks
 WHERE queue = :queue AND status = 'PENDING' AND priority = :priority AND next_attempt_at <= :now
   AND {{flow_keys_not_full}}
 ORDER BY next_attempt_at, id LIMIT :limit

-- name: flow_next_group
-- fair_groups: the next group (by name) after :after with a due PENDING task whose keys are not
-- known to be full: a walk of the group index in name order that stops at the first such task
-- (a group holding only delayed or blocked tasks is walked past, never served a turn).
SELECT min(task_group) AS grp FROM rdq_tasks
 WHERE queue = :queue AND status = 'PENDING' AND task_group IS NOT NULL AND task_group > :after
   AND next_attempt_at <= :now AND {{flow_keys_not_full}}

-- name: flow_group_candidates
SELECT {{flow_candidate_columns}} FROM rdq_tasks
 WHERE queue = :queue AND status = 'PENDING' AND task_group = :group AND next_attempt_at <= :now
   AND {{flow_keys_not_full}}
 ORDER BY priority, next_attempt_at, id LIMIT :limit

-- name: flow_ungrouped_candidates
SELECT {{flow_candidate_columns}} FROM rdq_tasks
 WHERE queue = :queue AND status = 'PENDING' AND task_group IS NULL AND next_attempt_at <= :now
   AND {{flow_keys_not_full}}
 ORDER BY priority, next_attempt_at, id LIMIT :limit

-- name: flow_claim_ids
UPDATE rdq_tasks
   SET status = 'IN_FLIGHT', claim_token = lower(hex(randomblob(16))), claimed_at = ?,
       claimed_by = NULLIF(?, ''), lease_expires_at = ?, updated_at = ?
 WHERE id IN ({marks}) AND status = 'PENDING'
RETURNING {task_columns}

-- name: extend_lease
-- MAX: an extension never moves an expiry earlier (a short heartbeat must not hand a
-- long-leased task to the reaper); the stored value is what the call reports.
UPDATE rdq_tasks SET lease_expires_at = MAX(lease_expires_at, ?), updated_at = ?
 WHERE id = ? AND claim_token = ? AND status = 'IN_FLIGHT' RETURNING lease_expires_at

-- name: settle
-- A whole batch of settlements travels as one JSON array (json_each), so a settle costs two
-- statements however many tasks it carries: this fenced UPDATE … FROM, then append_attempts.
-- A SNOOZED attempt spends no budget.
UPDATE rdq_tasks AS t
   SET status = s.status, attempt_count = t.attempt_count + (s.outcome <> 'SNOOZED'), claim_token = NULL,
       claimed_by = NULL, lease_expires_at = NULL, updated_at = :now,
       next_attempt_at = CASE WHEN s.status = 'PENDING' THEN :now + s.delay_us ELSE t.next_attempt_at END,
       dead_at = CASE WHEN s.status = 'DEAD' THEN :now ELSE NULL END,
       result = CASE WHEN s.status = 'SUCCEEDED' THEN s.result ELSE t.result END,
       last_error_type = COALESCE(s.error_type, t.last_error_type),
       last_error = COALESCE(s.error, t.last_error)
  FROM (SELECT value ->> '$.id' AS id, value ->> '$.token' AS token, value ->> '$.status' AS status,
               value ->> '$.outcome' AS outcome, value ->> '$.delay_us' AS delay_us,
               value ->> '$.result' AS result, value ->> '$.error_type' AS error_type,
               value ->> '$.error' AS error
          FROM json_each(:batch)) AS s
 WHERE t.id = s.id AND t.claim_token = s.token AND t.status = 'IN_FLIGHT'
   AND (s.outcome <> 'LEASE_EXPIRED' OR t.lease_expires_at <= :now)
RETURNING id, claimed_at

-- name: append_attempts
-- attempt_no comes from history (MAX + 1), never from attempt_count, which redrive resets.
-- The applied ids are distinct, so each row's MAX is independent of the others in the batch.
INSERT INTO rdq_attempts (task_id, attempt_no, outcome, started_at, finished_at, error)
SELECT a.value ->> '$.id',
       COALESCE((SELECT MAX(h.attempt_no) FROM rdq_attempts AS h WHERE h.task_id = a.value ->> '$.id'), 0) + 1,
       a.value ->> '$.outcome', a.value ->> '$.started_at', :now, a.value ->> '$.error'
  FROM json_each(:applied) AS a

-- name: release
UPDATE rdq_tasks SET status = 'PENDING', claim_token = NULL, claimed_by = NULL, lease_expires_at = NULL, updated_at = ?
 WHERE id = ? AND claim_token = ? AND status = 'IN_FLIGHT' RETURNING id, queue, rate_key, claimed_at

-- name: release_rate_log
-- A released task never started: its claim leaves the rate log (a rate limit counts starts).
DELETE FROM rdq_rate_log WHERE queue = ? AND rate_key = ? AND claimed_at = ? AND task_id = ?

-- name: expired_leases
SELECT {task_columns} FROM rdq_tasks WHERE status = 'IN_FLIGHT' AND lease_expires_at <= ?
 ORDER BY lease_expires_at LIMIT ?

-- name: expired_leases_in_queue
SELECT {task_columns} FROM rdq_tasks WHERE status = 'IN_FLIGHT' AND lease_expires_at <= ? AND queue = ?
 ORDER BY lease_expires_at LIMIT ?

-- name: cancel
UPDATE rdq_tasks SET status = 'CANCELLED', updated_at = ? WHERE id = ? AND status = 'PENDING'
RETURNING {task_columns}

-- name: selected_queue
queue = ? AND status = ?

-- name: dead_ids
AND id IN ({marks})

-- name: dead_error_type
AND last_error_type = ?

-- name: dead_handler
AND handler = ?

-- name: page_after
-- The order column is the status's (core.ORDER_FIELD), never request text.
AND ({order}, id) > (?, ?)

-- name: page
SELECT {task_columns} FROM rdq_tasks WHERE {selection} ORDER BY {order}, id LIMIT ?

-- name: count_selected
SELECT COUNT(*) FROM rdq_tasks WHERE {selection}

-- name: cancel_selected
UPDATE rdq_tasks SET status = 'CANCELLED', updated_at = ? WHERE {selection}

-- name: redrive
UPDATE rdq_tasks SET status = 'PENDING', attempt_count = 0, redrive_count = redrive_count + 1,
       next_attempt_at = ?, dead_at = NULL, updated_at = ?
 WHERE {selection}
RETURNING id

-- name: purge_dead
-- Attempts go with their task (ON DELETE CASCADE; foreign keys are on for every connection).
DELETE FROM rdq_tasks WHERE {selection}

-- name: status_counts
SELECT status, COUNT(*) FROM rdq_tasks WHERE queue = ? GROUP BY status

-- name: live_status_counts
-- Three ranges of the (queue, status) index: finished tasks are never read.
SELECT status, COUNT(*) FROM rdq_tasks WHERE queue = ? AND status IN ('PENDING', 'IN_FLIGHT', 'DEAD') GROUP BY status

-- name: oldest_due
-- With the queue's paused flag, read in the same statement.
SELECT MIN(next_attempt_at), EXISTS (SELECT 1 FROM rdq_paused_queues WHERE queue = ?1)
  FROM rdq_tasks WHERE queue = ?1 AND status = 'PENDING' AND next_attempt_at <= ?2

-- name: queues
SELECT DISTINCT queue FROM rdq_tasks ORDER BY queue

-- name: purge_finished
DELETE FROM rdq_tasks WHERE id IN (SELECT id FROM rdq_tasks WHERE status IN ('SUCCEEDED','CANCELLED')
                                      AND updated_at < ? ORDER BY updated_at LIMIT ?)

-- name: pause
INSERT INTO rdq_paused_queues (queue, paused_at) VALUES (?, ?) ON CONFLICT (queue) DO NOTHING

-- name: resume
DELETE FROM rdq_paused_queues WHERE queue = ?

-- name: paused
SELECT queue FROM rdq_paused_queues ORDER BY queue

-- name: audit_append
INSERT INTO rdq_audit (id, at, actor, action, queue, selection, count)
VALUES (:id, :at, :actor, :action, :queue, :selection, :count)

-- name: audit_page
-- The condition is built from the audit_* fragments; rows come newest first.
SELECT id, at, actor, action, queue, selection, count FROM rdq_audit
 WHERE {where} ORDER BY at DESC, id DESC LIMIT ?

-- name: audit_any
1 = 1

-- name: audit_queue
AND queue = ?

-- name: audit_before
AND (at, id) < (?, ?)

-- name: doc_get
SELECT version, body FROM rdq_documents WHERE kind = ? AND key = ?

-- name: doc_insert
INSERT INTO rdq_documents (kind, key, version, body) VALUES (?, ?, 1, ?)
ON CONFLICT (kind, key) DO NOTHING RETURNING version

-- name: doc_replace
UPDATE rdq_documents SET version = version + 1, body = ? WHERE kind = ? AND key = ? AND version = ?
RETURNING version

-- name: doc_delete
DELETE FROM rdq_documents WHERE kind = ? AND key = ? AND version = ?

-- name: doc_page
SELECT key, version, body FROM rdq_documents WHERE kind = ? AND key > ? ORDER BY key LIMIT ?

-- name: task_events
-- The lifecycle events of tasks this transaction just changed (rdq_core/events.py), inserted in
-- the same transaction: a settle's DEAD (and, when asked, SUCCEEDED) tasks, a redrive's PENDING
-- ones. The id is the task id, the kind, the attempt number (a redrive: the new redrive count)
-- and the task's creation instant (µs), so writing one change twice is one event and a task id
-- reused after a purge names new events (rdq_core/events.py task_event_id).
INSERT OR IGNORE INTO rdq_outbox (id, type, queue, task_id, at, detail)
SELECT e.id || ':' || e.kind || ':' || CASE e.kind WHEN 'redriven' THEN e.redrive_count ELSE e.attempt END
            || ':' || e.created_at,
       'rdq.task.' || e.kind, e.queue, e.id, :now,
       json_object('handler', e.handler, 'attempt', e.attempt, 'redrive_count', e.redrive_count,
                   'error', json(CASE WHEN e.kind = 'succeeded' THEN NULL ELSE e.last_error END),
                   'payload', CASE WHEN :with_payload THEN json(e.payload) END)
  FROM (SELECT t.id, t.queue, t.handler, t.redrive_count, t.last_error, t.payload, t.created_at,
               CASE t.status WHEN 'PENDING' THEN 'redriven' ELSE lower(t.status) END AS kind,
               COALESCE((SELECT MAX(h.attempt_no) FROM rdq_attempts AS h WHERE h.task_id = t.id), 0) AS attempt
          FROM rdq_tasks AS t
         WHERE t.id IN (SELECT value FROM json_each(:ids))
           AND t.status IN (SELECT value FROM json_each(:statuses))) AS e
 ORDER BY e.id

-- name: outbox_put
INSERT OR IGNORE INTO rdq_outbox (id, type, queue, task_id, at, detail) VALUES (?, ?, ?, ?, ?, ?)

-- name: outbox_take
-- The oldest events not leased to someone else, leased in the same statement.
UPDATE rdq_outbox SET leased_until = :until
 WHERE seq IN (SELECT seq FROM rdq_outbox WHERE leased_until <= :now ORDER BY seq LIMIT :limit)
RETURNING seq, id, type, queue, task_id, at, detail

-- name: outbox_ack
DELETE FROM rdq_outbox WHERE id IN ({marks})
