"""Per-minute queue metrics for the console's charts, written once over the engine documents.

**What is kept.** One engine document per queue and minute, ``queue-minute/<queue>~<YYYYMMDDHHMM>``
(UTC), holding what finished in that minute: tasks succeeded, retried (an attempt that failed and
sent its task back to PENDING), dead-lettered and cancelled; per handler, its attempts, failed
attempts and a histogram of attempt durations; and the queue's depth (pending, in flight, dead,
oldest pending task's age) as the maintenance pass saw it when it closed that minute. The same
figures are added to one document per five minutes (``queue-5min/...``): a day's charts read 288
of those, not 1,440 minutes. Documents older than ``RETENTION_MINUTES`` (a day) are deleted by the
same pass, so the charts cost at most a day of points per queue, whatever the history holds.

**Who writes it, and from what.** The maintenance pass (``roll_up``), never the hot path: a claim
or a settle pays nothing for the charts. A pass takes the minutes closed since the queue's
watermark (``queue-minute-mark/<queue>``) and walks, through the indexes every backend already
has for listings, the tasks that *finished* in that window: SUCCEEDED and CANCELLED by
``updated_at``, DEAD by ``dead_at``. Each one is counted once, in the minute it finished, and so
are the attempts of its current life (the trailing ``attempt_count`` budgeted attempts, with the
snoozes between them; an earlier life was counted when it died), each in the minute it finished.
The cost of a pass follows the number of tasks that finished since the last pass, never the
size of the history.

*Consequence, stated in docs/console.md:* a retry is charted once its task has finished
(succeeded, died or been cancelled), in the minute the retry happened: a task still retrying shows
in the depth lines but not yet in the retried line. Counting retries as they happen would need a
write on every settle, which the hot path does not pay for.

**Concurrency.** Two maintenance passes (two reapers) never count one window twice: each claims
its window by compare-and-set on the watermark before counting it, and merges into each minute's
document by compare-and-set too. A pass that dies between the two loses that window's counts
(an undercount, never a double count). A settle stamps its time when its statement starts, so a
minute is closed only ``CLOSE_GRACE_SECONDS`` after it ends.

**Shape.** Written over a ``values.DocumentStore`` and a ``PageReader`` the core hands in, so
this module imports neither the SPI (whose chart methods delegate here) nor the core (whose
maintenance step does).

**Durations.** Kept as a histogram of quarter-octave buckets (bucket ``i`` holds durations in
``[2**(i/4), 2**((i+1)/4))`` ms; bucket 0 also holds everything under 1 ms). Percentiles read from
it are the geometric middle of their bucket: within 9 % of the true value, and mergeable across
minutes, which exact per-minute percentiles are not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from ..errors import InvalidInput
from ..model import Outcome, Task, TaskStatus
from ..validation import QUEUE_NAME
from .cursors import to_micros
from .primitives import ORDER_FIELD, Selection
from .values import DocumentStore, LiveQueueStats


class RollupStore(DocumentStore, Protocol):
    """What a maintenance pass needs of a store besides its documents: the queues' live work."""

    def live_stats(self, queue: str) -> LiveQueueStats:
        """The queue's PENDING, IN_FLIGHT and DEAD counts and oldest due age."""


#: Reads one keyset page of a queue's tasks in one status, with their history (the core's
#: listing primitive, its errors translated): ``(selection, limit) -> tasks``.
PageReader = Callable[[Selection, int], Sequence[Task]]

MINUTE_KIND = "queue-minute"
#: The same figures per five minutes: what a day's charts read.
FIVE_MINUTE_KIND = "queue-5min"
#: Minutes per point -> the engine-document kind that keeps those points.
KINDS = {1: MINUTE_KIND, 5: FIVE_MINUTE_KIND}
STEPS = tuple(KINDS)
MARK_KIND = "queue-minute-mark"
#: How long minute documents are kept: the longest window the console charts.
RETENTION_MINUTES = 24 * 60
#: A minute is closed (counted) this long after it ends.
CLOSE_GRACE_SECONDS = 5.0
#: A queue's first pass counts back this far (then each pass continues from its watermark).
FIRST_LOOKBACK_MINUTES = 60
#: Tasks read per page while counting a window.
PAGE_SIZE = 500
#: Compare-and-set attempts on one minute document before the pass gives that minute up.
MERGE_TRIES = 5
#: The windows a reader may ask for, in minutes.
WINDOWS = {"hour": 60, "day": RETENTION_MINUTES}
#: Minutes per point, per window.
WINDOW_STEPS = {"hour": 1, "day": 5}

