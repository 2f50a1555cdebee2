"""Schedule expressions: EventBridge Scheduler's ``rate(...)`` and six-field ``cron(...)``, parsed
and evaluated in an IANA time zone, so that local hosts fire the periods Scheduler would.

``parse_expression`` accepts exactly the grammar ``EXPRESSION_PATTERN`` states (the OpenAPI
document's ``expression`` pattern); ``next_after`` and ``latest_at_or_before`` give fire instants
in UTC. A ``rate`` counts fixed UTC durations from the Unix epoch.

Daylight saving time, as EventBridge Scheduler documents it: a cron time that does not exist
on the day the clocks go forward is skipped; a time that happens twice on the day they go back
fires once (at its first occurrence).
"""

from __future__ import annotations

import calendar
import math
import re
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone, tzinfo
from typing import Any, Iterator, Mapping, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ..errors import InvalidInput

#: EventBridge Scheduler's smallest rate; ``rdq dev``/``rdq worker`` also accept seconds.
_UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def as_utc(instant: datetime) -> datetime:
    """``instant`` in UTC; a naive datetime is refused (``ValueError``)."""
    if instant.tzinfo is None:
        raise ValueError("instants must be timezone-aware")
    return instant.astimezone(timezone.utc)


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
        elapsed = math.floor((as_utc(instant) - _EPOCH).total_seconds())
        return _EPOCH + timedelta(seconds=(elapsed // self.seconds + 1) * self.seconds)

    def latest_at_or_before(self, instant: datetime, not_before: datetime | None = None) -> datetime | None:
        elapsed = math.floor((as_utc(instant) - _EPOCH).total_seconds())
        latest = _EPOCH + timedelta(seconds=elapsed // self.seconds * self.seconds)
        if not_before is not None and latest < as_utc(not_before):
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
        after = as_utc(instant)
        start = after.astimezone(self.zone).date() - timedelta(days=1)
        for day in self._days(start, 1):
            if self._day_matches(day):
                for hour, minute in self.times:
                    candidate = self._instant(day, hour, minute)
                    if candidate is not None and candidate > after:
                        return candidate
        return None

    def latest_at_or_before(self, instant: datetime, not_before: datetime | None = None) -> datetime | None:
        at = as_utc(instant)
        floor = as_utc(not_before) if not_before is not None else None
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
