"""Schedules on AWS: EventBridge Scheduler calls (moto), the API's schedule routes in deployed
mode, the worker function fired by a Scheduler trigger, and the template's schedule resources."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from rdq_core import Client
from rdq_core.engine import schedules
from rdq_core.errors import InvalidInput, StorageUnavailable
from rdq_core.hosts.aws_lambda import api, worker
from rdq_core.hosts.aws_lambda.local_invoke import api_proxy_event
from rdq_core.aws import scheduler as aws_scheduler
from rdq_core.aws.scheduler import SCHEDULED_TIME, target_input
from rdq_core.engine.schedules import Schedule, SchedulerBook, ScheduleNotFound

from .test_template import managed_policies, transformed

moto = pytest.importorskip("moto")

GROUP = "rdq-schedules"
ROLE_ARN = "arn:aws:iam::123456789012:role/rdq-scheduler"
TARGET_ARN = "arn:aws:lambda:us-east-1:123456789012:function:rdq-worker"


@pytest.fixture
def scheduler() -> Any:
    with moto.mock_aws():
        client = boto3.client("scheduler", region_name="us-east-1")
        client.create_schedule_group(Name=GROUP)
        yield client


@pytest.fixture
def book(scheduler: Any) -> SchedulerBook:
    return SchedulerBook(GROUP, ROLE_ARN, TARGET_ARN, client=scheduler)


def test_a_schedule_becomes_one_scheduler_schedule_targeting_the_worker(book, scheduler):
    schedule = Schedule("nightly", "cron(0 3 * * ? *)", "reports", "build", payload={"a": 1},
                        timezone="Europe/Paris", max_attempts=4)
    book.put(schedule)
    stored = scheduler.get_schedule(Name="nightly", GroupName=GROUP)
    assert stored["ScheduleExpression"] == "cron(0 3 * * ? *)"
    assert stored["ScheduleExpressionTimezone"] == "Europe/Paris"
    assert stored["FlexibleTimeWindow"] == {"Mode": "OFF"}
    assert stored["State"] == "ENABLED"
    target = stored["Target"]
    assert (target["Arn"], target["RoleArn"]) == (TARGET_ARN, ROLE_ARN)
    body = json.loads(target["Input"])
    assert body["scheduled_time"] == SCHEDULED_TIME == "<aws.scheduler.scheduled-time>"
    assert book.get("nightly") == schedule
    assert book.list() == [schedule]


def test_put_replaces_an_existing_schedule(book, scheduler):
    book.put(Schedule("job", "cron(0 3 * * ? *)", "q", "h"))
    book.put(Schedule("job", "cron(30 4 * * ? *)", "q", "h2"))
    assert [s.expression for s in book.list()] == ["cron(30 4 * * ? *)"]
    assert book.get("job").handler == "h2"
    assert len(scheduler.list_schedules(GroupName=GROUP)["Schedules"]) == 1


def test_a_rate_starts_on_the_next_epoch_aligned_instant(book, scheduler):
    book.put(Schedule("every5", "rate(5 minutes)", "q", "h"))
    start = scheduler.get_schedule(Name="every5", GroupName=GROUP)["StartDate"]
    assert start > datetime.now(timezone.utc)
    assert start.timestamp() % 300 == 0


def test_seconds_are_refused_for_scheduler_before_any_call(book, scheduler):
    with pytest.raises(InvalidInput):
        book.put(Schedule("fast", "rate(5 seconds)", "q", "h"))
    assert scheduler.list_schedules(GroupName=GROUP)["Schedules"] == []


def test_delete_and_missing_schedules(book):
    book.put(Schedule("job", "cron(0 3 * * ? *)", "q", "h"))
    book.delete("job")
    assert book.list() == []
    with pytest.raises(ScheduleNotFound):
        book.delete("job")
    with pytest.raises(ScheduleNotFound):
        book.get("job")


def test_schedules_that_are_not_rdq_ones_are_left_out_of_the_list(book, scheduler):
    scheduler.create_schedule(Name="foreign", GroupName=GROUP, ScheduleExpression="rate(1 hour)",
                              FlexibleTimeWindow={"Mode": "OFF"},
                              Target={"Arn": TARGET_ARN, "RoleArn": ROLE_ARN, "Input": '{"something": "else"}'})
    book.put(Schedule("ours", "cron(0 3 * * ? *)", "q", "h"))
    assert [s.name for s in book.list()] == ["ours"]


def test_scheduler_failures_become_rdq_errors():
    class Throttled:
        def create_schedule(self, **_: Any) -> None:
            raise ClientError({"Error": {"Code": "ThrottlingException", "Message": "slow down"}}, "CreateSchedule")

        def get_schedule(self, **_: Any) -> None:
            raise ClientError({"Error": {"Code": "ValidationException", "Message": "bad"}}, "GetSchedule")

        def delete_schedule(self, **_: Any) -> None:
            raise ClientError({"Error": {"Code": "ConflictException", "Message": "busy"}}, "DeleteSchedule")

        def list_schedules(self, **_: Any) -> dict[str, Any]:
            return {"Schedules": [{"Name": "refused-on-read"}]}

    book = SchedulerBook(GROUP, ROLE_ARN, TARGET_ARN, client=Throttled())
    with pytest.raises(StorageUnavailable):  # answered 503 by the API
        book.put(Schedule("job", "cron(0 3 * * ? *)", "q", "h"))
    # A request Scheduler refuses is the caller's to fix (422), on every call, never a 500.
    with pytest.raises(InvalidInput, match="refused the request: bad"):
        book.get("job")
    with pytest.raises(InvalidInput, match="refused the request: busy"):
        book.delete("job")
    assert book.list() == []  # a schedule that cannot be read back is not listed as ours


# -- the API in deployed mode ---------------------------------------------------------------------

def _call(method: str, path: str, body: Any = None) -> tuple[int, Any]:
    event = api_proxy_event(method, path, {"Host": "api.example", "Content-Type": "application/json"},
                            json.dumps(body).encode() if body is not None else b"")
    answer = api.handle_api_event(event, None)
    return answer["statusCode"], json.loads(answer["body"])


def test_the_api_manages_scheduler_schedules_when_deployed(store_url, scheduler, monkeypatch):
    monkeypatch.setenv("RDQ_SCHEDULE_GROUP", GROUP)
    monkeypatch.setenv("RDQ_SCHEDULER_ROLE_ARN", ROLE_ARN)
    monkeypatch.setenv("RDQ_SCHEDULE_TARGET_ARN", TARGET_ARN)
    monkeypatch.setenv("RDQ_AUTH_MODE", "iam")
    definition = {"name": "nightly", "expression": "cron(0 3 * * ? *)", "timezone": "Europe/Paris",
                  "queue": "reports", "handler": "build", "payload": {"a": 1}}
    status, body = _call("POST", "/v1/schedules", definition)
    assert status == 200, body
    assert body["next_task_id"].startswith("sched.nightly.")
    assert scheduler.get_schedule(Name="nightly", GroupName=GROUP)["ScheduleExpressionTimezone"] == "Europe/Paris"

    status, body = _call("POST", "/v1/schedules", {**definition, "expression": "rate(10 seconds)"})
    assert status == 422 and body["field"] == "expression"  # no seconds on AWS

    status, body = _call("GET", "/v1/schedules")
    assert status == 200 and [s["name"] for s in body["schedules"]] == ["nightly"]
    assert _call("DELETE", "/v1/schedules/nightly") == (200, {"deleted": "nightly"})
    status, body = _call("DELETE", "/v1/schedules/nightly")
    assert status == 404
    assert scheduler.list_schedules(GroupName=GROUP)["Schedules"] == []


# -- the worker function, triggered by Scheduler ----------------------------------------------------

def _scheduler_event(schedule: Schedule, scheduled_time: str) -> dict[str, Any]:
    """The invocation Scheduler makes: the target input with the context attribute substituted."""
    return json.loads(target_input(schedule.to_dict()).replace(SCHEDULED_TIME, scheduled_time))


def test_a_duplicate_or_retried_trigger_makes_one_task(store_url, lambda_context):
    schedule = Schedule("tick", "cron(0 * * * ? *)", "scheduled", "quick", payload={"n": 1})
    event = _scheduler_event(schedule, "2026-12-03T17:00:00Z")
    first = worker.run_worker_invocation(event, lambda_context("rdq-worker", 10))
    again = worker.run_worker_invocation(event, lambda_context("rdq-worker", 10))  # Scheduler's retry
    assert first["scheduled"] == {"schedule": "tick", "task_id": "sched.tick.20261203T170000Z", "created": True}
    assert again["scheduled"]["created"] is False
    assert first["queues"] == ["scheduled"] and first["claimed"] == 1  # the task ran in the same invocation
    with Client(store_url) as client:
        tasks = client.list_tasks("scheduled", limit=100).tasks
        assert [t.id for t in tasks] == ["sched.tick.20261203T170000Z"]
        task = client.get("sched.tick.20261203T170000Z")
        assert task.status.value == "SUCCEEDED" and len(task.attempts) == 1

    next_period = worker.run_worker_invocation(_scheduler_event(schedule, "2026-12-03T18:00:00Z"),
                                               lambda_context("rdq-worker", 10))
    assert next_period["scheduled"]["task_id"] == "sched.tick.20261203T180000Z"


def test_a_malformed_trigger_is_refused(store_url, lambda_context):
    schedule = Schedule("tick", "cron(0 * * * ? *)", "scheduled", "quick")
    event = json.loads(target_input(schedule.to_dict()))  # the placeholder never substituted
    with pytest.raises(InvalidInput):
        worker.run_worker_invocation(event, lambda_context("rdq-worker", 10))


# -- the template ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def template() -> dict:
    return transformed({"ExampleSchedule": "true"})


def test_the_template_declares_the_group_role_example_and_api_permissions(template):
    resources = template["Resources"]
    assert resources["RdqScheduleGroup"]["Type"] == "AWS::Scheduler::ScheduleGroup"
    assert template["Parameters"]["ExampleSchedule"]["Default"] == "false"

    example = resources["ExampleRdqSchedule"]
    assert example["Type"] == "AWS::Scheduler::Schedule" and example["Condition"] == "ExampleScheduleOn"
    props = example["Properties"]
    assert props["GroupName"] == {"Ref": "RdqScheduleGroup"}
    assert props["FlexibleTimeWindow"] == {"Mode": "OFF"}
    assert props["Target"]["Arn"] == {"Ref": "WorkerSchedulesAlias"}  # firings are retried and recorded there
    assert props["Target"]["RoleArn"] == {"Fn::GetAtt": ["SchedulerRole", "Arn"]}
    body = json.loads(props["Target"]["Input"])
    schedule = Schedule.from_dict(body["rdq_schedule"], allow_seconds=False)
    assert (schedule.expression, schedule.timezone) == (props["ScheduleExpression"], props["ScheduleExpressionTimezone"])
    assert props["Target"]["Input"] == target_input(schedule.to_dict())  # exactly what the API would write

    role = resources["SchedulerRole"]["Properties"]
    (trust,) = role["AssumeRolePolicyDocument"]["Statement"]
    assert trust["Principal"] == {"Service": "scheduler.amazonaws.com"}
    (invoke,) = role["Policies"][0]["PolicyDocument"]["Statement"]
    assert invoke["Action"] == "lambda:InvokeFunction"
    assert invoke["Resource"] == [{"Ref": "WorkerSchedulesAlias"}, {"Fn::GetAtt": ["WorkerFunction", "Arn"]}]

    statements = resources["ScheduleApiPolicy"]["Properties"]["PolicyDocument"]["Statement"]
    manage = statements[0]
    assert "scheduler:CreateSchedule" in manage["Action"] and "scheduler:DeleteSchedule" in manage["Action"]
    assert "${RdqScheduleGroup}/*" in manage["Resource"]["Fn::Sub"]
    pass_role = statements[2]
    assert pass_role["Action"] == "iam:PassRole"
    assert pass_role["Condition"] == {"StringEquals": {"iam:PassedToService": "scheduler.amazonaws.com"}}

    api_function = resources["ApiFunction"]["Properties"]
    variables = api_function["Environment"]["Variables"]
    assert variables["RDQ_SCHEDULE_GROUP"] == {"Ref": "RdqScheduleGroup"}
    assert variables["RDQ_SCHEDULER_ROLE_ARN"] == {"Fn::GetAtt": ["SchedulerRole", "Arn"]}
    assert variables["RDQ_SCHEDULE_TARGET_ARN"] == {"Ref": "WorkerSchedulesAlias"}
    assert {"Ref": "ScheduleApiPolicy"} in managed_policies(resources["ApiFunctionRole"])


def test_a_trigger_retries_a_store_that_does_not_answer_then_fires(store_url, lambda_context, monkeypatch):

    real_fire = schedules.fire
    calls: list[str] = []

    def flaky_fire(client: Any, schedule: Schedule, instant: datetime) -> Any:
        calls.append(schedule.name)
        if len(calls) < 3:
            raise StorageUnavailable("the store is restarting")
        return real_fire(client, schedule, instant)

    monkeypatch.setattr(schedules, "fire", flaky_fire)
    schedule = Schedule("tick", "cron(0 * * * ? *)", "scheduled", "quick")
    summary = worker.run_worker_invocation(_scheduler_event(schedule, "2026-12-03T17:00:00Z"),
                                           lambda_context("rdq-worker", 30))
    assert len(calls) == 3 and summary["scheduled"]["created"] is True


def test_a_trigger_whose_store_never_answers_fails_the_invocation(store_url, lambda_context, monkeypatch, caplog):
    def down(*_: Any) -> Any:
        raise StorageUnavailable("down")

    monkeypatch.setattr(schedules, "fire", down)
    schedule = Schedule("tick", "cron(0 * * * ? *)", "scheduled", "quick")
    with pytest.raises(StorageUnavailable):
        worker.run_worker_invocation(_scheduler_event(schedule, "2026-12-03T17:00:00Z"),
                                     lambda_context("rdq-worker", 11))


def test_the_worker_knows_a_scheduler_event_by_the_schedules_key():
    # The Lambda worker recognises a Scheduler invocation without importing rdq_core.engine.schedules.
    assert worker.SCHEDULE_EVENT_KEY == aws_scheduler.EVENT_KEY