_BUCKETS_PER_OCTAVE = 4
_FAILED = {Outcome.RETRYABLE_FAILURE, Outcome.PERMANENT_FAILURE, Outcome.LEASE_EXPIRED}
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def minute_of(at: datetime) -> int:
    """Minutes since the epoch (UTC) of ``at``."""
    return to_micros(at) // 60_000_000


def _stamp(minute: int) -> str:
    return (_EPOCH + timedelta(minutes=minute)).strftime("%Y%m%d%H%M")


def _minute_key(queue: str, minute: int) -> str:
    # "~" sorts after every character a queue name may hold, so one queue's minutes are one
    # contiguous, chronological range of keys.
    return f"{queue}~{_stamp(minute)}"


def duration_bucket(milliseconds: float) -> int:
    """The histogram bucket of a duration (see the module's text)."""
    if milliseconds < 1.0:
        return 0
    return int(math.floor(math.log2(milliseconds) * _BUCKETS_PER_OCTAVE))


def bucket_middle(bucket: int) -> float:
    """The value, in milliseconds, a percentile that falls in ``bucket`` reads as."""
    if bucket <= 0:
        return 1.0 if bucket == 0 else 0.0
    if bucket < len(_MIDDLES):
        return _MIDDLES[bucket]
    return float(2 ** ((bucket + 0.5) / _BUCKETS_PER_OCTAVE))


#: Bucket middles up to about 20 minutes, computed once.
_MIDDLES = [1.0] + [float(2 ** ((b + 0.5) / _BUCKETS_PER_OCTAVE)) for b in range(1, 84)]


def percentile(histogram: Mapping[int, int], fraction: float) -> float | None:
    """The ``fraction`` (0..1) percentile of a histogram, in ms; None when it is empty."""
    return percentiles(histogram, (fraction,))[0]


def percentiles(histogram: Mapping[int, int], fractions: tuple[float, ...]) -> list[float | None]:
    """Several percentiles of one histogram (ascending ``fractions``) in one walk of its buckets."""
    total = sum(histogram.values())
    if total <= 0:
        return [None] * len(fractions)
    ranks = [max(1, math.ceil(fraction * total)) for fraction in fractions]
    found: list[float | None] = []
    seen = 0
    for bucket in sorted(histogram):
        seen += histogram[bucket]
        while len(found) < len(ranks) and seen >= ranks[len(found)]:
            found.append(round(bucket_middle(bucket), 3))
        if len(found) == len(ranks):
            break
    last = round(bucket_middle(max(histogram)), 3)
    return found + [last] * (len(ranks) - len(found))


# -- counting ----------------------------------------------------------------------------------------
@dataclass
class _HandlerMinute:
    attempts: int = 0
    failures: int = 0
    histogram: dict[int, int] = field(default_factory=dict)


@dataclass
class _Minute:
    counts: dict[str, int] = field(default_factory=dict)
    handlers: dict[str, _HandlerMinute] = field(default_factory=dict)
    depth: dict[str, Any] | None = None

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


_TERMINAL_COUNT = {TaskStatus.SUCCEEDED: "succeeded", TaskStatus.DEAD: "dead_lettered",
                   TaskStatus.CANCELLED: "cancelled"}


def _life(task: Task) -> list[Any]:
    """The attempts of the task's current life: the trailing ``attempt_count`` budgeted ones (a
    redrive resets the count; a snooze spends none), with the snoozes between them."""
    taken: list[Any] = []
    budgeted = 0
    for attempt in reversed(task.attempts):
        if attempt.outcome is not Outcome.SNOOZED:
            if budgeted >= task.attempt_count:
                break
            budgeted += 1
        taken.append(attempt)
    taken.reverse()
    return taken


def _count_task(task: Task, finished: datetime, minutes: dict[int, _Minute], oldest: int) -> None:
    minutes.setdefault(minute_of(finished), _Minute()).add(_TERMINAL_COUNT[task.status])
    life = _life(task)
    for index, attempt in enumerate(life):
        if attempt.finished_at is None:
            continue
        minute = minute_of(attempt.finished_at)
        if minute < oldest:
            continue  # older than what is kept
        bucket = minutes.setdefault(minute, _Minute())
        last = index == len(life) - 1
        if attempt.outcome in _FAILED and not (last and task.status is TaskStatus.DEAD):
            bucket.add("retried")
        if attempt.outcome is Outcome.SNOOZED:
            continue
        handler = bucket.handlers.setdefault(task.handler, _HandlerMinute())
        handler.attempts += 1
        if attempt.outcome in _FAILED:
            handler.failures += 1
        if attempt.started_at is not None:
            ms = max(0.0, (attempt.finished_at - attempt.started_at).total_seconds() * 1000.0)
            slot = duration_bucket(ms)
            handler.histogram[slot] = handler.histogram.get(slot, 0) + 1


