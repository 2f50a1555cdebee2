"""A backlog drained by the real worker function under the emulator, and what it cost.

A run: a fresh store (a PostgreSQL database or a Redis key prefix of its own, removed after);
the worker function as ``template.yaml`` declares it, with the scenario's parameters; a schedule
ticker firing the scheduled event every ``tick_s`` (ticks overlap when an invocation outlasts
the period, as EventBridge's do); at ``burst_at_s`` the backlog is enqueued the way the API does
it, in requests of ``enqueue_chunk`` tasks spread over ``api_containers`` API containers, each
waking a worker after its enqueue (rdq's own ``WorkerInvoker``, debounced per container, through
boto3 to the emulator). The run ends when no task is PENDING or IN_FLIGHT (or at
``time_limit_s``); the fleet is then left idle, frozen, to count the connections it keeps.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from rdq_testing import servers as provisioning
from rdq_core.hosts.aws_lambda.local_invoke import scheduled_event
from rdq_core.model import NewTask, TaskStatus
from rdq_core.storage import open_storage
from rdq_core.storage.spi import Storage

from .. import servers
from .emulator import Emulator, Fleet, Invocation, function_environment
from .template import FunctionConfig, declared_parameters, worker_function

QUEUE = "fleet"
#: The tag every worker connection carries (PostgreSQL ``application_name``, Redis client name),
#: so the bench counts the fleet's connections and not its own.
CONNECTION_TAG = "rdq-fleet-worker"
HANDLERS_MODULE = "bench.lambda_fleet.handlers"
#: Parameters the scenario sets when the template declares them.
HANDLER_CONCURRENCY_PARAMETER = "HandlerConcurrency"
HANDLER_CONCURRENCY_VARIABLE = "RDQ_HANDLER_CONCURRENCY"


@dataclass
class Scenario:
    backend: str = "postgres"  # postgres | redis
    tasks: int = 4000
    handler_ms: float = 100.0
    cap: int = 8  # MaxWorkerConcurrency
    handler_concurrency: int = 1  # H: HandlerConcurrency
    batch_size: int = 10
    worker_timeout_s: int = 60
    memory_mb: int | None = None  # None: the template's MemorySize
    tick_s: float = 60.0  # the template's default schedule is rate(1 minute)
    first_tick_s: float = 0.0
    burst_at_s: float = 1.0
    api_containers: int = 4
    enqueue_chunk: int = 100
    wake_debounce_s: float = 5.0
    reserve_concurrency: bool = False
    account_concurrency: int = 32
    prewarm: int = 0
    time_limit_s: float = 600.0
    idle_wait_s: float = 3.0  # after the drain, before the idle fleet's connections are counted
    parameters: dict[str, str] = field(default_factory=dict)  # any other template parameter
    logs_dir: str | None = None  # keep the environments' logs and the run logs there
    pg_admin_url: str = servers.PG_ADMIN_URL  # the server the run's scratch database is made on

    @property
    def ideal_tasks_per_s(self) -> float:
        return self.cap * self.handler_concurrency * 1000.0 / self.handler_ms


# -- the store --------------------------------------------------------------------------------------
def with_query(url: str, **options: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(query=urlencode([*parse_qsl(parts.query), *options.items()])))


@contextlib.contextmanager
def fresh_store(backend: str, pg_admin_url: str = servers.PG_ADMIN_URL) -> Iterator[tuple[str, str, Callable[[], int]]]:
    """``(bench URL, worker URL, count of the workers' open connections)`` of an empty store,
    removed afterwards. The worker URL carries ``CONNECTION_TAG``."""
    if backend == "postgres":
        with provisioning.pg_scratch_database(pg_admin_url, prefix="rdq_bench_fleet_") as url:
            import psycopg

            database = url.rsplit("/", 1)[1]
            monitor = psycopg.connect(pg_admin_url, autocommit=True)
            try:
                def count_pg() -> int:
                    row = monitor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
                                          (database, CONNECTION_TAG)).fetchone()
                    return int(row[0]) if row else 0

                yield url, with_query(url, application_name=CONNECTION_TAG), count_pg
            finally:
                monitor.close()
    elif backend == "redis":
        prefix = servers.new_redis_prefix("rdqfleet")
        url = servers.redis_storage_url(prefix)
        name = f"{CONNECTION_TAG}-{prefix}"
        import redis

        redis_monitor = redis.Redis.from_url(servers.REDIS_URL, decode_responses=True)
        try:
            def count_redis() -> int:
                return sum(1 for client in redis_monitor.client_list() if client.get("name") == name)

            yield url, with_query(url, client_name=name), count_redis
        finally:
            redis_monitor.close()
            servers.redis_delete_prefix(prefix)
    else:
        raise ValueError(f"backend {backend!r}: the fleet bench runs on postgres or redis")


class _Sampler:
    """Samples ``read`` every ``period`` seconds on a thread; keeps the peak."""

    def __init__(self, read: Callable[[], int], period: float = 0.1) -> None:
        self.read, self.period, self.peak, self.samples = read, period, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="connection-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.read())
                self.samples += 1
            except Exception:  # noqa: BLE001 - a missed sample is not a failed run
                pass
            self._stop.wait(self.period)

    def __enter__(self) -> "_Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


class _Ticker:
    """EventBridge's schedule: the scheduled event, asynchronously, every ``period`` seconds."""

    def __init__(self, fleet: Fleet, period: float, first_at: float) -> None:
        self.fleet, self.period, self.first_at = fleet, period, first_at
        self.fired = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="schedule-ticker", daemon=True)

    def _run(self) -> None:
        next_at = self.first_at
        while not self._stop.wait(max(next_at - time.monotonic(), 0.0)):
            self.fleet.invoke_async(scheduled_event("rdq-fleet-worker-tick"))
            self.fired += 1
            next_at += self.period

    def __enter__(self) -> "_Ticker":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


