"""The operator's routes end to end: task listings, dry runs, cancel by filter, pause/resume and the
audit trail, through ``HttpClient`` against ``rdq dev`` (a subprocess), through the Lambda API
handler with API Gateway's identity fields, and through the CLI on a store and over ``--api``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from rdq_core import Client
from rdq_core.errors import InvalidCursor, InvalidInput
from rdq_core.http_client import BearerToken, HttpClient
from rdq_core.model import TaskStatus
from tests.rdq_servers import DevServer, dev_server, status_of

TOKEN = "operator-actions-token-3"


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    with dev_server(tmp_path_factory.mktemp("rdq-dev-operator"), token=TOKEN) as server:
        yield server


@pytest.fixture
def rdq(dev: DevServer) -> HttpClient:
    return HttpClient(dev.url, auth=BearerToken(TOKEN), retry_seconds=10)


_numbers = iter(range(1, 10_000))


def fresh_queue() -> str:
    return f"op{os.getpid()}-{next(_numbers)}"


def test_tasks_are_listed_by_status_and_paged_through_the_api(rdq: HttpClient) -> None:
    queue = fresh_queue()
    done = [rdq.enqueue(queue, "greet", {"name": str(n)}).id for n in range(3)]
    dead = rdq.enqueue(queue, "reject", {"reason": "no"}).id
    for task_id in done:
        status_of(rdq, task_id, TaskStatus.SUCCEEDED)
    status_of(rdq, dead, TaskStatus.DEAD)
    later = [rdq.enqueue(queue, "greet", delay_seconds=3600).id for _ in range(3)]

    page = rdq.list_tasks(queue, status="SUCCEEDED", limit=2)
    assert len(page.tasks) == 2 and page.next_cursor
    rest = rdq.list_tasks(queue, status=TaskStatus.SUCCEEDED, limit=2, cursor=page.next_cursor)
    assert rest.next_cursor is None
    assert sorted(t.id for t in page.tasks + rest.tasks) == sorted(done)
    assert all(t.attempts == () and t.result is not None for t in page.tasks)

    everything, cursor = [], None
    while True:
        listed = rdq.list_tasks(queue, limit=3, cursor=cursor)
        everything += listed.tasks
        if listed.next_cursor is None:
            break
        cursor = listed.next_cursor
    assert [t.status for t in everything] == [TaskStatus.PENDING] * 3 + [TaskStatus.DEAD] + [TaskStatus.SUCCEEDED] * 3
    assert {t.id for t in everything} == set(done + later + [dead])

    by_error = rdq.list_tasks(queue, error_type="rdq_core.errors.PermanentError")
    assert [t.id for t in by_error.tasks] == [dead]
    assert [t.id for t in rdq.list_tasks(queue, handler="reject").tasks] == [dead]

    with pytest.raises(InvalidCursor):
        rdq.list_tasks(queue, status="DEAD", cursor=page.next_cursor)
    with pytest.raises(InvalidInput) as refused:
        rdq.list_tasks(queue, status="RUNNING")
    assert refused.value.field == "status"


def test_dry_runs_count_and_change_nothing_then_the_action_is_audited(rdq: HttpClient) -> None:
    queue = fresh_queue()
    dead = [rdq.enqueue(queue, "reject").id for _ in range(3)]
    for task_id in dead:
        status_of(rdq, task_id, TaskStatus.DEAD)
    assert rdq.redrive(queue, all=True, dry_run=True) == 3
    assert rdq.purge_dead(queue, ids=dead[:2], dry_run=True) == 2
    assert rdq.stats(queue).dead == 3
    assert rdq.list_audit(queue=queue).entries == (), "a dry run is not an action"

    assert rdq.purge_dead(queue, ids=[dead[0]]) == 1
    (entry,) = rdq.list_audit(queue=queue).entries
    assert (entry.actor, entry.action, entry.queue, entry.count) == ("local", "purge", queue, 1)
    assert entry.selection == {"ids": [dead[0]]}


def test_cancel_by_filter_cancels_pending_tasks_only(rdq: HttpClient) -> None:
    queue = fresh_queue()
    later = [rdq.enqueue(queue, "greet", delay_seconds=3600).id for _ in range(4)]
    other = rdq.enqueue(queue, "flaky", {"failures": 0}, delay_seconds=3600).id
    assert rdq.cancel_selected(queue, handler="greet", dry_run=True) == 4
    assert rdq.cancel_selected(queue, handler="greet") == 4
    assert all(rdq.get(t).status is TaskStatus.CANCELLED for t in later)
    assert rdq.get(other).status is TaskStatus.PENDING
    with pytest.raises(InvalidInput):
        rdq.cancel_selected(queue)  # nothing selected is refused, not "everything"
    entries = rdq.list_audit(queue=queue).entries
    assert [(e.action, e.count, dict(e.selection)) for e in entries] == [("cancel", 4, {"handler": "greet"})]


def test_a_paused_queue_keeps_its_tasks_pending_while_others_run(rdq: HttpClient) -> None:
    queue, control = fresh_queue(), fresh_queue()
    paused = rdq.pause(queue)
    assert paused.paused and paused.queue == queue
    assert queue in {q.queue for q in rdq.list_queues() if q.paused}, "a paused queue is listed though empty"
    waiting = rdq.enqueue(queue, "greet").id
    # The worker serves every queue each tick: once a task enqueued later into another queue has
    # run, ticks have passed over the paused one.
    ran = rdq.enqueue(control, "greet").id
    status_of(rdq, ran, TaskStatus.SUCCEEDED)
    second = rdq.enqueue(control, "greet").id
    status_of(rdq, second, TaskStatus.SUCCEEDED)
    assert rdq.get(waiting).status is TaskStatus.PENDING
    assert rdq.stats(queue).paused
    resumed = rdq.resume(queue)
    assert not resumed.paused
    status_of(rdq, waiting, TaskStatus.SUCCEEDED)
    actions = [(e.action, e.actor) for e in rdq.list_audit(queue=queue).entries]
    assert actions == [("resume", "local"), ("pause", "local")]


def test_the_audit_trail_pages_newest_first_across_queues(rdq: HttpClient) -> None:
    queues = [fresh_queue() for _ in range(3)]
    for queue in queues:
        rdq.pause(queue)
    first = rdq.list_audit(limit=2)
    assert [e.queue for e in first.entries] == [queues[2], queues[1]] and first.next_cursor
    second = rdq.list_audit(limit=1, cursor=first.next_cursor)
    assert [e.queue for e in second.entries] == [queues[0]]
    with pytest.raises(InvalidCursor):
        rdq.list_audit(queue=queues[0], cursor=first.next_cursor)
    for queue in queues:
        rdq.resume(queue)


# -- who the API records -----------------------------------------------------------------------
def _api_event(method: str, path: str, identity: dict[str, Any], body: Any = None) -> dict[str, Any]:
    return {
        "resource": "/{proxy+}", "path": path, "httpMethod": method,
        "headers": {"Content-Type": "application/json"}, "multiValueHeaders": None,
        "queryStringParameters": None, "multiValueQueryStringParameters": None,
        "pathParameters": {"proxy": path.lstrip("/")}, "stageVariables": None,
        "requestContext": {"accountId": "123456789012", "apiId": "a1b2c3", "stage": "v1", "path": f"/v1{path}",
                           "requestId": "r-1", "resourcePath": "/{proxy+}", "httpMethod": method,
                           "identity": identity},
        "body": None if body is None else json.dumps(body), "isBase64Encoded": False,
    }


ALICE = "arn:aws:sts::123456789012:assumed-role/ops/alice"


@pytest.mark.parametrize("identity, actor", [
    ({"userArn": ALICE, "apiKeyId": None}, ALICE),
    ({"userArn": None, "apiKeyId": "k7x9"}, "api-key:k7x9"),
    ({"sourceIp": "203.0.113.9"}, "anonymous"),
])
def test_the_api_records_the_principal_api_gateway_authenticated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, identity: dict[str, Any], actor: str) -> None:
    url = f"sqlite:///{tmp_path}/api.db"
    for name in ("RDQ_API_TOKEN", "RDQ_WORKER_FUNCTION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RDQ_STORAGE_URL", url)
    monkeypatch.setenv("RDQ_AUTO_MIGRATE", "true")
    from rdq_core.hosts.aws_lambda.api import handle_api_event

    # A header that claims an identity changes nothing: only API Gateway's context counts.
    event = _api_event("POST", "/v1/queues/audited:pause", identity)
    event["headers"]["X-Rdq-Actor"] = "someone-else"
    answer = handle_api_event(event, None)
    assert answer["statusCode"] == 200, answer
    assert json.loads(answer["body"])["paused"] is True
    listed = handle_api_event(_api_event("GET", "/v1/audit", identity), None)
    (entry,) = json.loads(listed["body"])["entries"]
    assert (entry["actor"], entry["action"], entry["queue"]) == (actor, "pause", "audited")
    with Client(url) as client:
        assert client.list_audit().entries[0].actor == actor


# -- the CLI, on a store and through the API ---------------------------------------------------
def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from rdq_core.hosts.cli import main

    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_operator_commands_answer_alike_on_a_store_and_through_the_api(
        dev: DevServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RDQ_API_URL", "RDQ_API_KEY", "RDQ_API_TOKEN", "RDQ_STORAGE_URL"):
        monkeypatch.delenv(name, raising=False)
    direct = ("--storage", dev.storage_url)
    remote = ("--api", dev.url, "--token", TOKEN)
    for where in (direct, remote):
        queue = fresh_queue()
        assert cli(capsys, *where, "pause", queue)[0] == 0
        ids = [json.loads(cli(capsys, *where, "enqueue", queue, "greet", "--json")[1])["id"] for _ in range(3)]
        code, out, _ = cli(capsys, *where, "tasks", queue, "--status", "PENDING", "--json")
        assert code == 0 and sorted(t["id"] for t in json.loads(out)["tasks"]) == sorted(ids)
        code, out, _ = cli(capsys, *where, "tasks", queue, "--limit", "2")
        assert code == 0 and out.splitlines()[0].split()[:3] == ["ID", "STATUS", "HANDLER"] and "more: --cursor" in out
        code, out, _ = cli(capsys, *where, "cancel", queue, "--handler", "greet", "--dry-run", "--json")
        assert (code, json.loads(out)) == (0, {"dry_run": True, "matching": 3})
        code, _, err = cli(capsys, *where, "cancel", queue, "--handler", "greet")  # no terminal to confirm on
        assert code == 2 and "--yes" in err
        code, out, _ = cli(capsys, *where, "cancel", queue, "--id", ids[0], "--json")
        assert (code, json.loads(out)) == (0, {"cancelled": 1})
        code, out, _ = cli(capsys, *where, "resume", queue, "--json")
        assert code == 0 and json.loads(out)["paused"] is False
        code, out, _ = cli(capsys, *where, "audit", "--queue", queue, "--json")
        entries = json.loads(out)["entries"]
        assert [(e["action"], e["actor"], e["count"]) for e in entries] == [
            ("resume", "local", 0), ("cancel", "local", 1), ("pause", "local", 0)]
        code, out, _ = cli(capsys, *where, "audit", "--queue", queue)
        assert code == 0 and out.splitlines()[0].split() == ["AT", "ACTOR", "ACTION", "QUEUE", "COUNT", "SELECTION"]
        code, _, err = cli(capsys, *where, "tasks", queue, "--cursor", "forged")
        assert code == 2 and "cursor" in err.lower()


def test_schedule_changes_are_in_the_audit_trail(tmp_path: Path) -> None:
    from rdq_core.engine.schedules import LocalScheduleBook

    with Client(f"sqlite:///{tmp_path}/audit.db", actor="ops@example") as client:
        client.schedule_book = LocalScheduleBook(tmp_path / "schedules.json")
        client.put_schedule({"name": "nightly", "expression": "cron(0 2 * * ? *)", "queue": "reports",
                             "handler": "greet"})
        client.delete_schedule("nightly")
        entries = client.list_audit(queue="reports").entries
    assert [(e.action, e.actor, dict(e.selection)) for e in entries] == [
        ("unschedule", "ops@example", {"schedule": "nightly"}),
        ("schedule", "ops@example", {"schedule": "nightly", "expression": "cron(0 2 * * ? *)"}),
    ]