def _finished_between(read_page: PageReader, queue: str, status: TaskStatus, start: int,
                      end: int) -> Iterator[tuple[Task, datetime]]:
    """Tasks of ``queue`` in ``status`` that finished in minutes ``[start, end)``, with history,
    oldest first, through the status's listing index."""
    # Strictly after the last microsecond of the minute before, whatever the id: no task id sorts
    # after "~" (an id starts with a letter or digit).
    after: tuple[int, str] = (start * 60_000_000 - 1, "~")
    end_micros = end * 60_000_000
    while True:
        tasks = read_page(Selection(queue, status, after=after), PAGE_SIZE)
        for task in tasks:
            at = getattr(task, ORDER_FIELD[status])
            if at is None or to_micros(at) >= end_micros:
                return
            yield task, at
            after = (to_micros(at), task.id)
        if len(tasks) < PAGE_SIZE:
            return


# -- the maintenance step ----------------------------------------------------------------------------
def roll_up(storage: RollupStore, read_page: PageReader, as_of: datetime | None = None) -> int:
    """Count the minutes closed since each queue's watermark and drop minutes past retention;
    the number of minute documents written. One maintenance step (see the module's text).
    ``read_page`` reads the finished tasks (see ``PageReader``); ``as_of`` stands for the store's
    clock (tests close the current minute with it)."""
    now = storage.now() if as_of is None else as_of
    closed_end = minute_of(now - timedelta(seconds=CLOSE_GRACE_SECONDS))
    written = 0
    queues = set(storage.list_queues())
    marks = {doc.key: doc for doc in _all(storage, MARK_KIND)}
    for queue in sorted(queues | set(marks)):
        written += _roll_queue(storage, read_page, queue, marks.get(queue), closed_end, active=queue in queues)
    return written


def _all(storage: DocumentStore, kind: str) -> Iterator[Any]:
    after: str | None = None
    while True:
        page = storage.list_documents(kind, limit=200, after=after)
        yield from page
        if len(page) < 200:
            return
        after = page[-1].key


def _roll_queue(storage: RollupStore, read_page: PageReader, queue: str, mark: Any, closed_end: int, *,
                active: bool) -> int:
    oldest = closed_end - RETENTION_MINUTES
    start = int(mark.body.get("through", 0)) if mark is not None else closed_end - FIRST_LOOKBACK_MINUTES
    start = max(start, oldest)
    if start >= closed_end:
        return 0
    # Claim the window first: a rival pass that claimed it meanwhile counts it, this one not.
    claimed = storage.put_document(MARK_KIND, queue, {"through": closed_end},
                                   expected_version=None if mark is None else mark.version)
    if claimed is None:
        return 0
    _expire(storage, queue, oldest)  # once a minute per queue, by the pass that claimed it
    if not active and not [doc for doc in storage.list_documents(MINUTE_KIND, limit=1, after=f"{queue}~")
                           if doc.key.startswith(f"{queue}~")]:
        # A queue that holds no task any more and whose last minute has expired: forget it.
        storage.delete_document(MARK_KIND, queue, expected_version=claimed.version)
        return 0
    minutes: dict[int, _Minute] = {}
    for status in (TaskStatus.SUCCEEDED, TaskStatus.DEAD, TaskStatus.CANCELLED):
        for task, finished in _finished_between(read_page, queue, status, start, closed_end):
            _count_task(task, finished, minutes, oldest)
    if active:
        # The live work only (pending, in flight, dead): full stats also count the finished tasks
        # retention keeps, a cost that grows with history.
        stats = storage.live_stats(queue)
        minutes.setdefault(closed_end - 1, _Minute()).depth = {
            "pending": stats.pending, "in_flight": stats.in_flight, "dead": stats.dead,
            "oldest_pending_age_seconds": round(stats.oldest_pending_age_seconds, 3) if stats.pending else 0.0}
    written = 0
    for minute, counted in sorted(minutes.items()):
        if _merge(storage, queue, minute, counted):
            written += 1
    return written


def _merge(storage: DocumentStore, queue: str, minute: int, counted: _Minute) -> bool:
    """Add one minute's figures to its minute document and to its five-minute one."""
    merged = True
    for step in STEPS:
        merged = _merge_into(storage, step, queue, minute - minute % step, minute, counted) and merged
    return merged