# -- the run ---------------------------------------------------------------------------------------
def function_for(scenario: Scenario) -> tuple[FunctionConfig, dict[str, str]]:
    """The worker's configuration for ``scenario`` and the variables the bench adds to it."""
    declared = declared_parameters()
    parameters = {
        "MaxWorkerConcurrency": str(scenario.cap), "BatchSize": str(scenario.batch_size),
        "WorkerTimeout": str(scenario.worker_timeout_s), "HandlerModules": HANDLERS_MODULE,
        "ReserveConcurrency": "true" if scenario.reserve_concurrency else "false",
        "EnableTracing": "false", "WakeWorkerOnEnqueue": "true",
        **scenario.parameters,
    }
    extra: dict[str, str] = {}
    if HANDLER_CONCURRENCY_PARAMETER in declared:
        parameters[HANDLER_CONCURRENCY_PARAMETER] = str(scenario.handler_concurrency)
    else:  # the template does not have it (yet): the variable the worker reads, directly
        extra[HANDLER_CONCURRENCY_VARIABLE] = str(scenario.handler_concurrency)
    config = worker_function(parameters)
    if scenario.memory_mb is not None:
        config = replace(config, memory_mb=scenario.memory_mb)
    return config, extra


def run(scenario: Scenario, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    config, extra = function_for(scenario)
    with fresh_store(scenario.backend, scenario.pg_admin_url) as (bench_url, worker_url, count_connections), \
            tempfile.TemporaryDirectory(prefix="rdq-fleet-") as scratch:
        log_dir = Path(scenario.logs_dir or scratch)
        log_dir.mkdir(parents=True, exist_ok=True)
        storage = open_storage(bench_url)
        storage.migrate()
        emulator = Emulator().start()
        env = function_environment(config, emulator.endpoint, {
            **extra, "RDQ_STORAGE_URL": worker_url, "RDQ_FLEET_LOG_DIR": str(log_dir),
            "RDQ_WAKE_DEBOUNCE_SECONDS": str(scenario.wake_debounce_s)})
        fleet = emulator.add(Fleet(config, env, log_dir, account_concurrency=scenario.account_concurrency))
        try:
            if scenario.prewarm:
                fleet.prewarm(scenario.prewarm)
            with _Sampler(count_connections) as connections:
                t0 = time.monotonic()
                with _Ticker(fleet, scenario.tick_s, t0 + scenario.first_tick_s) as ticker:
                    time.sleep(max(t0 + scenario.burst_at_s - time.monotonic(), 0.0))
                    burst = _burst(storage, scenario, config.name, emulator.endpoint, worker_fleet(env))
                    progress(f"backlog of {scenario.tasks} enqueued in {burst['enqueue_s']:.2f}s")
                    finished = _wait_for_drain(storage, scenario, t0, progress)
                wait_end = time.monotonic() + config.timeout_s + 5
                while not fleet.idle() and time.monotonic() < wait_end:
                    time.sleep(0.1)
                time.sleep(scenario.idle_wait_s)
                idle_connections = count_connections()
            fleet.close(wait_s=1.0)
        finally:
            fleet.close()
            emulator.stop()
        runs = _read_runs(log_dir)
        checked = _check_store(storage, scenario.tasks)
        storage.close()
    return _report(scenario, config, fleet, ticker.fired, burst, finished, runs, checked,
                   connections.peak, idle_connections, t0)


def worker_fleet(env: dict[str, str]) -> str:
    """The worker slots' fleet name the function's environment gives it (``Settings.worker_fleet``)."""
    return env.get("RDQ_WORKER_FLEET", "").strip() or env.get("RDQ_WORKER_FUNCTION", "").strip() or "worker"


def _burst(storage: Storage, scenario: Scenario, function: str, endpoint: str, fleet: str) -> dict[str, Any]:
    """The backlog, enqueued as API requests by ``api_containers`` containers, each waking a worker
    into a slot it reserves, as the API does (``route_support.wake_worker_for``)."""
    import boto3

    from rdq_core.aws.clients import client_config
    from rdq_core.hosts.aws_lambda.invoker import INVOKE_CONNECT_TIMEOUT, INVOKE_READ_TIMEOUT, FleetStarts, WorkerInvoker

    def container() -> WorkerInvoker:
        client = boto3.client("lambda", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="emulator",
                              aws_secret_access_key="emulator",
                              config=client_config(connect_timeout=INVOKE_CONNECT_TIMEOUT, read_timeout=INVOKE_READ_TIMEOUT))
        return WorkerInvoker(client=client)

    containers = [container() for _ in range(max(scenario.api_containers, 1))]
    payload = {"ms": scenario.handler_ms}
    started = time.monotonic()
    wakes = 0
    for request, first in enumerate(range(0, scenario.tasks, scenario.enqueue_chunk)):
        last = min(first + scenario.enqueue_chunk, scenario.tasks)
        storage.enqueue([NewTask(id=f"t{n:07d}", queue=QUEUE, handler="fleet.sleep", payload=payload)
                         for n in range(first, last)])
        wakes += containers[request % len(containers)].wake(function, [QUEUE], scenario.wake_debounce_s,
                                                            fleet=FleetStarts(storage, fleet, scenario.cap))
    return {"started": started, "ended": time.monotonic(), "enqueue_s": time.monotonic() - started, "wakes": wakes}


def _wait_for_drain(storage: Storage, scenario: Scenario, t0: float, progress: Callable[[str], None]) -> dict[str, Any]:
    last_note = 0.0
    while True:
        stats = storage.stats(QUEUE)
        now = time.monotonic()
        if stats.pending + stats.in_flight == 0:
            return {"drained": True, "at": now}
        if now - t0 > scenario.time_limit_s:
            return {"drained": False, "at": now, "left": stats.pending + stats.in_flight}
        if now - last_note >= 10:
            progress(f"t={now - t0:.0f}s succeeded={stats.succeeded} pending={stats.pending} in_flight={stats.in_flight}")
            last_note = now
        time.sleep(0.25)


@dataclass(frozen=True)
class _Run:
    task_id: str
    request_id: str
    pid: int
    start: float
    end: float


def _read_runs(log_dir: Path) -> list[_Run]:
    runs = []
    for path in log_dir.glob("runs-*.log"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5:
                runs.append(_Run(parts[0], parts[1], int(parts[2]), float(parts[3]), float(parts[4])))
    return runs


def _check_store(storage: Storage, tasks: int) -> dict[str, Any]:
    """Every task's final state and attempt history: the lost ones (never SUCCEEDED) and the
    tasks with two attempts whose [started_at, finished_at] overlap."""
    lost: list[str] = []
    overlapping: list[str] = []
    statuses: Counter[str] = Counter()
    attempts = 0
    for n in range(tasks):
        task = storage.get(f"t{n:07d}")
        if task is None:
            lost.append(f"t{n:07d}")
            statuses["MISSING"] += 1
            continue
        statuses[task.status.value] += 1
        if task.status is not TaskStatus.SUCCEEDED:
            lost.append(task.id)
        history = sorted((a for a in task.attempts if a.started_at is not None), key=lambda a: a.started_at)  # type: ignore[arg-type,return-value]
        attempts += len(task.attempts)
        for before, after in itertools.pairwise(history):
            if before.finished_at is None or before.finished_at > after.started_at:  # type: ignore[operator]
                overlapping.append(task.id)
                break
    return {"statuses": dict(statuses), "lost": lost, "overlapping_attempts": overlapping, "attempts": attempts}


def _peak_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most half-open intervals open at one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    peak = level = 0
    for _, step in events:  # at one instant, ends (-1) sort before starts
        level += step
        peak = max(peak, level)
    return peak


def _first_reaching(intervals: list[tuple[float, float]], level: int) -> float | None:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    open_ = 0
    for at, step in events:
        open_ += step
        if open_ >= level:
            return at
    return None


def _report(scenario: Scenario, config: FunctionConfig, fleet: Fleet, ticks: int, burst: dict[str, Any],
            finished: dict[str, Any], runs: list[_Run], checked: dict[str, Any], peak_connections: int,
            idle_connections: int, t0: float) -> dict[str, Any]:
    invocations: list[Invocation] = list(fleet.invocations)
    by_task: dict[str, list[_Run]] = defaultdict(list)
    by_request: dict[str, list[_Run]] = defaultdict(list)
    for r in runs:
        by_task[r.task_id].append(r)
        by_request[r.request_id].append(r)
    run_overlaps = sorted(task for task, rs in by_task.items()
                          if any(a.end > b.start for a, b in itertools.pairwise(sorted(rs, key=lambda r: r.start))))
    holding = [(min(r.start for r in rs), max(r.end for r in rs)) for rs in by_request.values()]
    busy = [(i.started, i.ended) for i in invocations if i.ended]
    first_start = min((r.start for r in runs), default=None)
    last_end = max((r.end for r in runs), default=None)
    drain_s = (last_end - burst["started"]) if last_end is not None else None
    tasks_per_s = scenario.tasks / drain_s if drain_s else None
    billed_ms = sum(i.billed_ms for i in invocations)
    memory_gb = config.memory_mb / 1024.0
    gb_s = billed_ms / 1000.0 * memory_gb
    per_1000 = 1000.0 / scenario.tasks
    reach_holding = _first_reaching(holding, scenario.cap)
    reach_busy = _first_reaching(busy, scenario.cap)
    return {
        "scenario": asdict(scenario),
        "function": {"name": config.name, "timeout_s": config.timeout_s, "memory_mb": config.memory_mb,
                     "architecture": config.architecture, "concurrency_limit": fleet.limit,
                     "reserved_concurrency": config.reserved_concurrency,
                     "max_event_age_s": config.max_event_age_s, "max_retry_attempts": config.max_retry_attempts,
                     "handler_concurrency_via": HANDLER_CONCURRENCY_PARAMETER if HANDLER_CONCURRENCY_PARAMETER
                     in config.parameters else HANDLER_CONCURRENCY_VARIABLE},
        "drained": finished["drained"],
        "drain_s": _round(drain_s),
        "tasks_per_s": _round(tasks_per_s),
        "ideal_tasks_per_s": _round(scenario.ideal_tasks_per_s),
        "of_ideal": _round(tasks_per_s / scenario.ideal_tasks_per_s if tasks_per_s else None),
        "steady_tasks_per_s": _round(scenario.tasks / (last_end - first_start) if runs and last_end != first_start else None),  # type: ignore[operator]
        "first_task_after_burst_s": _round(first_start - burst["started"] if first_start is not None else None),
        "cap_reached_after_burst_s": {
            "invocations": _round(reach_busy - burst["started"] if reach_busy and reach_busy >= burst["started"] else None),
            "holding_tasks": _round(reach_holding - burst["started"] if reach_holding else None)},
        "peak_invocations": fleet.peak_busy,
        "peak_invocations_holding_tasks": _peak_overlap(holding),
        "invocations_started": dict(Counter(i.cause for i in invocations)),
        # Started, then found every slot held and left: the surplus a start reserved in the store avoids.
        "invocations_without_slot": dict(Counter(i.cause for i in invocations
                                                 if isinstance(i.result, dict) and "slot" in i.result
                                                 and i.result["slot"] is None)),
        "invocations_with_tasks": len(by_request),
        "events_accepted": dict(fleet.events_accepted),
        "ticks_fired": ticks,
        "wakes_accepted": burst["wakes"],
        "cold_starts": sum(1 for i in invocations if i.cold),
        "init_ms_median": _round(_median([i.init_ms for i in invocations if i.cold])),
        "timeouts": sum(1 for i in invocations if i.outcome == "timeout"),
        "errors": sum(1 for i in invocations if i.outcome in ("error", "init_error")),
        "throttled_events": dict(fleet.throttled_events),
        "throttled_sync": dict(fleet.throttled_sync),
        "dropped_events": dict(fleet.dropped_events),
        "peak_db_connections": peak_connections,
        "idle_fleet_db_connections": idle_connections,
        "billed_ms": billed_ms,
        # Of which cold starts' init phases (billed since August 2025): a cost of the emulator's
        # always-cold start as much as of the worker.
        "billed_init_ms": sum(math.ceil(i.init_ms) for i in invocations),
        "gb_s": _round(gb_s, 4),
        "gb_s_per_1000_tasks": _round(gb_s * per_1000, 4),
        "requests_per_1000_tasks": _round(len(invocations) * per_1000, 3),
        "handler_runs": len(runs),
        "tasks_run_twice": sum(1 for rs in by_task.values() if len(rs) > 1),
        "overlapping_runs": run_overlaps[:20],
        "lost_tasks": len(checked["lost"]),
        "lost_examples": checked["lost"][:10],
        "overlapping_attempts": len(checked["overlapping_attempts"]),
        "overlapping_attempt_examples": checked["overlapping_attempts"][:10],
        "statuses": checked["statuses"],
        "attempts": checked["attempts"],
        "wall_s": _round(time.monotonic() - t0),
        "load_average": os.getloadavg(),
    }


def _median(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)
