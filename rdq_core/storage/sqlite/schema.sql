-- The complete SQLite schema as it stands after every file under migrations/ (a test applies
-- both to fresh databases and compares the catalogs). A database created from this file alone
-- records the migration version it equals, so the backend sees it as up to date.
CREATE TABLE rdq_tasks (
    id               TEXT PRIMARY KEY,
    queue            TEXT NOT NULL,
    handler          TEXT NOT NULL,
    payload          TEXT NOT NULL,
    headers          TEXT NOT NULL,
    status           TEXT NOT NULL CHECK (status IN ('PENDING','IN_FLIGHT','SUCCEEDED','DEAD','CANCELLED')),
    attempt_count    INTEGER NOT NULL DEFAULT 0 CHECK (attempt_count >= 0),
    redrive_count    INTEGER NOT NULL DEFAULT 0 CHECK (redrive_count >= 0),
    max_attempts     INTEGER,
    backoff          TEXT,
    next_attempt_at  INTEGER NOT NULL,
    claim_token      TEXT,
    claimed_at       INTEGER,
    lease_expires_at INTEGER,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    dead_at          INTEGER,
    result           TEXT,
    last_error_type  TEXT,
    last_error       TEXT,
    priority         INTEGER NOT NULL DEFAULT 0 CHECK (priority BETWEEN 0 AND 9),
    concurrency_key  TEXT,
    rate_key         TEXT,
    task_group       TEXT,
    dedupe_key       TEXT,
    claimed_by       TEXT,
    CHECK ((status = 'IN_FLIGHT') = (claim_token IS NOT NULL AND lease_expires_at IS NOT NULL)),
    CHECK ((status = 'DEAD') = (dead_at IS NOT NULL))
);
-- (quoted: migration 0006 rebuilt it under another name and renamed it, which quotes the name)
CREATE TABLE "rdq_attempts" (
    task_id     TEXT NOT NULL REFERENCES rdq_tasks(id) ON DELETE CASCADE,
    attempt_no  INTEGER NOT NULL CHECK (attempt_no >= 1),
    outcome     TEXT NOT NULL CHECK (outcome IN ('SUCCESS','RETRYABLE_FAILURE','PERMANENT_FAILURE','LEASE_EXPIRED','SNOOZED')),
    started_at  INTEGER,
    finished_at INTEGER,
    error       TEXT,
    PRIMARY KEY (task_id, attempt_no)
);
CREATE INDEX rdq_tasks_leases ON rdq_tasks (lease_expires_at) WHERE status = 'IN_FLIGHT';
CREATE INDEX rdq_tasks_dead ON rdq_tasks (queue, dead_at, id) WHERE status = 'DEAD';
CREATE INDEX rdq_tasks_finished ON rdq_tasks (updated_at) WHERE status IN ('SUCCEEDED','CANCELLED');
CREATE INDEX rdq_tasks_queue_status ON rdq_tasks (queue, status);
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
CREATE TABLE rdq_documents (
    kind    TEXT NOT NULL,
    key     TEXT NOT NULL,
    version INTEGER NOT NULL CHECK (version >= 1),
    body    TEXT NOT NULL,
    PRIMARY KEY (kind, key)
) WITHOUT ROWID;
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
CREATE INDEX rdq_tasks_claim ON rdq_tasks (queue, priority, next_attempt_at, id) WHERE status = 'PENDING';
CREATE INDEX rdq_tasks_in_flight_key ON rdq_tasks (queue, concurrency_key) WHERE status = 'IN_FLIGHT';
CREATE INDEX rdq_tasks_pending_group ON rdq_tasks (queue, task_group, priority, next_attempt_at, id)
    WHERE status = 'PENDING' AND task_group IS NOT NULL;
CREATE TABLE rdq_rate_log (
    queue      TEXT NOT NULL,
    rate_key   TEXT NOT NULL,
    claimed_at INTEGER NOT NULL,
    task_id    TEXT NOT NULL
);
CREATE INDEX rdq_rate_log_key ON rdq_rate_log (queue, rate_key, claimed_at);
CREATE TABLE rdq_fair_cursor (
    queue      TEXT PRIMARY KEY,
    last_group TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX rdq_tasks_dedupe ON rdq_tasks (queue, dedupe_key, created_at, id) WHERE dedupe_key IS NOT NULL;
PRAGMA user_version = 9;
