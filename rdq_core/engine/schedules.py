"""Schedules: periodic tasks that are enqueued exactly once per period.

A schedule is a name, a ``cron(...)`` or ``rate(...)`` expression (EventBridge Scheduler's
syntax), an IANA time zone, and the task it enqueues (queue, handler, payload, optional
``max_attempts``). Firing it for the scheduled instant ``T`` enqueues a task whose id is
``sched.<name>.<T in UTC as 20261203T170000Z>`` (``task_id_for``). The id is the whole
exactly-once argument: enqueue is idempotent by id, so a duplicate trigger, a retried trigger, or
two hosts firing the same period (``rdq dev`` and ``rdq worker`` side by side) make one task.
``:`` would read better but is not a task-id character (``validation.TASK_ID``); the name can
hold dots, the instant cannot and has a fixed length, so the id still reads back unambiguously.

Who fires:

* deployed: one EventBridge Scheduler schedule per rdq schedule (``SchedulerBook``, over
  ``rdq_core/aws/scheduler.py``); its target is the worker function with an input holding the
  definition and ``<aws.scheduler.scheduled-time>``, and the worker calls ``fire`` with that time;
* ``rdq dev`` and ``rdq worker``: a ``ScheduleFirer`` reads the same definitions from a local
  file (``LocalScheduleBook``) and fires them on each tick, under the catch-up policy below.

Catch-up policy (local firers): at each tick a schedule fires the most recent period whose
instant has come (``latest_at_or_before(now)``), if it has not fired it already. After downtime
the most recent missed period fires once, late; the periods before it are skipped, never
replayed as a backlog. Periods before the schedule was created (or last replaced) never fire.
On AWS, EventBridge Scheduler itself decides: it fires each period on time and retries delivery
under the schedule's retry policy; the id makes each retry a no-op once the task exists.

Expressions, their grammar, time zones and daylight saving time: ``rdq_core/engine/cron.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from .. import validation
from ..aws.scheduler import EventBridgeScheduler, fired_definition
from ..errors import InvalidInput, ScheduleNotFound, TaskConflict
from ..model import EnqueueResult, NewTask
from .cron import CronExpression, RateExpression, as_utc, parse_expression

log = logging.getLogger("rdq.schedules")

#: EventBridge Scheduler's own rule for a schedule name (1..64 of ``[0-9a-zA-Z-_.]``).
SCHEDULE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
ID_PREFIX = "sched"
_INSTANT_FORMAT = "%Y%m%dT%H%M%SZ"
_FIELDS = ("name", "expression", "timezone", "queue", "handler", "payload", "max_attempts", "created_at")
#: The default file of local schedules (``RDQ_SCHEDULES_FILE`` overrides it).
DEFAULT_SCHEDULES_FILE = "rdq-schedules.json"


# -- ids ---------------------------------------------------------------------------------------
def task_id_for(name: str, instant: datetime) -> str:
    """The task id of schedule ``name``'s period at ``instant`` (to the second, in UTC)."""
    return f"{ID_PREFIX}.{name}.{as_utc(instant).strftime(_INSTANT_FORMAT)}"


def parse_scheduled_time(text: Any) -> datetime:
    """``<aws.scheduler.scheduled-time>`` as Scheduler substitutes it (``2022-03-22T18:59:43Z``)."""
    if not isinstance(text, str):
        raise InvalidInput("scheduled_time must be an ISO 8601 instant", "scheduled_time")
    try:
        instant = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidInput(f"scheduled_time {text[:40]!r} is not an ISO 8601 instant", "scheduled_time") from None
    if instant.tzinfo is None:
        raise InvalidInput("scheduled_time needs a UTC offset or Z", "scheduled_time")
    return as_utc(instant).replace(microsecond=0)