def _merge_into(storage: DocumentStore, step: int, queue: str, point: int, minute: int, counted: _Minute) -> bool:
    kind, key = KINDS[step], _minute_key(queue, point)
    for _ in range(MERGE_TRIES):
        existing = storage.get_document(kind, key)
        body: dict[str, Any] = dict(existing.body) if existing is not None else {"minute": point}
        counts = dict(body.get("counts") or {})
        for name, n in counted.counts.items():
            counts[name] = int(counts.get(name, 0)) + n
        handlers = {name: dict(value) for name, value in (body.get("handlers") or {}).items()}
        for name, h in counted.handlers.items():
            stored = handlers.setdefault(name, {"attempts": 0, "failures": 0, "histogram": {}})
            stored["attempts"] = int(stored.get("attempts", 0)) + h.attempts
            stored["failures"] = int(stored.get("failures", 0)) + h.failures
            histogram = {str(k): int(v) for k, v in (stored.get("histogram") or {}).items()}
            for slot, n in h.histogram.items():
                histogram[str(slot)] = histogram.get(str(slot), 0) + n
            stored["histogram"] = histogram
        body.update(counts=counts, handlers=handlers)
        if counted.depth is not None and int(body.get("depth_minute", -1)) <= minute:
            body.update(depth=counted.depth, depth_minute=minute)  # the latest sample of the point
        if storage.put_document(kind, key, body,
                                expected_version=None if existing is None else existing.version) is not None:
            return True
    return False


def store_minute(storage: DocumentStore, queue: str, minute: int, *, counts: Mapping[str, int],
                 depth: Mapping[str, Any] | None = None,
                 handlers: Mapping[str, tuple[int, int, list[float]]] | None = None) -> bool:
    """Merge one minute's figures into its document, as a maintenance pass would: ``counts`` by
    name (succeeded, retried, dead_lettered, cancelled), ``depth``, and per handler (attempts,
    failures, durations in ms). For loading history into a store (benchmarks, screenshots)."""
    counted = _Minute(counts=dict(counts), depth=None if depth is None else dict(depth))
    for name, (attempts, failures, durations) in (handlers or {}).items():
        histogram: dict[int, int] = {}
        for value in durations:
            histogram[duration_bucket(value)] = histogram.get(duration_bucket(value), 0) + 1
        counted.handlers[name] = _HandlerMinute(attempts, failures, histogram)
    return _merge(storage, queue, minute, counted)


def _expire(storage: DocumentStore, queue: str, oldest: int) -> None:
    """Delete ``queue``'s documents of points that end before minute ``oldest`` (they come first
    by key), at both resolutions."""
    for step, kind in KINDS.items():
        cutoff = _minute_key(queue, oldest - step + 1)  # a point p ends at p + step
        while True:
            page = storage.list_documents(kind, limit=200, after=f"{queue}~")
            stale = [doc for doc in page if doc.key.startswith(f"{queue}~") and doc.key < cutoff]
            for doc in stale:
                storage.delete_document(kind, doc.key, expected_version=doc.version)
            if len(stale) < 200:
                break


# -- reading -----------------------------------------------------------------------------------------
_COUNTED = ("succeeded", "retried", "dead_lettered", "cancelled")
_DEPTH = ("pending", "in_flight", "dead", "oldest_pending_age_seconds")


