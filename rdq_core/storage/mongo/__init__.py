"""MongoDB backend (pymongo 4.x): ``mongodb://host:27017/rdq`` or ``mongodb+srv://…/rdq``.

* ``backend.py`` -- ``MongoStorage``: the task lifecycle's primitives (enqueue, claim, extend,
  settle, release, the expired-lease scan, get, cancel), composed with the parts below.
* ``connection.py`` -- the client, its timeouts, the collections, ``migrate`` and the server clock.
* ``history.py`` -- attempt rows: recorded, carried by their task until then, purged after it.
* ``outbox.py`` -- lifecycle events, on the task document first, then in the outbox.
* ``selections.py`` -- keyset pages, counts, cancel by filter, the DLQ's redrive and purge.
* ``operator.py`` -- counts, queues, retention, pausing, the audit trail, engine documents.
* ``shapes.py`` -- task documents, fencing and selection filters, keyset bounds, epoch ms.
* ``flow_claim.py`` -- the claim under a flow policy.
* ``migrations/`` -- the collections and indexes, one JSON file per schema version.

Layout (database from the URL path, default ``rdq``):

* ``tasks``    -- one document per task, ``_id`` = task id (copied to ``task_id`` for indexes).
  Instants are stored as int64 milliseconds since the epoch (``*_ms`` fields), not BSON dates.
  ``payload``, ``headers`` and ``result`` are stored as JSON *strings* so any JSON (keys with
  ``$`` or ``.``) round-trips.
* ``attempts`` -- one document per attempt, unique on ``(task_id, attempt_no)``.
* ``schema``   -- the schema version written by ``migrate``.
* ``queues``   -- per-queue flags, ``_id`` = queue name: ``paused``. A claim reads its queue's
  flag (one ``_id`` probe) just before claiming: findAndModify cannot look at another
  collection, so the check is a separate round trip, not part of the claim's atomic step.
* ``audit``    -- the append-only trail of operator actions, ``_id`` = entry id (copied to
  ``entry_id`` for indexes), ``at_ms`` from the server clock.
* ``documents`` -- engine documents (bulk operations, their per-queue locks): ``_id`` = kind and
  key joined by a space, plus ``kind``, ``key``, ``version`` and ``body`` (JSON text), unique
  on ``(kind, key)``. Insert-if-absent is an ``insert_one``, replace and delete at a version
  are single-document commands filtered on ``version``: each one command, atomic on its own;
  a page is one ``find`` on the ``(kind, key)`` index.

Every status's tasks are listed by ``(queue, status, order field, task_id)`` through an index
partial on that status (``migrations/``); ``cancel_selected`` is one ``update_many`` whose
filter each document is re-checked against as it is written (atomic per task, not per
selection).

Time: the server's clock is the authority. Every call that needs "now" reads it once with the
``hello`` command's ``localTime`` and uses that value as a literal in its filters and updates.
(``$$NOW`` would need update pipelines, which the nx-27017 test server does not implement; see
docs/mongo-backend.md.)

Settlement is two writes that must stay crash-safe without a transaction:

1. the fenced task update is the commit point. It compares-and-sets ``attempt_seq`` (the
   highest attempt number the task has committed, never reset) and, in the same atomic
   single-document update, appends the new attempt row to ``pending_attempts``: the rows the
   task has committed but not yet seen in the ``attempts`` collection;
2. the rows are then inserted idempotently (the unique index turns a repeat into a no-op).

A row leaves ``pending_attempts`` only in a commit that has seen it recorded: the next settle
of the task reads its carried rows back from ``attempts`` (one ``find``; a row a crashed
settle never inserted is inserted first). So every committed attempt is at all times in the
collection, on the task, or both -- whatever point a process dies at, however many settles
in a row die. Reads (``get``, ``list_dead``) merge the task's pending rows into the history
without writing; the next settle (a worker's or the reaper's) records them. Redrive keeps them
on the task; a purge deletes them with it.

Each task document has a random ``incarnation``, copied into its attempt rows: rows left behind
by a purge that died half way (or raced a late insert) belong to an earlier task with the same
id and are never shown as, nor allowed to block, the history of a new one.

Every call is bounded in time: ``connectTimeoutMS`` (10 s), ``socketTimeoutMS`` (30 s) and
``serverSelectionTimeoutMS`` (10 s) apply unless the URL sets them, and a timeout surfaces as
``StorageUnavailable``.
"""

from .backend import MongoStorage

__all__ = ["MongoStorage"]
