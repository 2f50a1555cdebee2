"""List pages bounded by bytes (issue 19, item 3), on ``rdq dev`` over HTTP: 50 dead tasks with
200 KB payloads were a 10 MB page, past Lambda's 6 MB response limit (a 502 on AWS). Now every list
route's page ends early with a cursor, paging still reaches every task exactly once (raw HTTP, the
HTTP client), and ``fields=summary`` lists them without payloads in one small page."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from rdq_core import Client
from rdq_core.http_client import BearerToken, HttpClient
from rdq_core.hosts.aws_lambda.paging import wire_size
from rdq_core.model import ErrorInfo, Outcome, Settlement, TaskStatus
from rdq_core.storage import open_storage
from tests.rdq_servers import DevServer, dev_server

TOKEN = "paging-token"
BLOB = 200 * 1024
#: Lambda's response limit, and what the budget keeps under it with headers and the rest of the result.
LAMBDA_RESPONSE_LIMIT = 6 * 1024 * 1024
BUDGET = 4_000_000


def _dead_tasks(url: str, queue: str, n: int) -> list[str]:
    storage = open_storage(url)
    try:
        storage.migrate()
        client = Client(storage)
        ids = [f"big-{i:03d}" for i in range(n)]
        client.enqueue_many(queue, [{"id": i, "handler": "noop", "payload": {"blob": "x" * BLOB}, "max_attempts": 1}
                                    for i in ids])
        claimed = storage.claim(queue, n, 60)
        assert len(claimed) == n
        storage.settle([Settlement(c.task.id, c.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                                   error=ErrorInfo("big.Error", "failed on purpose")) for c in claimed])
        return ids
    finally:
        storage.close()


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevServer, list[str]]]:
    workdir: Path = tmp_path_factory.mktemp("paging")
    url = f"sqlite:///{workdir}/dev.db"
    ids = _dead_tasks(url, "big", 50)
    with dev_server(workdir, token=TOKEN, storage_url=url) as server:
        yield server, ids


def _get(server: DevServer, path: str) -> tuple[int, bytes]:
    request = urllib.request.Request(server.url + path, headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _pages(server: DevServer, path: str, key: str = "tasks") -> list[dict[str, Any]]:
    pages, cursor = [], ""
    while True:
        separator = "&" if "?" in path else "?"
        status, raw = _get(server, f"{path}{separator}cursor={cursor}" if cursor else path)
        assert status == 200, raw[:500]
        body = json.loads(raw)
        # As it would travel in the Lambda proxy result: under the budget, far under the limit.
        assert wire_size(body) <= BUDGET + 1000 and wire_size(body) < LAMBDA_RESPONSE_LIMIT - 100_000
        pages.append(body)
        cursor = body["next_cursor"]
        if not cursor:
            return pages


@pytest.mark.parametrize("path", ["/v1/queues/big/dlq", "/v1/queues/big/tasks?status=DEAD", "/v1/queues/big/tasks"])
def test_a_default_page_of_200kb_dead_tasks_ends_early_and_paging_reaches_each_task_once(dev, path):
    server, ids = dev
    pages = _pages(server, path)
    assert len(pages) >= 3, "50 tasks of 200 KB cannot fit one 4 MB page"
    assert all(len(page["tasks"]) < 50 for page in pages)
    listed = [task["id"] for page in pages for task in page["tasks"]]
    assert listed == ids, "each once, in the listing's order"
    assert all(len(task["payload"]["blob"]) == BLOB for page in pages for task in page["tasks"])


def test_the_http_client_pages_through_byte_bounded_pages(dev):
    server, ids = dev
    client = HttpClient(server.url, auth=BearerToken(TOKEN))
    listed, cursor = [], None
    while True:
        page = client.list_dead("big", cursor=cursor)
        listed += [task.id for task in page.tasks]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert listed == ids


def test_summary_lists_every_task_without_payloads_in_one_small_page(dev):
    server, ids = dev
    status, raw = _get(server, "/v1/queues/big/dlq?fields=summary&limit=50")
    assert status == 200
    body = json.loads(raw)
    assert [task["id"] for task in body["tasks"]] == ids and body["next_cursor"] is None
    assert all("payload" not in task and task["payload_omitted"] is True for task in body["tasks"])
    assert all(task["last_error"]["type"] == "big.Error" for task in body["tasks"])
    assert len(raw) < 100_000


def test_an_unknown_fields_value_is_a_precise_422(dev):
    server, _ = dev
    status, raw = _get(server, "/v1/queues/big/dlq?fields=everything")
    problem = json.loads(raw)
    assert (status, problem["status"]) == (422, 422) and "fields" in problem["detail"]