# -- the model ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Schedule:
    name: str
    expression: str
    queue: str
    handler: str
    payload: Any = None
    timezone: str = "UTC"
    max_attempts: int | None = None
    #: When this definition was created or last replaced: no period before it fires.
    created_at: datetime | None = None

    def parsed(self, *, allow_seconds: bool = True) -> RateExpression | CronExpression:
        return parse_expression(self.expression, self.timezone, allow_seconds=allow_seconds)

    def task_id(self, instant: datetime) -> str:
        return task_id_for(self.name, instant)

    def new_task(self, instant: datetime) -> NewTask:
        return NewTask(id=self.task_id(instant), queue=self.queue, handler=self.handler, payload=self.payload,
                       max_attempts=self.max_attempts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "expression": self.expression, "timezone": self.timezone, "queue": self.queue,
            "handler": self.handler, "payload": self.payload, "max_attempts": self.max_attempts,
            "created_at": _iso(self.created_at),
        }

    @classmethod
    def from_dict(cls, data: Any, *, allow_seconds: bool = True, check_expression: bool = True) -> "Schedule":
        """Validate a definition (an API body, a file entry, a Scheduler target's input).
        ``check_expression=False``: the expression and time zone are taken as they are (a
        Scheduler trigger, which Scheduler itself evaluated)."""
        if not isinstance(data, Mapping):
            raise InvalidInput("a schedule must be an object", "schedule")
        unknown = set(data) - set(_FIELDS)
        if unknown:
            raise InvalidInput(f"unknown fields: {', '.join(sorted(map(str, unknown)))}", sorted(map(str, unknown))[0])
        name = data.get("name")
        if not isinstance(name, str) or not SCHEDULE_NAME.fullmatch(name):
            raise InvalidInput("name must be 1..64 characters of A-Z a-z 0-9 . _ - (not starting with .)", "name")
        timezone_name = data.get("timezone", "UTC")
        expression = data.get("expression")
        if check_expression:
            parse_expression(expression, timezone_name, allow_seconds=allow_seconds)
        if not isinstance(expression, str) or not isinstance(timezone_name, str):
            raise InvalidInput("expression and timezone must be strings", "expression")
        created = data.get("created_at")
        return cls(
            name=name, expression=expression, timezone=timezone_name,
            queue=validation.queue_name(data.get("queue")), handler=validation.handler_name(data.get("handler")),
            payload=validation.json_value(data.get("payload"), validation.Limits.payload_bytes, "payload"),
            max_attempts=validation.max_attempts(data.get("max_attempts")),
            created_at=parse_scheduled_time(created) if created is not None else None,
        )


def due_instant(schedule: Schedule, now: datetime, last_fired: datetime | None = None) -> datetime | None:
    """The period to fire at ``now`` under the catch-up policy, or None.

    The most recent period at or before ``now``; None if it precedes the schedule's creation or
    is not after ``last_fired``. So after any downtime exactly one period fires (the latest),
    and a tick that comes again within the same period fires nothing."""
    latest = schedule.parsed().latest_at_or_before(now, not_before=schedule.created_at)
    if latest is None or (last_fired is not None and latest <= last_fired):
        return None
    return latest


# -- firing ------------------------------------------------------------------------------------
class _Enqueuer(Protocol):
    def enqueue_new(self, new_task: NewTask) -> EnqueueResult: ...


@dataclass(frozen=True)
class Fired:
    schedule: str
    instant: datetime
    task_id: str
    #: False when the period's task already existed (a duplicate or retried trigger).
    created: bool


def fire(client: _Enqueuer, schedule: Schedule, instant: datetime) -> Fired:
    """Enqueue ``schedule``'s task for the period at ``instant``; idempotent by the task id.

    Every host fires through here (the Lambda worker on a Scheduler trigger, ``rdq dev``,
    ``rdq worker``). If the id exists on another queue (the schedule's queue changed after the
    period fired), the period counts as fired and nothing is written."""
    new_task = schedule.new_task(instant)
    try:
        result = client.enqueue_new(new_task)
        created = result.created
    except TaskConflict:
        created = False
    if created:
        log.info("schedule %s fired %s", schedule.name, new_task.id)
    return Fired(schedule.name, as_utc(instant), new_task.id, created)


# -- where definitions live --------------------------------------------------------------------
class ScheduleBook(Protocol):
    def put(self, schedule: Schedule) -> Schedule: ...

    def list(self) -> list[Schedule]: ...

    def delete(self, name: str) -> None: ...


def default_schedules_file() -> Path:
    return Path(os.environ.get("RDQ_SCHEDULES_FILE") or DEFAULT_SCHEDULES_FILE)


