"""``HttpClient`` end to end against ``rdq dev`` (a subprocess on a kernel-chosen loopback port,
SQLite in a tmp dir, bearer token), and through a loopback proxy (``tests/rdq_servers.py``) that checks
SigV4 signatures with botocore or injects faults (503s, a response lost after the request went through).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import pytest

from rdq_core.errors import (
    ApiUnavailable,
    InvalidCursor,
    InvalidInput,
    NotAuthorized,
    StorageUnavailable,
    TaskConflict,
    TaskNotFound,
    UnsupportedOperation,
)
from rdq_core.http_client import ApiKey, BearerToken, HttpClient, SigV4
from rdq_core.model import Backoff, TaskStatus
from tests.rdq_servers import ACCESS_KEY, REGION, SECRET_KEY, DevServer, Proxy, dev_server, status_of

TOKEN = "http-client-token-7"
FAST = {"initial_seconds": 0.2, "factor": 2, "max_seconds": 1, "jitter": 0}


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    with dev_server(tmp_path_factory.mktemp("rdq-dev"), token=TOKEN) as server:
        yield server


@pytest.fixture
def rdq(dev: DevServer) -> HttpClient:
    return HttpClient(dev.url, auth=BearerToken(TOKEN), retry_seconds=10)


_queue_numbers = iter(range(1, 10_000))


def fresh_queue() -> str:
    return f"hc{os.getpid()}-{next(_queue_numbers)}"




@pytest.fixture
def proxies(dev: DevServer) -> Iterator[list[Proxy]]:
    started: list[Proxy] = []
    try:
        yield started
    finally:
        for proxy in started:
            proxy.stop()


def aws_session(secret: str = SECRET_KEY) -> Any:
    import botocore.session

    session = botocore.session.Session()
    session.set_credentials(ACCESS_KEY, secret)
    return session


# -- every method against rdq dev ----------------------------------------------------------------
def test_enqueue_get_and_a_handler_runs_it(rdq: HttpClient) -> None:
    queue = fresh_queue()
    task = rdq.enqueue(queue, "greet", {"name": "Ada"}, headers={"trace": "t1"})
    assert task.status is TaskStatus.PENDING and task.queue == queue and task.headers == {"trace": "t1"}
    done = status_of(rdq, task.id, TaskStatus.SUCCEEDED)
    assert done.result["greeting"] == "hello, Ada"
    assert done.attempts[0].outcome.value == "SUCCESS" and done.attempts[0].finished_at is not None
    assert rdq.enqueue(queue, "greet", {"name": "other"}, id=task.id).status is TaskStatus.SUCCEEDED  # a repeat
    stats = rdq.stats(queue)
    assert (stats.queue, stats.succeeded, stats.pending) == (queue, 1, 0)
    listed = {q.queue: q for q in rdq.list_queues()}
    assert listed[queue] == stats


def test_dead_letter_list_redrive_and_purge(rdq: HttpClient) -> None:
    queue = fresh_queue()
    broken = rdq.enqueue(queue, "fail_until_redrive", max_attempts=1, backoff=Backoff(**FAST))
    rejected = rdq.enqueue(queue, "reject", {"reason": "no"})
    status_of(rdq, broken.id, TaskStatus.DEAD)
    status_of(rdq, rejected.id, TaskStatus.DEAD)
    assert rdq.stats(queue).dead == 2
    page = rdq.list_dead(queue, error_type="RuntimeError")
    assert [t.id for t in page.tasks] == [broken.id] and page.next_cursor is None
    assert page.tasks[0].last_error is not None and page.tasks[0].last_error.type == "RuntimeError"
    first = rdq.list_dead(queue, limit=1)
    assert len(first.tasks) == 1 and first.next_cursor
    assert len(rdq.list_dead(queue, limit=1, cursor=first.next_cursor).tasks) == 1
    with pytest.raises(InvalidCursor):
        rdq.list_dead(queue, cursor="not-a-cursor")
    assert rdq.redrive(queue, ids=[broken.id]) == 1
    assert status_of(rdq, broken.id, TaskStatus.SUCCEEDED).redrive_count == 1
    assert rdq.purge_dead(queue, handler="reject") == 1
    assert rdq.list_dead(queue).tasks == ()
    with pytest.raises(TaskNotFound):
        rdq.get(rejected.id)


def test_enqueue_many_with_per_item_results(rdq: HttpClient) -> None:
    queue, other = fresh_queue(), fresh_queue()
    taken = rdq.enqueue(other, "greet", id="hc-taken", delay_seconds=3600)
    results = rdq.enqueue_many(queue, [{"handler": "greet", "payload": {"n": 1}, "delay_seconds": 3600},
                                       {"handler": "greet", "id": "hc-batch-2", "delay_seconds": 3600},
                                       {"handler": "greet", "id": taken.id}])
    assert [(r.created, r.conflict) for r in results] == [(True, False), (True, False), (False, True)]
    assert results[0].task.id and results[0].task.payload == {"n": 1} and results[1].task.id == "hc-batch-2"
    again = rdq.enqueue_many(queue, [{"handler": "greet", "id": "hc-batch-2"}])
    assert (again[0].created, again[0].task.status) == (False, TaskStatus.PENDING)
    assert rdq.stats(queue).pending == 2


def test_cancel_and_the_errors_map_back(rdq: HttpClient, dev: DevServer) -> None:
    queue = fresh_queue()
    task = rdq.enqueue(queue, "greet", delay_seconds=3600)
    assert rdq.cancel(task.id).status is TaskStatus.CANCELLED
    with pytest.raises(TaskConflict):
        rdq.cancel(task.id)  # no longer PENDING
    with pytest.raises(TaskConflict):
        rdq.enqueue(fresh_queue(), "greet", id=task.id)  # the id is taken on another queue
    with pytest.raises(TaskNotFound) as missing:
        rdq.get("no-such-task")
    assert missing.value.task_id == "no-such-task"
    with pytest.raises(InvalidInput) as invalid:
        rdq.enqueue(queue, "greet", max_attempts=0)
    assert invalid.value.field == "max_attempts"
    with pytest.raises(InvalidInput) as unselected:
        rdq.redrive(queue)
    assert unselected.value.field == "ids"
    with pytest.raises(UnsupportedOperation):
        rdq.enqueue(queue, "greet", connection=object())
    with pytest.raises(NotAuthorized) as refused:
        HttpClient(dev.url, auth=BearerToken("wrong-token")).stats(queue)
    assert "wrong-token" not in str(refused.value)
    with pytest.raises(NotAuthorized):
        HttpClient(dev.url, auth=ApiKey("a-key")).stats(queue)  # rdq dev wants its bearer token


# -- SigV4 ---------------------------------------------------------------------------------------
def test_sigv4_signed_requests_pass_a_verifier_and_a_wrong_secret_is_refused(
        dev: DevServer, proxies: list[Proxy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = Proxy(dev, sigv4=True)
    proxies.append(proxy)
    queue = fresh_queue()
    signed = HttpClient(proxy.url, auth=SigV4(session=aws_session(), region=REGION))
    task = signed.enqueue(queue, "greet", {"name": "Grace"})
    assert signed.get(task.id).id == task.id
    assert signed.list_dead(queue, error_type="Some Error", limit=5).tasks == ()  # a signed query string
    assert signed.purge_dead(queue, all=True) == 0

    # The standard chain: credentials and region from the environment, as the AWS CLI reads them.
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    assert HttpClient(proxy.url, auth=SigV4()).stats(queue).queue == queue

    with pytest.raises(NotAuthorized) as refused:
        HttpClient(proxy.url, auth=SigV4(session=aws_session("not-the-secret"), region=REGION)).stats(queue)
    assert "not-the-secret" not in str(refused.value) and "403" in str(refused.value)


def test_sigv4_region_resolution_and_botocore_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rdq_core.errors import ConfigurationError

    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    auth = SigV4(session=aws_session())
    assert auth.region_for("https://abc123.execute-api.ap-south-1.amazonaws.com/prod") == "ap-south-1"
    with pytest.raises(ConfigurationError):
        auth.region_for("https://api.example.com/prod")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "sa-east-1")  # configured wins, as with the AWS CLI
    assert SigV4().region_for("https://abc123.execute-api.ap-south-1.amazonaws.com/prod") == "sa-east-1"
    assert SigV4(region="us-west-2").region_for("https://h.example") == "us-west-2"
    monkeypatch.setitem(sys.modules, "botocore.session", None)  # as if botocore were not installed
    with pytest.raises(ConfigurationError, match="botocore"):
        SigV4()


def test_model_dicts_round_trip() -> None:
    from rdq_core.model import Attempt, DeadPage, ErrorInfo, Outcome, QueueStats, Task

    now = datetime.now(timezone.utc)
    attempt = Attempt(1, Outcome.RETRYABLE_FAILURE, now, now, ErrorInfo("E", "m", "stack"))
    task = Task("id1", "q", "h", {"a": [1]}, TaskStatus.DEAD, {"k": "v"}, 1, 2, 3, Backoff(), now, None, now, now, now,
                None, ErrorInfo("E", "m"), (attempt,))
    assert Task.from_dict(task.to_dict()) == task
    assert DeadPage.from_dict(DeadPage((task,), "c").to_dict()) == DeadPage((task,), "c")
    stats = QueueStats("q", 1, 2, 3, 4, 5, 6.5)
    assert QueueStats.from_dict(stats.to_dict()) == stats


# -- retries -------------------------------------------------------------------------------------
def test_503_twice_then_the_enqueue_goes_through_once(dev: DevServer, rdq: HttpClient, proxies: list[Proxy]) -> None:
    proxy = Proxy(dev, faults=("503", "503"))
    proxies.append(proxy)
    queue = fresh_queue()
    client = HttpClient(proxy.url, retry_seconds=10, backoff_initial=0.05, backoff_max=0.2)
    task = client.enqueue(queue, "greet", delay_seconds=3600)
    assert [status for _, _, status in proxy.log] == [503, 503, 201]
    assert rdq.get(task.id).status is TaskStatus.PENDING and rdq.stats(queue).pending == 1


def test_a_lost_response_is_retried_as_an_idempotent_repeat(dev: DevServer, rdq: HttpClient, proxies: list[Proxy]) -> None:
    proxy = Proxy(dev, faults=("drop",))
    proxies.append(proxy)
    queue = fresh_queue()
    client = HttpClient(proxy.url, retry_seconds=10, backoff_initial=0.05, backoff_max=0.2)
    task = client.enqueue(queue, "greet", delay_seconds=3600)  # no id given: one is made before the first try
    assert [status for _, _, status in proxy.log] == [201, 200]  # written, answer lost; then created=False
    assert len({path for _, path, _ in proxy.log}) == 1
    assert rdq.stats(queue).pending == 1 and rdq.get(task.id).queue == queue


def test_cancel_is_not_repeated_after_the_request_may_have_acted(dev: DevServer, rdq: HttpClient,
                                                                 proxies: list[Proxy]) -> None:
    task = rdq.enqueue(fresh_queue(), "greet", delay_seconds=3600)
    proxy = Proxy(dev, faults=("drop",))
    proxies.append(proxy)
    with pytest.raises(ApiUnavailable):
        HttpClient(proxy.url, retry_seconds=10, backoff_initial=0.05).cancel(task.id)
    assert len(proxy.log) == 1 and rdq.get(task.id).status is TaskStatus.CANCELLED


def test_an_unreachable_api_is_storage_unavailable_within_the_budget() -> None:
    with socket.socket() as placeholder:  # a port nothing listens on: bound, never listening
        placeholder.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{placeholder.getsockname()[1]}"
        client = HttpClient(url, auth=BearerToken(TOKEN), retry_seconds=0.5, backoff_initial=0.05)
        with pytest.raises(StorageUnavailable) as unavailable:
            client.stats("q")
    assert isinstance(unavailable.value, ApiUnavailable) and TOKEN not in str(unavailable.value)
    assert "127.0.0.1" in str(unavailable.value)


def test_the_api_url_is_checked() -> None:
    from rdq_core.errors import ConfigurationError

    for url in ("ftp://host/x", "https://user:secret@host/prod", "https://host/prod?key=1", "not a url"):
        with pytest.raises(ConfigurationError):
            HttpClient(url)
    assert json.loads(json.dumps(HttpClient("https://h.example/prod/").api)) == "https://h.example"


# -- the CLI through the API (rdq --api URL) ----------------------------------------------------

def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``rdq ARGV`` in this process: exit code, standard output, standard error."""
    from rdq_core.hosts.cli import main

    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_cli_through_the_api_answers_as_it_does_on_the_store(
        dev: DevServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RDQ_API_URL", "RDQ_API_KEY", "RDQ_API_TOKEN", "RDQ_STORAGE_URL"):
        monkeypatch.delenv(name, raising=False)
    api = ("--api", dev.url, "--token", TOKEN)
    store = ("--storage", dev.storage_url)
    queue, other = fresh_queue(), fresh_queue()
    code, out, _ = cli(capsys, *api, "enqueue", queue, "greet", "--payload", '{"name": "Lin"}', "--id", "cli-api-1", "--json")
    assert code == 0 and json.loads(out)["created"] is True and json.loads(out)["queue"] == queue
    code, out, _ = cli(capsys, *api, "task", "show", "cli-api-1", "--wait", "SUCCEEDED", "--timeout", "30", "--json")
    assert code == 0 and json.loads(out)["result"]["greeting"] == "hello, Lin"
    # The same command on the store prints the same document, and the text form the same lines.
    assert cli(capsys, *store, "task", "show", "cli-api-1", "--json")[1] == out
    assert cli(capsys, *api, "task", "show", "cli-api-1")[1] == cli(capsys, *store, "task", "show", "cli-api-1")[1]
    assert cli(capsys, *api, "stats", queue, "--json")[1] == cli(capsys, *store, "stats", queue, "--json")[1]
    code, out, _ = cli(capsys, *api, "queues", "--json")
    assert code == 0 and queue in [q["queue"] for q in json.loads(out)["queues"]]
    assert queue in cli(capsys, *store, "queues")[1]
    # A repeat says so; a dead task is listed alike both ways and can be redriven through the API.
    code, out, _ = cli(capsys, *api, "enqueue", queue, "greet", "--id", "cli-api-1")
    assert code == 0 and "already existed" in out
    cli(capsys, *api, "enqueue", queue, "reject", "--id", "cli-api-dead")
    assert cli(capsys, *api, "task", "show", "cli-api-dead", "--wait", "DEAD", "--timeout", "30")[0] == 0
    listed = cli(capsys, *api, "dlq", "list", queue, "--json")
    assert listed[0] == 0 and listed[1] == cli(capsys, *store, "dlq", "list", queue, "--json")[1]
    assert [t["id"] for t in json.loads(listed[1])["tasks"]] == ["cli-api-dead"]
    code, out, _ = cli(capsys, *api, "dlq", "purge", queue, "--id", "cli-api-dead", "--json")
    assert code == 0 and json.loads(out) == {"purged": 1}
    # Exit codes as on a store: not found 3, conflict 4, invalid 2.
    assert cli(capsys, *api, "task", "show", "cli-api-missing")[0] == 3
    assert cli(capsys, *api, "enqueue", other, "greet", "--id", "cli-api-1")[0] == 4
    assert cli(capsys, *api, "enqueue", queue, "greet", "--max-attempts", "0")[0] == 2


def test_the_cli_through_the_api_refuses_what_it_cannot_do_and_names_a_wrong_token(
        dev: DevServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RDQ_API_URL", "RDQ_API_KEY", "RDQ_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    code, _, err = cli(capsys, "--api", dev.url, "--token", "not-the-token", "stats", fresh_queue())
    assert code == 1 and "not-the-token" not in err and "rdq: error:" in err
    code, _, err = cli(capsys, "--api", dev.url, "--token", TOKEN, "worker", "--handlers", "rdq_core.examples")
    assert code == 2 and "--storage" in err
    code, _, err = cli(capsys, "--api", dev.url, "--token", TOKEN, "--api-key", "k", "stats", "q")
    assert code == 2 and "not both" in err
    # RDQ_API_URL alone routes the command through the API.
    monkeypatch.setenv("RDQ_API_URL", dev.url)
    monkeypatch.setenv("RDQ_API_TOKEN", TOKEN)
    code, out, _ = cli(capsys, "stats", fresh_queue(), "--json")
    assert code == 0 and json.loads(out)["pending"] == 0


def test_the_cli_finds_the_api_from_a_stacks_api_url_output(
        dev: DevServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    moto = pytest.importorskip("moto")
    import boto3

    for name in ("RDQ_API_URL", "RDQ_API_KEY", "RDQ_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")

    def stack(name: str, outputs: dict[str, Any]) -> None:
        template = {"Resources": {"Marker": {"Type": "AWS::SSM::Parameter",
                                             "Properties": {"Name": f"{name}-marker", "Type": "String", "Value": "x"}}},
                    "Outputs": {key: {"Value": value} for key, value in outputs.items()}}
        boto3.client("cloudformation", region_name=REGION).create_stack(StackName=name, TemplateBody=json.dumps(template))

    with moto.mock_aws():
        stack("rdq-here", {"ApiUrl": dev.url, "ApiId": "abc"})
        stack("not-rdq", {"Other": "x"})
        queue = fresh_queue()
        code, out, _ = cli(capsys, "--stack", "rdq-here", "--region", REGION, "--token", TOKEN,
                           "enqueue", queue, "greet", "--id", "cli-stack-1", "--json")
        assert code == 0 and json.loads(out)["id"] == "cli-stack-1"
        code, _, err = cli(capsys, "--stack", "not-rdq", "--region", REGION, "stats", queue)
        assert code == 2 and "no ApiUrl output" in err
        code, _, err = cli(capsys, "--stack", "absent", "--region", REGION, "stats", queue)
        assert code == 2 and "could not read stack 'absent'" in err
        code, _, err = cli(capsys, "--stack", "rdq-here", "--api", dev.url, "stats", queue)
        assert code == 2 and "not both" in err
