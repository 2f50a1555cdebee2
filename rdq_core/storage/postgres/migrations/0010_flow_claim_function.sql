-- rdq schema v10: the flow-controlled claim under concurrency limits as a function.
--
-- rdq sends no server-side prepared statements (they break behind PgBouncer in transaction mode
-- and pin RDS Proxy sessions), so a long statement is parsed and planned on every claim: for the
-- claim under concurrency limits that was most of its cost. A PL/pgSQL function keeps its plans
-- for the session, whatever pooler is in front. The claim is one call: it takes the queue's
-- flow lock, reads the clock and the paused flag, then claims by the statement in its loop, which
-- decides as rdq_core.flow.choose does; when a pass's candidate window filled with tasks of keys
-- that filled up during it while allowed tasks wait behind it, it passes again (the work-
-- conserving re-read), and every pass sees the earlier passes' claims in flight.
-- Additive: a new function; workers of the previous version keep their own claim path.
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
