"""``Client`` and ``HttpClient`` are one interface (``rdq_core.client_protocol.QueueClient``).

mypy proves the types; these tests hold the parts a type check does not see: parameter names,
kinds and defaults, the grouped enqueue options against the fields a task really takes, a
misspelt keyword refused on both sides, and the two methods each side used to lack, run for real
(``Client.wait_for_operation`` on a store, ``HttpClient.enqueue_new_many`` against ``rdq dev``).
"""
from __future__ import annotations

import inspect
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from rdq_core.engine import operations
from rdq_core.client import Client, build_new_tasks
from rdq_core.engine.new_tasks import TASK_FIELDS
from rdq_core.client_protocol import ENQUEUE_OPTION_NAMES, DedupeOptions, FlowOptions, QueueClient
from rdq_core.errors import OperationStillRunning
from rdq_core.http_client import BearerToken, HttpClient
from rdq_core.model import TaskStatus
from rdq_core.validation import Limits
from tests.rdq_servers import DevServer, dev_server

TOKEN = "protocol-test-token"


def _members() -> list[str]:
    return sorted(name for name, value in vars(QueueClient).items()
                  if callable(value) and not name.startswith("_"))


def _shape(function: Any) -> list[tuple[str, Any, Any]]:
    """Each parameter's name, kind and default: what a caller relies on besides the types."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("client_class", [Client, HttpClient], ids=["Client", "HttpClient"])
@pytest.mark.parametrize("member", _members())
def test_each_client_has_every_member_with_the_protocols_parameters(client_class: type, member: str) -> None:
    assert hasattr(client_class, member), f"{client_class.__name__} lacks {member}"
    assert _shape(getattr(client_class, member)) == _shape(getattr(QueueClient, member))


def test_the_grouped_enqueue_options_are_exactly_the_fields_a_task_takes() -> None:
    assert set(ENQUEUE_OPTION_NAMES) == TASK_FIELDS - {"handler", "payload"}
    assert len(ENQUEUE_OPTION_NAMES) == len(set(ENQUEUE_OPTION_NAMES))
    assert set(FlowOptions.__annotations__) == {"priority", "concurrency_key", "rate_key", "group"}
    assert all(name.startswith("dedupe_") for name in DedupeOptions.__annotations__)


@pytest.fixture
def store_client(tmp_path: Path) -> Iterator[Client]:
    with Client(f"sqlite:///{tmp_path / 'rdq.db'}", payload_store=None) as client:
        yield client


def test_a_misspelt_enqueue_keyword_is_refused_on_both_clients_and_writes_nothing(store_client: Client) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'prioirty'"):
        store_client.enqueue("q", "h", {}, prioirty=1)  # type: ignore[call-arg]
    assert store_client.list_queues() == []
    # Refused before any request: nothing listens at this address.
    api_client = HttpClient("http://127.0.0.1:9", auth=BearerToken(TOKEN), retry_seconds=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'dedupe_window'"):
        api_client.enqueue("q", "h", {}, dedupe_window=5)  # type: ignore[call-arg]


def test_todays_enqueue_keywords_still_reach_the_task(store_client: Client) -> None:
    task = store_client.enqueue("q", "h", {"n": 1}, id="kw-1", max_attempts=3, priority=7,
                                concurrency_key="k", group="tenant-a", dedupe_key="d", headers={"x": "y"})
    assert (task.id, task.max_attempts, task.priority, task.concurrency_key, task.group, task.dedupe_key,
            task.headers.get("x")) == ("kw-1", 3, 7, "k", "tenant-a", "d", "y")


def test_client_wait_for_operation_returns_when_a_reaper_finishes_it(store_client: Client) -> None:
    for n in range(3):
        store_client.enqueue("ops", "h", {}, id=f"op-{n}")
    operation = store_client.start_operation("cancel", "ops", all=True)
    with pytest.raises(OperationStillRunning, match=operation.id):
        store_client.wait_for_operation(operation.id, timeout=0.2, poll=0.05)

    def reaper() -> None:  # what rdq dev / rdq reaper do each pass
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not store_client.get_operation(operation.id).finished:
            operations.drive_operations(store_client.storage, deadline=time.monotonic() + 1)
            time.sleep(0.05)

    driver = threading.Thread(target=reaper)
    driver.start()
    try:
        finished = store_client.wait_for_operation(operation.id, timeout=30, poll=0.05)
    finally:
        driver.join()
    assert finished.finished and finished.done == 3
    assert {store_client.get(f"op-{n}").status for n in range(3)} == {TaskStatus.CANCELLED}


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    with dev_server(tmp_path_factory.mktemp("rdq-dev"), token=TOKEN) as server:
        yield server


def test_http_enqueue_new_many_keeps_order_across_queues_and_reports_conflicts(dev: DevServer) -> None:
    api_client = HttpClient(dev.url, auth=BearerToken(TOKEN), retry_seconds=10)
    prefix = f"pm{time.monotonic_ns()}"
    api_client.enqueue(f"{prefix}-b", "h", {}, id=f"{prefix}-taken")
    # Not due for an hour: rdq dev's own worker leaves them PENDING while the test counts them.
    later = {"handler": "h", "delay_seconds": 3600}
    first = build_new_tasks(f"{prefix}-a", [{**later, "id": f"{prefix}-{n}"} for n in range(3)])
    clash = build_new_tasks(f"{prefix}-a", [{**later, "id": f"{prefix}-taken"}])
    second = build_new_tasks(f"{prefix}-c", [{**later, "id": f"{prefix}-c{n}"} for n in range(2)])
    mixed = [first[0], second[0], clash[0], first[1], second[1], first[2]]

    results = api_client.enqueue_new_many(mixed)

    assert [r.task.id for r in results] == [t.id for t in mixed]
    assert [r.conflict for r in results] == [False, False, True, False, False, False]
    assert all(r.created for i, r in enumerate(results) if i != 2)
    assert api_client.stats(f"{prefix}-a").pending == 3 and api_client.stats(f"{prefix}-c").pending == 2


def test_http_enqueue_new_many_splits_a_queue_past_the_batch_limit(dev: DevServer) -> None:
    api_client = HttpClient(dev.url, auth=BearerToken(TOKEN), retry_seconds=10)
    queue = f"pl{time.monotonic_ns()}"
    later = {"handler": "h", "delay_seconds": 3600}  # stays PENDING under rdq dev's own worker
    many = build_new_tasks(queue, [later] * Limits.batch_items)
    many += build_new_tasks(queue, [later] * 3)
    results = api_client.enqueue_new_many(many)
    assert [r.task.id for r in results] == [t.id for t in many] and all(r.created for r in results)
    assert api_client.stats(queue).pending == Limits.batch_items + 3