class LocalScheduleBook:
    """Schedules in a JSON file (``{"schedules": [...]}``), for ``rdq dev`` and ``rdq worker``.

    A file, not the store: both hosts read the same definitions from their working directory
    (as they share ``./rdq.db``), it can be written by hand or shipped with the handler modules,
    and it needs no schema change in any of the four backends. Correctness does not depend on
    where definitions live: the task id makes every firing idempotent in the store itself.
    Writes replace the file atomically (write, then rename)."""

    def __init__(self, path: str | Path | None = None, *, clock: Callable[[], datetime] | None = None) -> None:
        self.path = Path(path) if path is not None else default_schedules_file()
        self._clock = clock or (lambda: datetime.now(timezone.utc))
        self._lock = threading.Lock()
        self._cache: tuple[tuple[int, int], list[Schedule]] | None = None

    def list(self) -> list[Schedule]:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return []
        key = (stat.st_mtime_ns, stat.st_size)
        if self._cache is not None and self._cache[0] == key:
            return list(self._cache[1])
        try:
            data = json.loads(self.path.read_text(encoding="utf-8") or "{}")
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"{self.path}: not a schedules file ({exc})", "schedules") from None
        entries = data.get("schedules", []) if isinstance(data, Mapping) else None
        if not isinstance(entries, list):
            raise InvalidInput(f"{self.path}: expected {{\"schedules\": [...]}}", "schedules")
        schedules = sorted((Schedule.from_dict(entry) for entry in entries), key=lambda s: s.name)
        self._cache = (key, schedules)
        return list(schedules)

    def get(self, name: str) -> Schedule:
        for schedule in self.list():
            if schedule.name == name:
                return schedule
        raise ScheduleNotFound(name)

    def put(self, schedule: Schedule) -> Schedule:
        """Create or replace; the stored definition's ``created_at`` is now (a replaced schedule
        never fires a period from before the replacement)."""
        stored = replace(schedule, created_at=self._clock().replace(microsecond=0))
        with self._locked():
            others = [s for s in self.list() if s.name != schedule.name]
            self._write([*others, stored])
        return stored

    def delete(self, name: str) -> None:
        if not self.path.exists():  # nothing to delete: leave no lock file behind either
            raise ScheduleNotFound(name)
        with self._locked():
            schedules = self.list()
            if not any(s.name == name for s in schedules):
                raise ScheduleNotFound(name)
            self._write([s for s in schedules if s.name != name])

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One writer at a time, across threads and processes (``rdq dev``'s API and the CLI):
        an exclusive lock on a sidecar file, so no read-modify-write loses another's change."""
        with self._lock, open(self.path.with_name(f".{self.path.name}.lock"), "a+b") as lock_file:
            try:
                import fcntl
            except ImportError:  # not POSIX: the thread lock only
                yield
                return
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
            try:
                self._cache = None  # another process may have written since
                yield
            finally:
                fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)

    def _write(self, schedules: Sequence[Schedule]) -> None:
        body = json.dumps({"schedules": [s.to_dict() for s in sorted(schedules, key=lambda s: s.name)]}, indent=2)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        temporary.write_text(body + "\n", encoding="utf-8")
        os.replace(temporary, self.path)
        self._cache = None


class ScheduleFirer:
    """Fires a book's schedules on a host's ticks (``rdq dev``, ``rdq worker``).

    ``tick`` fires, for each schedule, ``due_instant(schedule, now, last fired)``; the last
    instant fired is remembered per definition (a replaced definition starts over). A firing
    that fails (store unreachable) is retried on the next tick."""

    def __init__(self, client: _Enqueuer, book: LocalScheduleBook,
                 clock: Callable[[], datetime] | None = None) -> None:
        self.client = client
        self.book = book
        self.clock = clock or (lambda: datetime.now(timezone.utc))
        self._last: dict[str, tuple[Schedule, datetime]] = {}

    def tick(self) -> list[Fired]:
        now = self.clock()
        try:
            schedules = self.book.list()
        except InvalidInput as exc:
            log.error("schedules not read: %s", exc)
            return []
        fired: list[Fired] = []
        for schedule in schedules:
            remembered = self._last.get(schedule.name)
            last = remembered[1] if remembered is not None and remembered[0] == schedule else None
            instant = due_instant(schedule, now, last)
            if instant is None:
                continue
            fired.append(fire(self.client, schedule, instant))
            self._last[schedule.name] = (schedule, instant)
        for name in set(self._last) - {s.name for s in schedules}:
            del self._last[name]
        return fired

    def run(self, stop: threading.Event, every: float = 1.0) -> None:
        """Tick every ``every`` seconds until ``stop`` is set; errors are logged, then retried."""
        while True:
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - the store may be down: the next tick retries
                log.warning("firing schedules failed (%s: %s); retrying in %gs", type(exc).__name__, exc, every)
            if stop.wait(every):
                return


# -- what Client, HttpClient and the routes share ---------------------------------------------
def _iso(instant: datetime | None) -> str | None:
    return instant.astimezone(timezone.utc).isoformat().replace("+00:00", "Z") if instant is not None else None


def schedule_body(schedule: Schedule, now: datetime | None = None) -> dict[str, Any]:
    """A schedule as the API answers it: its definition and its next fire time."""
    try:
        upcoming = schedule.parsed().next_after(now or datetime.now(timezone.utc))
    except InvalidInput:  # a zone this host's time zone database lacks: still listed, without a time
        upcoming = None
    return {**schedule.to_dict(), "next_fire_at": _iso(upcoming), "next_task_id": schedule.task_id(upcoming)
            if upcoming is not None else None}


