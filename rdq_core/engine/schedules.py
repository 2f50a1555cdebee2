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

* deployed: one EventBridge Scheduler schedule per rdq schedule (``SchedulerBook``); its target
  is the worker function with an input holding the definition and
  ``<aws.scheduler.scheduled-time>``, and the worker calls ``fire`` with that time;
* ``rdq dev`` and ``rdq worker``: a ``ScheduleFirer`` reads the same definitions from a local
  file (``LocalScheduleBook``) and fires them on each tick, under the catch-up policy below.

Catch-up policy (local firers): at each tick a schedule fires the most recent period whose
instant has come (``latest_at_or_before(now)``), if it has not fired it already. After downtime
the most recent missed period fires once, late; the periods before it are skipped, never
replayed as a backlog. Periods before the schedule was created (or last replaced) never fire.
On AWS, EventBridge Scheduler itself decides: it fires each period on time and retries delivery
under the schedule's retry policy; the id makes each retry a no-op once the task exists.

Daylight saving time, as EventBridge Scheduler documents it: a cron time that does not exist
on the day the clocks go forward is skipped; a time that happens twice on the day they go back
fires once (at its first occurrence). A ``rate`` counts fixed UTC durations from the Unix epoch.
"""

from __future__ import annotations

import calendar
import contextlib
import json
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import date, datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .. import validation
from ..errors import InvalidInput, StorageUnavailable, TaskConflict, TaskNotFound
from ..model import EnqueueResult, NewTask

log = logging.getLogger("rdq.schedules")

#: EventBridge Scheduler's own rule for a schedule name (1..64 of ``[0-9a-zA-Z-_.]``).
SCHEDULE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
ID_PREFIX = "sched"
_INSTANT_FORMAT = "%Y%m%dT%H%M%SZ"
_FIELDS = ("name", "expression", "timezone", "queue", "handler", "payload", "max_attempts", "created_at")
#: The default file of local schedules (``RDQ_SCHEDULES_FILE`` overrides it).
DEFAULT_SCHEDULES_FILE = "rdq-schedules.json"
#: EventBridge Scheduler's smallest rate; ``rdq dev``/``rdq worker`` also accept seconds.
_UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


# -- ids ---------------------------------------------------------------------------------------
def _utc(instant: datetime) -> datetime:
    if instant.tzinfo is None:
        raise ValueError("instants must be timezone-aware")
    return instant.astimezone(timezone.utc)


def task_id_for(name: str, instant: datetime) -> str:
    """The task id of schedule ``name``'s period at ``instant`` (to the second, in UTC)."""
    return f"{ID_PREFIX}.{name}.{_utc(instant).strftime(_INSTANT_FORMAT)}"


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
    return _utc(instant).replace(microsecond=0)


# -- expressions -------------------------------------------------------------------------------
class Expression(Protocol):
    text: str

    def next_after(self, instant: datetime) -> datetime | None:
        """The first fire instant strictly after ``instant`` (UTC), or None if there is none."""

    def latest_at_or_before(self, instant: datetime, not_before: datetime | None = None) -> datetime | None:
        """The last fire instant at or before ``instant`` (UTC), not earlier than ``not_before``."""