def queue_series(storage: DocumentStore, queue: str, window: str, as_of: datetime | None = None) -> dict[str, Any]:
    """The charts' series of ``queue`` over ``window``, oldest first, columns aligned on
    ``minutes`` (each point's first minute, epoch seconds): a point a minute over the last "hour",
    every five minutes over the last "day" (288 documents to read, not 1,440). Counts are per
    minute (over a day, the average of the point's closed minutes), ``totals`` the exact sums;
    depth is the latest sample in the point (``None``: none). Per handler: attempts, failure rate
    and p50/p95/p99 per point and over the whole window."""
    if not isinstance(queue, str) or not QUEUE_NAME.fullmatch(queue):
        raise InvalidInput("a queue name is 1..120 characters of [a-z0-9._-], starting with a letter or digit",
                           field="queue")
    if not isinstance(window, str) or window not in WINDOWS:
        raise InvalidInput(f"window is one of {', '.join(WINDOWS)}", field="window")
    step = WINDOW_STEPS[window]
    end = minute_of(storage.now() if as_of is None else as_of)  # the current minute, still open: not charted
    first = end - WINDOWS[window]
    first -= first % step
    points = list(range(first, end, step))
    docs = {int(doc.body.get("minute", -1)): doc.body for doc in _point_docs(storage, KINDS[step], queue, first, end)}
    series: dict[str, list[Any]] = {name: [] for name in (*_COUNTED, *_DEPTH)}
    totals = dict.fromkeys(_COUNTED, 0)
    handler_points: dict[str, dict[int, Mapping[str, Any]]] = {}
    for point in points:
        body = docs.get(point) or {}
        counts = body.get("counts") or {}
        closed = min(step, end - point)
        for name in _COUNTED:
            n = int(counts.get(name, 0))
            totals[name] += n
            series[name].append(n if step == 1 else round(n / closed, 2))
        depth = body.get("depth")
        for name in _DEPTH:
            series[name].append(None if depth is None else depth.get(name))
        for handler, value in (body.get("handlers") or {}).items():
            handler_points.setdefault(handler, {})[point] = value
    handlers = [_handler_series(name, handler_points[name], points) for name in sorted(handler_points)]
    return {"queue": queue, "window": window, "step_seconds": step * 60,
            "minutes": [point * 60 for point in points], **series, "totals": totals, "handlers": handlers}


def _point_docs(storage: DocumentStore, kind: str, queue: str, start: int, end: int) -> Iterator[Any]:
    after = _minute_key(queue, start - 1)
    last = _minute_key(queue, end)
    while True:
        page = storage.list_documents(kind, limit=200, after=after)
        for doc in page:
            if not doc.key.startswith(f"{queue}~") or doc.key >= last:
                return
            yield doc
        if len(page) < 200:
            return
        after = page[-1].key


def _handler_series(name: str, by_point: Mapping[int, Mapping[str, Any]], points: list[int]) -> dict[str, Any]:
    whole: dict[int, int] = {}
    columns: dict[str, list[Any]] = {key: [] for key in ("attempts", "failure_rate", "p50_ms", "p95_ms", "p99_ms")}
    attempts_total = failures_total = 0
    for point in points:
        value = by_point.get(point) or {}
        attempts, failures = int(value.get("attempts", 0)), int(value.get("failures", 0))
        histogram = {int(k): int(v) for k, v in (value.get("histogram") or {}).items()}
        for slot, n in histogram.items():
            whole[slot] = whole.get(slot, 0) + n
        attempts_total += attempts
        failures_total += failures
        columns["attempts"].append(attempts)
        columns["failure_rate"].append(round(failures / attempts, 4) if attempts else None)
        p50, p95, p99 = percentiles(histogram, _CHARTED)
        columns["p50_ms"].append(p50)
        columns["p95_ms"].append(p95)
        columns["p99_ms"].append(p99)
    p50, p95, p99 = percentiles(whole, _CHARTED)
    return {"handler": name, **columns, "summary": {
        "attempts": attempts_total, "failures": failures_total,
        "failure_rate": round(failures_total / attempts_total, 4) if attempts_total else None,
        "p50_ms": p50, "p95_ms": p95, "p99_ms": p99}}


_CHARTED = (0.50, 0.95, 0.99)


def overview_series(storage: DocumentStore, window: str = "hour", as_of: datetime | None = None) -> dict[str, Any]:
    """Every queue's finished tasks per minute over ``window``, summed: the queues page's chart,
    with each queue's own totals."""
    if not isinstance(window, str) or window not in WINDOWS:
        raise InvalidInput(f"window is one of {', '.join(WINDOWS)}", field="window")
    as_of = storage.now() if as_of is None else as_of  # one instant: every queue's points line up
    step = WINDOW_STEPS[window]
    end = minute_of(as_of)
    first = end - WINDOWS[window]
    first -= first % step
    minutes = [point * 60 for point in range(first, end, step)]
    summed: dict[str, list[float]] = {name: [0] * len(minutes) for name in _COUNTED}
    totals = dict.fromkeys(_COUNTED, 0)
    per_queue: list[dict[str, Any]] = []
    for queue in sorted(set(storage.list_queues())):
        one = queue_series(storage, queue, window, as_of)
        for name in _COUNTED:
            summed[name] = [a + b for a, b in zip(summed[name], one[name], strict=True)]
            totals[name] += one["totals"][name]
        per_queue.append({"queue": queue, **one["totals"]})
    return {"window": window, "step_seconds": step * 60, "minutes": minutes,
            **{name: [round(v, 2) for v in values] for name, values in summed.items()},
            "totals": totals, "queues": per_queue}