def schedule_from_body(body: Mapping[str, Any]) -> Schedule:
    """A schedule from an API answer (``schedule_body``)."""
    return Schedule.from_dict({k: v for k, v in body.items() if k in _FIELDS})


def put_schedule(book: "ScheduleBook", definition: "Schedule | Mapping[str, Any]") -> Schedule:
    """Validate ``definition`` for ``book`` (seconds-level rates only for a local book) and store it."""
    data = definition.to_dict() if isinstance(definition, Schedule) else definition
    if isinstance(data, Mapping) and "created_at" in data:
        data = {k: v for k, v in data.items() if k != "created_at"}
    schedule = Schedule.from_dict(data, allow_seconds=isinstance(book, LocalScheduleBook))
    return book.put(schedule)


def delete_schedule(book: "ScheduleBook", name: Any) -> None:
    if not isinstance(name, str) or not SCHEDULE_NAME.fullmatch(name):
        raise InvalidInput("name must be 1..64 characters of A-Z a-z 0-9 . _ - (not starting with .)", "name")
    book.delete(name)


class ScheduleClient:
    """The schedule methods of ``Client`` over one book, without a store (``rdq schedules``)."""

    def __init__(self, book: "ScheduleBook") -> None:
        self.schedule_book = book

    def put_schedule(self, definition: "Schedule | Mapping[str, Any]") -> Schedule:
        return put_schedule(self.schedule_book, definition)

    def list_schedules(self) -> list[Schedule]:
        return list(self.schedule_book.list())

    def delete_schedule(self, name: str) -> None:
        delete_schedule(self.schedule_book, name)


# -- EventBridge Scheduler (the deployed stack) ------------------------------------------------
def scheduled_firing(event: Mapping[str, Any]) -> tuple[Schedule, datetime] | None:
    """The schedule and instant of a Scheduler-triggered invocation, None for any other event."""
    fired = fired_definition(event)
    if fired is None:
        return None
    definition, scheduled_time = fired
    # Scheduler evaluated the expression already: firing needs no time zone database.
    schedule = Schedule.from_dict(definition, allow_seconds=False, check_expression=False)
    return schedule, parse_scheduled_time(scheduled_time)


class SchedulerBook:
    """Schedules as EventBridge Scheduler schedules in one group (``RDQ_SCHEDULE_GROUP``).

    Scheduler holds the whole definition (in the target's input), so it is the only place one
    lives. The calls, their short timeouts and their errors are ``EventBridgeScheduler``'s."""

    def __init__(self, group: str, role_arn: str, target_arn: str, client: Any = None) -> None:
        self.scheduler = EventBridgeScheduler(group, role_arn, target_arn, client)

    def put(self, schedule: Schedule) -> Schedule:
        parsed = schedule.parsed(allow_seconds=False)  # Scheduler has no seconds
        # Rates count from the Unix epoch everywhere: start on the next aligned instant.
        start = parsed.next_after(datetime.now(timezone.utc)) if isinstance(parsed, RateExpression) else None
        self.scheduler.put(schedule.to_dict(), description=f"rdq: {schedule.handler} on {schedule.queue}",
                           start_date=start)
        return replace(schedule, created_at=None)

    def get(self, name: str) -> Schedule:
        # Scheduler accepted it when it was created: reading it back needs no time zone database.
        return Schedule.from_dict(self.scheduler.definition(name), allow_seconds=False, check_expression=False)

    def list(self) -> list[Schedule]:
        schedules = []
        for name in sorted(self.scheduler.names()):
            try:
                schedules.append(self.get(name))
            except (ScheduleNotFound, InvalidInput):
                continue  # deleted meanwhile, or not one of ours
        return schedules

    def delete(self, name: str) -> None:
        self.scheduler.delete(name)


def schedule_book_from_env(environ: Mapping[str, str] | None = None) -> LocalScheduleBook | SchedulerBook:
    """The deployed API's ``SchedulerBook`` when ``RDQ_SCHEDULE_GROUP`` is set, else the local file."""
    env = os.environ if environ is None else environ
    group = env.get("RDQ_SCHEDULE_GROUP", "")
    if group:
        return SchedulerBook(group, env.get("RDQ_SCHEDULER_ROLE_ARN", ""), env.get("RDQ_SCHEDULE_TARGET_ARN", ""))
    return LocalScheduleBook(env.get("RDQ_SCHEDULES_FILE") or None)


def wall_clock() -> datetime:
    return datetime.fromtimestamp(time.time(), timezone.utc)
