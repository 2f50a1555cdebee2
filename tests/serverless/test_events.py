"""Lifecycle events delivered to EventBridge (moto): what arrives, failed entries retried, a crash
between the outbox write and the delivery, the reaper function's pass, and operations' events."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any, Iterator

import boto3
import pytest

from rdq_core import Client
from rdq_core.compliance.support import dead_letter, wait_until
from rdq_core.aws.eventbridge import MAX_DETAIL_BYTES, EventBridgePublisher, detail_json, put_events_entry
from rdq_core.engine.outbox import deliver_events
from rdq_core.events import MAX_ERROR_MESSAGE_CHARS, EventSettings, OutboxEvent
from rdq_core.hosts.aws_lambda import connection, reaper
from rdq_core.model import DeadFilter, ErrorInfo, NewTask, Outcome, Settlement, TaskFilter, TaskStatus
from rdq_core.engine.operations import drive_operations, start_operation
from rdq_core.storage import open_storage

from .conftest import load_event

moto = pytest.importorskip("moto")

BUS = "rdq-bus"
SETTINGS = EventSettings(enabled=True, bus=BUS)
#: A delivery's deadline where the test is not about the deadline (moto's first call is slow on a busy machine).
GENEROUS = 120


@pytest.fixture
def aws() -> Iterator[dict[str, Any]]:
    """A bus whose every rdq event is forwarded to an SQS queue, so a test reads what arrived."""
    with moto.mock_aws():
        events = boto3.client("events", region_name="us-east-1")
        sqs = boto3.client("sqs", region_name="us-east-1")
        events.create_event_bus(Name=BUS)
        queue_url = sqs.create_queue(QueueName="rdq-events")["QueueUrl"]
        queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        events.put_rule(Name="all-rdq", EventBusName=BUS, EventPattern=json.dumps({"source": ["rdq"]}))
        events.put_targets(Rule="all-rdq", EventBusName=BUS, Targets=[{"Id": "sqs", "Arn": queue_arn}])
        yield {"events": events, "sqs": sqs, "queue_url": queue_url}


def arrived(aws: dict[str, Any]) -> list[dict[str, Any]]:
    """Every event the bus forwarded so far (read and deleted from the queue)."""
    found: list[dict[str, Any]] = []
    while True:
        reply = aws["sqs"].receive_message(QueueUrl=aws["queue_url"], MaxNumberOfMessages=10)
        messages = reply.get("Messages", [])
        if not messages:
            return found
        for message in messages:
            found.append(json.loads(message["Body"]))
            aws["sqs"].delete_message(QueueUrl=aws["queue_url"], ReceiptHandle=message["ReceiptHandle"])


def _change(event_id: str) -> str:
    """A task event's id without its incarnation stamp (``<task id>:<kind>:<number>``)."""
    return event_id.rpartition(":")[0]


def deliver_all(storage: Any, aws: dict[str, Any], expected: int) -> None:
    """Delivery passes until ``expected`` events were delivered: the ones leased to a deliverer
    that failed come back once their lease passes."""
    publisher = EventBridgePublisher(SETTINGS, aws["events"])
    delivered = 0

    def deliver() -> bool:
        nonlocal delivered
        delivered += deliver_events(storage, publisher, deadline=time.monotonic() + GENEROUS).delivered
        return delivered == expected

    wait_until(deliver, GENEROUS, what=f"{expected} events delivered once their lease passed")


@pytest.fixture
def storage(tmp_path: Any) -> Iterator[Any]:
    store = open_storage(f"sqlite:///{tmp_path}/rdq.db")
    store.migrate()
    store.configure_events(SETTINGS)
    yield store
    store.close()


