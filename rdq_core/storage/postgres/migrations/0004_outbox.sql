-- rdq schema v4: the outbox of lifecycle events (rdq_core/events.py).
--
-- A new table only: nothing existing is locked or rewritten. A task event is inserted by the
-- settle or redrive statement that makes the change (a CTE of the same statement), and deleted
-- once delivered. seq is the write order events are taken in; leased_until keeps a taken batch
-- from a second deliverer until it passes. The id is deterministic per state change (unique), so
-- writing one change twice is one event.
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
