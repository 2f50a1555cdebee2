-- Lifecycle events (rdq_core/events.py): the outbox. A task event is inserted by the settle or
-- redrive transaction that makes the change, and deleted once delivered. seq is the write order
-- (the order events are taken in); leased_until (epoch µs, 0 = never taken) keeps a taken batch
-- from a second deliverer until it passes.
CREATE TABLE rdq_outbox (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    id           TEXT NOT NULL UNIQUE,
    type         TEXT NOT NULL,
    queue        TEXT NOT NULL,
    task_id      TEXT,
    at           INTEGER NOT NULL,
    detail       TEXT NOT NULL,
    leased_until INTEGER NOT NULL DEFAULT 0
);