class FailingFirst:
    """EventBridge that refuses the second half of the entries of its first call (throttled), the
    way PutEvents reports a partial failure: FailedEntryCount and a per-entry ErrorCode."""

    def __init__(self, client: Any) -> None:
        self.client, self.calls = client, []

    def put_events(self, Entries: list[dict[str, Any]]) -> dict[str, Any]:
        self.calls.append(len(Entries))
        if len(self.calls) > 1:
            return self.client.put_events(Entries=Entries)
        kept = Entries[: len(Entries) // 2]
        reply = self.client.put_events(Entries=kept)
        refused = [{"ErrorCode": "ThrottlingException", "ErrorMessage": "Rate exceeded"}] * (len(Entries) - len(kept))
        return {"FailedEntryCount": len(refused), "Entries": reply["Entries"] + refused}


def test_dead_tasks_arrive_on_the_bus_in_batches_of_ten_and_leave_the_outbox(aws, storage):
    ids = dead_letter(storage, "emails", 23, handler="mail.send", error_type="smtp.Refused")
    report = deliver_events(storage, EventBridgePublisher(SETTINGS, aws["events"]), deadline=time.monotonic() + GENEROUS)
    assert (report.delivered, report.calls, report.left) == (23, 3, 0), "ten per PutEvents call"
    got = {_change(event["detail"]["id"]): event for event in arrived(aws)}
    assert set(got) == {f"{task_id}:dead:1" for task_id in ids}
    one = got[f"{ids[0]}:dead:1"]
    assert (one["source"], one["detail-type"]) == ("rdq", "rdq.task.dead")
    assert one["detail"]["queue"] == "emails" and one["detail"]["task_id"] == ids[0]
    assert one["detail"]["handler"] == "mail.send" and one["detail"]["attempt"] == 1
    assert one["detail"]["error"]["type"] == "smtp.Refused" and "payload" not in one["detail"]
    assert storage.take_events(10, lease_seconds=1) == [], "accepted events are removed"


def test_failed_entries_are_retried_with_backoff_and_only_accepted_ones_removed(aws, storage):
    dead_letter(storage, "emails", 6)
    flaky = FailingFirst(aws["events"])
    pauses: list[float] = []
    report = deliver_events(storage, EventBridgePublisher(SETTINGS, flaky), deadline=time.monotonic() + GENEROUS,
                            sleep=pauses.append)
    assert flaky.calls == [6, 3], "the refused half is sent again, alone"
    assert report.delivered == 6 and report.refused == 3 and len(pauses) == 1 and pauses[0] > 0
    assert len({event["detail"]["id"] for event in arrived(aws)}) == 6


def test_a_delivery_that_never_succeeds_stops_at_its_deadline_and_keeps_the_events(aws, storage):
    dead_letter(storage, "emails", 2)

    class Down:
        def put_events(self, Entries: list[dict[str, Any]]) -> dict[str, Any]:
            raise ConnectionError("EventBridge unreachable")

    began = time.monotonic()
    report = deliver_events(storage, EventBridgePublisher(SETTINGS, Down()), deadline=began + 0.5, lease_seconds=1.0,
                            first_backoff_seconds=0.05)
    assert time.monotonic() - began < 2 and report.delivered == 0 and report.left == 2
    deliver_all(storage, aws, 2)
    assert len(arrived(aws)) == 2


class Crash(BaseException):
    """The deliverer's process dying (nothing catches it)."""


def test_a_crash_between_the_write_and_the_delivery_loses_nothing(aws, tmp_path):
    url = f"sqlite:///{tmp_path}/crash.db"
    first = open_storage(url)
    first.migrate()
    first.configure_events(SETTINGS)
    ids = dead_letter(first, "emails", 12)

    class DiesAfterSending:
        """EventBridge accepted the batch; the process dies before the outbox hears of it."""

        def put_events(self, Entries: list[dict[str, Any]]) -> dict[str, Any]:
            aws["events"].put_events(Entries=Entries)
            raise Crash()

    with pytest.raises(Crash):
        deliver_events(first, EventBridgePublisher(SETTINGS, DiesAfterSending()), deadline=time.monotonic() + GENEROUS,
                       lease_seconds=0.3)
    first.close()
    restarted = open_storage(url)  # a new process: nothing but the store survived
    restarted.configure_events(SETTINGS)
    deliver_all(restarted, aws, 12)
    got = [event["detail"]["id"] for event in arrived(aws)]
    assert len(got) == 22, "the first batch of ten twice: at least once, not exactly once"
    assert {_change(event_id) for event_id in got} == {f"{task_id}:dead:1" for task_id in ids}
    assert len(set(got)) == 12, "deduplicated by id: each event once"
    assert restarted.take_events(10, lease_seconds=1) == []
    restarted.close()


def test_the_reaper_function_delivers_the_outbox_when_a_bus_is_configured(aws, store_url, lambda_context, monkeypatch):
    monkeypatch.setenv("RDQ_EVENT_BUS", BUS)
    monkeypatch.setattr(reaper, "publisher", None)
    client = Client(connection.shared_storage())
    client.storage.configure_events(EventSettings.from_env())
    dead_letter(client.storage, "emails", 3)
    client.storage.redrive("emails", DeadFilter())
    summary = reaper.lambda_handler(load_event("reaper-scheduled"), lambda_context("rdq-reaper", 60))
    assert summary["events_delivered"] == 6 and summary["events_left"] == 0
    types = sorted(event["detail-type"] for event in arrived(aws))
    assert types == ["rdq.task.dead"] * 3 + ["rdq.task.redriven"] * 3


def test_without_a_bus_the_reaper_writes_and_delivers_nothing(store_url, lambda_context, monkeypatch):
    monkeypatch.setattr(reaper, "publisher", None)
    client = Client(connection.shared_storage())
    dead_letter(client.storage, "emails", 2)
    summary = reaper.lambda_handler(load_event("reaper-scheduled"), lambda_context("rdq-reaper", 60))
    assert summary["events_delivered"] == 0
    assert client.storage.take_events(10, lease_seconds=1) == [], "events are off: none was written"


def test_a_finished_operation_announces_itself(aws, storage):
    dead_letter(storage, "emails", 5)
    operation = start_operation(storage, action="redrive", queue="emails", selection=TaskFilter(), all=True)
    drive_operations(storage, deadline=time.monotonic() + GENEROUS)
    deliver_events(storage, EventBridgePublisher(SETTINGS, aws["events"]), deadline=time.monotonic() + GENEROUS)
    finished = [event["detail"] for event in arrived(aws) if event["detail-type"] == "rdq.operation.finished"]
    assert len(finished) == 1
    detail = finished[0]
    assert detail["id"] == f"op:{operation.id}:finished" and detail["operation_id"] == operation.id
    assert (detail["kind"], detail["status"], detail["matched"], detail["done"]) == ("redrive", "SUCCEEDED", 5, 5)


def test_an_entry_stays_under_the_eventbridge_limit_and_errors_are_cut(storage):
    storage.configure_events(EventSettings(enabled=True, include_payload=True, bus=BUS))
    storage.enqueue([NewTask(id="big", queue="emails", handler="h", payload={"blob": "x" * 300_000})])
    (claimed,) = storage.claim("emails", 1, 30)
    storage.settle([Settlement("big", claimed.claim_token, Outcome.PERMANENT_FAILURE, TaskStatus.DEAD,
                               error=ErrorInfo("E", "m" * 10_000, stack="secret/path.py line 3"))])
    (event,) = storage.take_events(10, lease_seconds=30)
    text = detail_json(event)
    body = json.loads(text)
    assert len(text.encode()) <= MAX_DETAIL_BYTES and body["payload"] is None and body["payload_omitted"]
    assert len(body["error"]["message"]) == MAX_ERROR_MESSAGE_CHARS and body["error"]["truncated"]
    assert "stack" not in body["error"]
    entry = put_events_entry(event, SETTINGS)
    assert entry["EventBusName"] == BUS and entry["DetailType"] == "rdq.task.dead"


def test_event_shape_of_a_recorded_event_has_no_task():
    event = OutboxEvent("op:1:finished", "rdq.operation.finished", "q", None, datetime(2026, 1, 1, tzinfo=timezone.utc))
    assert "task_id" not in event.to_dict()


def test_the_template_scopes_put_events_to_the_bus_for_the_reaper_alone_and_forwards_dead_tasks():
    from .test_template import of_type, transformed

    resources = transformed()["Resources"]
    functions = of_type(resources, "AWS::Lambda::Function")
    assert all(f["Properties"]["Environment"]["Variables"]["RDQ_EVENT_BUS"] == {"Ref": "EventBusName"}
               for f in functions.values()), "every function writes events when a bus is set"
    granted = {name for name, policy in of_type(resources, "AWS::IAM::Role").items() if "events:PutEvents" in json.dumps(policy)}
    assert granted == {"ReaperFunctionRole"}, "only the reaper delivers"
    put_events = json.dumps(resources["ReaperFunctionRole"])
    assert "event-bus/${EventBusName}" in put_events and '"Resource": "*"' not in put_events
    rule = resources["DeadTaskRule"]
    assert rule["Condition"] == "DeadTaskTopicOn" and resources["DeadTaskTopic"]["Condition"] == "DeadTaskTopicOn"
    assert rule["Properties"]["EventPattern"] == {"source": ["rdq"], "detail-type": ["rdq.task.dead"]}
    assert rule["Properties"]["Targets"][0]["Arn"] == {"Ref": "DeadTaskTopic"}
    policy = resources["DeadTaskTopicPolicy"]["Properties"]["PolicyDocument"]["Statement"][0]
    assert policy["Principal"] == {"Service": "events.amazonaws.com"} and policy["Action"] == "sns:Publish"


def test_an_entry_eventbridge_keeps_refusing_does_not_hold_up_the_others(aws, storage):
    ids = dead_letter(storage, "emails", 15)
    poisoned_change = f"{ids[0]}:dead:1"

    class RefusesOne:
        def __init__(self) -> None:
            self.calls = 0

        def put_events(self, Entries: list[dict[str, Any]]) -> dict[str, Any]:
            self.calls += 1
            bad = [i for i, e in enumerate(Entries) if _change(json.loads(e["Detail"])["id"]) == poisoned_change]
            good = aws["events"].put_events(Entries=[e for i, e in enumerate(Entries) if i not in bad])["Entries"]
            replies = iter(good)
            return {"FailedEntryCount": len(bad), "Entries": [
                {"ErrorCode": "MalformedDetail", "ErrorMessage": "no"} if i in bad else next(replies)
                for i in range(len(Entries))]}

    eventbridge = RefusesOne()
    report = deliver_events(storage, EventBridgePublisher(SETTINGS, eventbridge), deadline=time.monotonic() + GENEROUS,
                            sleep=lambda seconds: None)
    assert (report.delivered, report.left) == (14, 1) and eventbridge.calls == 4 + 1, "four tries, then the next batch"
    assert {_change(event["detail"]["id"]) for event in arrived(aws)} == {f"{i}:dead:1" for i in ids[1:]}
    assert storage.take_events(10, lease_seconds=1) == [], "the refused one stays leased, in the outbox"
