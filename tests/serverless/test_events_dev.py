"""``rdq dev`` and lifecycle events: each delivered event is one log line and is served by
``GET /v1/events`` (the dev host's own route)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest

from rdq_core.compliance.support import wait_until
from tests.rdq_servers import DevServer, dev_server

TOKEN = "events-dev-token-3"


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    with dev_server(tmp_path_factory.mktemp("rdq-dev-events"), token=TOKEN) as server:
        yield server


def call(dev: DevServer, method: str, path: str, body: Any = None, token: str | None = TOKEN) -> tuple[int, str, Any]:
    request = urllib.request.Request(dev.url + path, method=method, data=None if body is None else json.dumps(body).encode())
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.headers.get("Content-Type", ""), json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("Content-Type", ""), json.loads(error.read() or b"null")


def test_a_dead_task_and_its_redrive_are_logged_and_served_in_order(dev: DevServer) -> None:
    status, _, _ = call(dev, "POST", "/v1/queues/evdev/tasks", {"handler": "reject", "id": "ev-dead-1"})
    assert status == 201

    def events_of_task() -> list[dict[str, Any]] | None:
        status, _, page = call(dev, "GET", "/v1/events?limit=1000")
        assert status == 200
        mine = [event for event in page["events"] if event.get("task_id") == "ev-dead-1"]
        return mine or None

    (dead,) = wait_until(events_of_task, 30, what="the dead task's event")
    change, _, incarnation = dead["id"].rpartition(":")
    assert (change, dead["type"], dead["queue"], dead["attempt"]) == ("ev-dead-1:dead:1", "rdq.task.dead", "evdev", 1)
    assert dead["error"]["message"] == "rejected on purpose" and "stack" not in dead["error"]
    status, _, _ = call(dev, "POST", "/v1/queues/evdev/dlq:redrive", {"ids": ["ev-dead-1"]})
    assert status == 200
    mine = wait_until(lambda: (found := events_of_task()) and len(found) >= 3 and found, 30,
                      what="the redrive's event and the second death")
    assert [e["id"] for e in mine[:3]] == [f"ev-dead-1:{c}:{incarnation}" for c in ("dead:1", "redriven:1", "dead:2")]
    # Paging: after the first event's number, the first is not served again.
    status, _, page = call(dev, "GET", f"/v1/events?after={mine[0]['seq']}&limit=1000")
    assert mine[0]["id"] not in [e["id"] for e in page["events"]] and page["next_after"] >= mine[2]["seq"]
    log = (dev.out.read_text(errors="replace") + dev.err.read_text(errors="replace"))
    assert f"rdq.task.dead ev-dead-1:dead:1:{incarnation}" in log, "one log line per event"


@pytest.mark.parametrize("query", ["?after=-1", "?limit=0", "?limit=1001", "?after=x", "?cursor=1", "?limit=1&limit=2"])
def test_a_bad_events_query_is_a_problem_and_the_token_is_required(dev: DevServer, query: str) -> None:
    status, content_type, problem = call(dev, "GET", "/v1/events" + query)
    assert (status, content_type, problem["status"]) == (400, "application/problem+json", 400)
    status, content_type, _ = call(dev, "GET", "/v1/events", token=None)
    assert (status, content_type) == (401, "application/problem+json")