@dataclass(frozen=True)
class RateExpression:
    text: str
    seconds: int

    def next_after(self, instant: datetime) -> datetime:
        elapsed = math.floor((_utc(instant) - _EPOCH).total_seconds())
        return _EPOCH + timedelta(seconds=(elapsed // self.seconds + 1) * self.seconds)

    def latest_at_or_before(self, instant: datetime, not_before: datetime | None = None) -> datetime | None:
        elapsed = math.floor((_utc(instant) - _EPOCH).total_seconds())
        latest = _EPOCH + timedelta(seconds=elapsed // self.seconds * self.seconds)
        if not_before is not None and latest < _utc(not_before):
            return None
        return latest


_MONTHS = {name: n for n, name in enumerate(("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT",
                                             "NOV", "DEC"), start=1)}
#: Day of week as EventBridge numbers it: 1 = Sunday .. 7 = Saturday.
_DAYS = {name: n for n, name in enumerate(("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"), start=1)}
_MIN_YEAR, _MAX_YEAR = 1970, 2199


def _either(*options: str) -> str:
    return "(?:" + "|".join(options) + ")"


def _list(value: str, step: str, *specials: str) -> str:
    item = _either(_either(r"\*", f"{value}(?:-{value})?") + f"(?:/{step})?", *specials)
    return f"{item}(?:,{item})*"


_MINUTE, _HOUR = r"[0-5]?[0-9]", _either("[01]?[0-9]", "2[0-3]")
_DAY = _either("0?[1-9]", "[12][0-9]", "3[01]")
_MONTH = _either("0?[1-9]", "1[0-2]", *_MONTHS)
_WEEKDAY = _either("[1-7]", *_DAYS)
_YEAR = _either("19[7-9][0-9]", "2[01][0-9]{2}")
#: The exact grammar of an EventBridge Scheduler schedule expression (and of the OpenAPI
#: document's ``expression`` pattern): everything it matches parses, nothing else does.
CRON_PATTERN = (
    r"cron\(" + _list(_MINUTE, _either("[1-9]", "[1-5][0-9]")) + " " + _list(_HOUR, _either("[1-9]", "1[0-9]", "2[0-3]"))
    + " " + _either(
        _list(_DAY, _either("[1-9]", "[12][0-9]", "3[01]"), "L", "LW", _DAY + "W") + " "
        + _list(_MONTH, _either("[1-9]", "1[0-2]")) + r" \?",
        r"\? " + _list(_MONTH, _either("[1-9]", "1[0-2]")) + " "
        + _list(_WEEKDAY, "[1-7]", "L", _WEEKDAY + "L", _WEEKDAY + "#[1-5]"))
    + " " + _list(_YEAR, "[1-9][0-9]{0,2}") + r"\)"
)
_RATE_VALUE = r"(?:1 {unit}|(?:[2-9]|[1-9][0-9]{{1,5}}) {unit}s)"
RATE_PATTERN = r"rate\(" + _either(*(_RATE_VALUE.format(unit=u) for u in ("minute", "hour", "day"))) + r"\)"
RATE_SECONDS_PATTERN = r"rate\(" + _either(*(_RATE_VALUE.format(unit=u) for u in ("second", "minute", "hour", "day"))) + r"\)"
EXPRESSION_PATTERN = _either(RATE_PATTERN, CRON_PATTERN)


def _cron_weekday(day: date) -> int:
    return (day.weekday() + 1) % 7 + 1  # Monday (0) -> 2, Sunday (6) -> 1


def _number(text: str, low: int, high: int, names: Mapping[str, int], what: str) -> int:
    value = names.get(text.upper()) if names else None
    if value is None:
        if not re.fullmatch(r"[0-9]{1,4}", text):
            raise InvalidInput(f"{what}: {text!r} is not a number in {low}..{high}", "expression")
        value = int(text)
    if not low <= value <= high:
        raise InvalidInput(f"{what}: {value} is outside {low}..{high}", "expression")
    return value


def _values(spec: str, low: int, high: int, what: str, names: Mapping[str, int] | None = None) -> frozenset[int]:
    """A list field: ``*``, ``a``, ``a-b``, with an optional ``/step``, comma-separated."""
    result: set[int] = set()
    for item in spec.split(","):
        base, slash, step_text = item.partition("/")
        step = 1
        if slash:
            step = _number(step_text, 1, high, {}, what)
        if base == "*":
            start, end = low, high
        elif "-" in base:
            first, _, last = base.partition("-")
            start, end = _number(first, low, high, names or {}, what), _number(last, low, high, names or {}, what)
            if start > end:  # wraps around: FRI-MON, 22-2
                result.update(range(start, high + 1, step))
                start = low
        else:
            start = _number(base, low, high, names or {}, what)
            end = high if slash else start
        result.update(range(start, end + 1, step))
    return frozenset(result)


@dataclass(frozen=True)
class _DayOfMonth:
    days: frozenset[int] = frozenset()
    last: bool = False
    last_weekday: bool = False
    nearest_weekday: frozenset[int] = frozenset()

    def matches(self, day: date) -> bool:
        month_days = calendar.monthrange(day.year, day.month)[1]
        if day.day in self.days or (self.last and day.day == month_days):
            return True
        if day.weekday() >= 5:
            return False
        if self.last_weekday and day == _nearest_weekday(day.year, day.month, month_days):
            return True
        return any(n <= month_days and day == _nearest_weekday(day.year, day.month, n) for n in self.nearest_weekday)


def _nearest_weekday(year: int, month: int, n: int) -> date:
    """``nW``: the weekday nearest day ``n``, never leaving the month."""
    target = date(year, month, n)
    month_days = calendar.monthrange(year, month)[1]
    if target.weekday() == 5:  # Saturday: Friday, or Monday if Friday is last month
        return target - timedelta(days=1) if n > 1 else target + timedelta(days=2)
    if target.weekday() == 6:  # Sunday: Monday, or Friday if Monday is next month
        return target + timedelta(days=1) if n < month_days else target - timedelta(days=2)
    return target


@dataclass(frozen=True)
class _DayOfWeek:
    days: frozenset[int] = frozenset()
    last_of: frozenset[int] = frozenset()
    nth: frozenset[tuple[int, int]] = frozenset()

    def matches(self, day: date) -> bool:
        weekday = _cron_weekday(day)
        if weekday in self.days:
            return True
        if weekday in self.last_of and day.day + 7 > calendar.monthrange(day.year, day.month)[1]:
            return True
        return (weekday, (day.day - 1) // 7 + 1) in self.nth


def _day_of_month(spec: str) -> _DayOfMonth:
    days: set[int] = set()
    nearest: set[int] = set()
    last = last_weekday = False
    for item in spec.split(","):
        upper = item.upper()
        if upper == "L":
            last = True
        elif upper == "LW":
            last_weekday = True
        elif upper.endswith("W"):
            nearest.add(_number(upper[:-1], 1, 31, {}, "day-of-month"))
        else:
            days.update(_values(item, 1, 31, "day-of-month"))
    return _DayOfMonth(frozenset(days), last, last_weekday, frozenset(nearest))


def _day_of_week(spec: str) -> _DayOfWeek:
    days: set[int] = set()
    last_of: set[int] = set()
    nth: set[tuple[int, int]] = set()
    for item in spec.split(","):
        upper = item.upper()
        if upper == "L":
            days.add(7)  # alone, L in day-of-week means Saturday
        elif upper.endswith("L"):
            last_of.add(_number(upper[:-1], 1, 7, _DAYS, "day-of-week"))
        elif "#" in upper:
            weekday, _, ordinal = upper.partition("#")
            nth.add((_number(weekday, 1, 7, _DAYS, "day-of-week"), _number(ordinal, 1, 5, {}, "day-of-week")))
        else:
            days.update(_values(item, 1, 7, "day-of-week", _DAYS))
    return _DayOfWeek(frozenset(days), frozenset(last_of), frozenset(nth))


@dataclass(frozen=True)
class CronExpression:
    """``cron(minutes hours day-of-month month day-of-week year)`` evaluated in ``zone``."""

    text: str
    zone: tzinfo
    minutes: frozenset[int]
    hours: frozenset[int]
    months: frozenset[int]
    years: frozenset[int]
    day_of_month: _DayOfMonth | None
    day_of_week: _DayOfWeek | None
    times: tuple[tuple[int, int], ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "times", tuple(sorted((h, m) for h in self.hours for m in self.minutes)))

    def _day_matches(self, day: date) -> bool:
        if day.year not in self.years or day.month not in self.months:
            return False
        if self.day_of_month is not None:
            return self.day_of_month.matches(day)
        return self.day_of_week is not None and self.day_of_week.matches(day)

    def _instant(self, day: date, hour: int, minute: int) -> datetime | None:
        """The UTC instant of a local wall time; None if the clocks skip it (spring forward). A
        wall time that happens twice (fall back) is its first occurrence (fold=0)."""
        local = datetime(day.year, day.month, day.day, hour, minute, tzinfo=self.zone)
        instant = local.astimezone(timezone.utc)
        if instant.astimezone(self.zone).replace(tzinfo=None) != local.replace(tzinfo=None):
            return None
        return instant

    def _days(self, start: date, step: int) -> Iterator[date]:
        """Days of the allowed years from ``start`` on (``step`` 1 or -1), skipping other years
        whole, and giving up after 28 allowed years (the calendar repeats): a date that never
        exists (cron(0 0 30 2 ? *)) ends the search instead of walking to 2199."""
        day, budget = start, 28 * 366
        while _MIN_YEAR <= day.year <= _MAX_YEAR and budget > 0:
            if day.year in self.years:
                yield day
                budget -= 1
                day += timedelta(days=step)
                continue
            later = [y for y in self.years if (y > day.year if step > 0 else y < day.year)]
            if not later:
                return
            day = date(min(later), 1, 1) if step > 0 else date(max(later), 12, 31)

    def next_after(self, instant: datetime) -> datetime | None:
        after = _utc(instant)
        start = after.astimezone(self.zone).date() - timedelta(days=1)
        for day in self._days(start, 1):
            if self._day_matches(day):
                for hour, minute in self.times:
                    candidate = self._instant(day, hour, minute)
                    if candidate is not None and candidate > after:
                        return candidate
        return None

    def latest_at_or_before(self, instant: datetime, not_before: datetime | None = None) -> datetime | None:
        at = _utc(instant)
        floor = _utc(not_before) if not_before is not None else None
        start = at.astimezone(self.zone).date() + timedelta(days=1)
        floor_day = floor.astimezone(self.zone).date() - timedelta(days=1) if floor is not None else None
        for day in self._days(start, -1):
            if floor_day is not None and day < floor_day:
                return None
            if self._day_matches(day):
                for hour, minute in reversed(self.times):
                    candidate = self._instant(day, hour, minute)
                    if candidate is not None and candidate <= at:
                        return None if floor is not None and candidate < floor else candidate
        return None


def zone_for(name: Any) -> tzinfo:
    if not isinstance(name, str) or not 0 < len(name) <= 50 or not re.fullmatch(r"[A-Za-z0-9_+\-/]+", name):
        raise InvalidInput("timezone must be an IANA time zone name such as Europe/Paris", "timezone")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        if name == "UTC":  # a host without the time zone database still knows UTC
            return timezone.utc
        raise InvalidInput(f"timezone {name!r} is not a known IANA time zone", "timezone") from None


def parse_expression(text: Any, timezone_name: str = "UTC", *, allow_seconds: bool = False) -> RateExpression | CronExpression:
    """Parse ``rate(value unit)`` or a six-field ``cron(...)``; ``InvalidInput`` if malformed.

    ``allow_seconds`` accepts ``rate(N second[s])``, which EventBridge Scheduler does not have:
    for local hosts only."""
    if not isinstance(text, str) or not 0 < len(text) <= 256:
        raise InvalidInput("expression must be rate(...) or cron(...)", "expression")
    zone = zone_for(timezone_name)
    rate = re.fullmatch(r"rate\(\s*([0-9]{1,6})\s+([a-z]+)\s*\)", text)
    if rate:
        value, unit = int(rate.group(1)), rate.group(2)
        singular = unit.rstrip("s") if unit.endswith("s") else unit
        if singular not in _UNIT_SECONDS or (singular == "second" and not allow_seconds):
            units = "second(s), minute(s), hour(s) or day(s)" if allow_seconds else "minute(s), hour(s) or day(s)"
            raise InvalidInput(f"rate unit must be {units}", "expression")
        if value < 1:
            raise InvalidInput("rate value must be a positive integer", "expression")
        if (value == 1) != (unit == singular):
            raise InvalidInput("rate(1 minute) takes a singular unit, larger values a plural one (rate(5 minutes))",
                               "expression")
        if not re.fullmatch(RATE_SECONDS_PATTERN, text):
            raise InvalidInput("rate(...) is malformed: rate(value unit), one space, no leading zero", "expression")
        return RateExpression(text, value * _UNIT_SECONDS[singular])
    cron = re.fullmatch(r"cron\((.*)\)", text)
    if not cron:
        raise InvalidInput("expression must be rate(value unit) or cron(minutes hours day-of-month month "
                           "day-of-week year)", "expression")
    parts = cron.group(1).split()
    if len(parts) != 6:
        raise InvalidInput("cron(...) takes six fields: minutes hours day-of-month month day-of-week year",
                           "expression")
    if not re.fullmatch(CRON_PATTERN, text):
        raise InvalidInput("cron(...) is malformed: six fields separated by one space, each a list of *, n, n-m, "
                           "*/step or n/step (plus ? L W # in the day fields)", "expression")
    minutes, hours, dom, month, dow, year = parts
    if (dom == "?") == (dow == "?"):
        raise InvalidInput("cron(...): one of day-of-month and day-of-week must be ?, and only one", "expression")
    for label, spec in (("minutes", minutes), ("hours", hours), ("month", month), ("year", year)):
        if "?" in spec:
            raise InvalidInput(f"cron(...): ? is only for day-of-month or day-of-week, not {label}", "expression")
    return CronExpression(
        text=text, zone=zone,
        minutes=_values(minutes, 0, 59, "minutes"), hours=_values(hours, 0, 23, "hours"),
        months=_values(month, 1, 12, "month", _MONTHS), years=_values(year, _MIN_YEAR, _MAX_YEAR, "year"),
        day_of_month=None if dom == "?" else _day_of_month(dom),
        day_of_week=None if dow == "?" else _day_of_week(dow),
    )


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
    return Fired(schedule.name, _utc(instant), new_task.id, created)


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


class ScheduleNotFound(TaskNotFound):
    """No schedule by that name. A ``TaskNotFound`` so that every caller maps it as it maps a
    missing task (404, exit code 3)."""

    def __init__(self, name: str) -> None:
        Exception.__init__(self, f"no schedule named {name!r}")
        self.task_id = name
        self.name = name


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
#: The key of a Scheduler target's input that marks an rdq firing for the worker function.
EVENT_KEY = "rdq_schedule"
SCHEDULED_TIME = "<aws.scheduler.scheduled-time>"


def target_input(schedule: Schedule) -> str:
    """The Scheduler target's ``Input``: the definition and the scheduled-time context attribute,
    which Scheduler substitutes with each period's instant."""
    definition = {k: v for k, v in schedule.to_dict().items() if k != "created_at"}
    return json.dumps({EVENT_KEY: definition, "scheduled_time": SCHEDULED_TIME}, separators=(",", ":"))


def scheduled_firing(event: Mapping[str, Any]) -> tuple[Schedule, datetime] | None:
    """The schedule and instant of a Scheduler-triggered invocation, None for any other event."""
    if not isinstance(event, Mapping) or EVENT_KEY not in event:
        return None
    # Scheduler evaluated the expression already: firing needs no time zone database.
    schedule = Schedule.from_dict(event[EVENT_KEY], allow_seconds=False, check_expression=False)
    return schedule, parse_scheduled_time(event.get("scheduled_time"))


class _SchedulerRefused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class SchedulerBook:
    """Schedules as EventBridge Scheduler schedules in one group (``RDQ_SCHEDULE_GROUP``).

    Scheduler holds the whole definition (in the target's input), so it is the only place one
    lives; calls use short timeouts so an API request never waits long on it."""

    def __init__(self, group: str, role_arn: str, target_arn: str, client: Any = None) -> None:
        self.group = group
        self.role_arn = role_arn
        self.target_arn = target_arn
        self._client = client

    @property
    def client(self) -> Any:
        if self._client is None:
            from ..aws.clients import aws_client

            self._client = aws_client("scheduler")
        return self._client

    def _request(self, schedule: Schedule) -> dict[str, Any]:
        request: dict[str, Any] = {
            "Name": schedule.name, "GroupName": self.group, "ScheduleExpression": schedule.expression,
            "ScheduleExpressionTimezone": schedule.timezone, "FlexibleTimeWindow": {"Mode": "OFF"},
            "State": "ENABLED", "Description": f"rdq: {schedule.handler} on {schedule.queue}",
            "Target": {"Arn": self.target_arn, "RoleArn": self.role_arn, "Input": target_input(schedule),
                       "RetryPolicy": {"MaximumEventAgeInSeconds": 3600, "MaximumRetryAttempts": 10}},
        }
        parsed = schedule.parsed(allow_seconds=False)
        if isinstance(parsed, RateExpression):
            # Rates count from the Unix epoch everywhere: start on the next aligned instant.
            request["StartDate"] = parsed.next_after(datetime.now(timezone.utc))
        return request

    def _call(self, operation: str, **request: Any) -> Any:
        """One Scheduler call; its failures become rdq's errors: a missing schedule
        ``ScheduleNotFound``, a refused request ``InvalidInput`` (422), anything that may pass
        (throttling, a timeout, an unreachable endpoint) ``StorageUnavailable`` (503)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, operation)(**request)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            message = exc.response.get("Error", {}).get("Message", "")
            if code == "ResourceNotFoundException":
                raise ScheduleNotFound(str(request.get("Name", ""))) from None
            if code in ("ValidationException", "ConflictException"):
                raise _SchedulerRefused(code, message) from None
            raise StorageUnavailable(f"EventBridge Scheduler {operation}: {code} {message}".strip()) from None
        except BotoCoreError as exc:
            raise StorageUnavailable(f"EventBridge Scheduler {operation}: {exc}") from None

    def put(self, schedule: Schedule) -> Schedule:
        schedule.parsed(allow_seconds=False)  # Scheduler has no seconds
        request = self._request(schedule)
        try:
            self._call("create_schedule", **request)
        except _SchedulerRefused as exc:
            if exc.code != "ConflictException":
                raise InvalidInput(f"EventBridge Scheduler refused the schedule: {exc.message}", "expression") from None
            self._call("update_schedule", **request)  # create or replace
        return replace(schedule, created_at=None)

    def get(self, name: str) -> Schedule:
        return self._definition(self._call("get_schedule", Name=name, GroupName=self.group))

    def list(self) -> list[Schedule]:
        names: list[str] = []
        token: str | None = None
        while True:
            page = self._call("list_schedules", GroupName=self.group, MaxResults=100,
                              **({"NextToken": token} if token else {}))
            names.extend(item["Name"] for item in page.get("Schedules", []))
            token = page.get("NextToken")
            if not token:
                break
        schedules = []
        for name in sorted(names):
            try:
                schedules.append(self.get(name))
            except (ScheduleNotFound, InvalidInput):
                continue  # deleted meanwhile, or not one of ours
        return schedules

    def delete(self, name: str) -> None:
        self._call("delete_schedule", Name=name, GroupName=self.group)

    @staticmethod
    def _definition(answer: Mapping[str, Any]) -> Schedule:
        try:
            body = json.loads(answer.get("Target", {}).get("Input") or "{}")
        except ValueError:
            raise InvalidInput(f"schedule {answer.get('Name')!r} is not an rdq schedule", "name") from None
        if not isinstance(body, Mapping) or EVENT_KEY not in body:
            raise InvalidInput(f"schedule {answer.get('Name')!r} is not an rdq schedule", "name")
        # Scheduler accepted it when it was created: listing needs no time zone database.
        return Schedule.from_dict(body[EVENT_KEY], allow_seconds=False, check_expression=False)


def schedule_book_from_env(environ: Mapping[str, str] | None = None) -> LocalScheduleBook | SchedulerBook:
    """The deployed API's ``SchedulerBook`` when ``RDQ_SCHEDULE_GROUP`` is set, else the local file."""
    env = os.environ if environ is None else environ
    group = env.get("RDQ_SCHEDULE_GROUP", "")
    if group:
        return SchedulerBook(group, env.get("RDQ_SCHEDULER_ROLE_ARN", ""), env.get("RDQ_SCHEDULE_TARGET_ARN", ""))
    return LocalScheduleBook(env.get("RDQ_SCHEDULES_FILE") or None)


def wall_clock() -> datetime:
    return datetime.fromtimestamp(time.time(), timezone.utc)
