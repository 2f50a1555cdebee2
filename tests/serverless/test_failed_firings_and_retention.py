"""No schedule firing dropped without a record, and retention on AWS: the template's alias,
event-invoke configs, failed-firings queue and alarms; RetentionHours reaching the reaper, which
deletes finished tasks with their S3 objects; per-queue gauges only for queues with live work."""

from __future__ import annotations

import time
from typing import Any

import pytest

from rdq_core import Client
from rdq_core.engine import maintenance, payload_retention, payloads
from rdq_core.hosts.aws_lambda import connection, reaper
from rdq_core.engine.retry import PolicyBook

from .conftest import PAYLOAD_BUCKET, REPO, load_event
from .test_template import of_type, transformed

moto = pytest.importorskip("moto")


@pytest.fixture(scope="module")
def resources() -> dict:
    return transformed()["Resources"]


def _invoke_configs(resources: dict) -> dict[tuple[str, str], dict]:
    return {(c["Properties"]["FunctionName"]["Ref"], c["Properties"]["Qualifier"]): c["Properties"]
            for c in of_type(resources, "AWS::Lambda::EventInvokeConfig").values()}


# -- 4. schedule firings --------------------------------------------------------------------------
def test_schedule_firings_go_to_an_alias_that_retries_them_and_records_what_it_gives_up(resources):
    alias = resources["WorkerSchedulesAlias"]["Properties"]
    assert (alias["FunctionName"], alias["FunctionVersion"], alias["Name"]) == ({"Ref": "WorkerFunction"}, "$LATEST",
                                                                             "schedules")
    configs = _invoke_configs(resources)
    firings = configs[("WorkerFunction", "schedules")]
    # Six hours (Lambda's maximum) outlasts a throttling burst; two retries outlast a store outage
    # longer than the invocation's own retries. The period's task id makes each retry a no-op.
    assert (firings["MaximumRetryAttempts"], firings["MaximumEventAgeInSeconds"]) == (2, 21600)
    assert firings["DestinationConfig"] == {"OnFailure": {"Destination": {"Fn::GetAtt": ["FailedFiringsQueue", "Arn"]}}}
    # Ticks, fan-outs and wake-ups are superseded by the next tick: never recorded, dropped in a minute.
    ticks = configs[("WorkerFunction", "$LATEST")]
    assert (ticks["MaximumRetryAttempts"], ticks["MaximumEventAgeInSeconds"]) == (0, 60)
    assert not ticks.get("DestinationConfig")
    # Every Scheduler target is the alias: the example and what the API writes.
    assert resources["ExampleRdqSchedule"]["Properties"]["Target"]["Arn"] == {"Ref": "WorkerSchedulesAlias"}
    env = resources["ApiFunction"]["Properties"]["Environment"]["Variables"]
    assert env["RDQ_SCHEDULE_TARGET_ARN"] == {"Ref": "WorkerSchedulesAlias"}
    (invoke,) = resources["SchedulerRole"]["Properties"]["Policies"][0]["PolicyDocument"]["Statement"]
    assert {"Ref": "WorkerSchedulesAlias"} in invoke["Resource"]


def test_the_failed_firings_queue_is_encrypted_kept_14_days_and_only_the_worker_writes_it(resources):
    queue = resources["FailedFiringsQueue"]["Properties"]
    assert queue["SqsManagedSseEnabled"] is True and queue["MessageRetentionPeriod"] == 1209600
    (policy,) = of_type(resources, "AWS::SQS::QueuePolicy").values()
    statements = {s["Sid"]: s for s in policy["Properties"]["PolicyDocument"]["Statement"]}
    assert statements["TlsOnly"]["Effect"] == "Deny"
    assert statements["TlsOnly"]["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    only = statements["OnlyTheWorkerRecords"]
    assert (only["Effect"], only["Action"]) == ("Deny", "sqs:SendMessage")
    assert only["Condition"] == {"ArnNotEquals": {"aws:PrincipalArn": {"Fn::GetAtt": ["WorkerFunctionRole", "Arn"]}}}
    # The worker's role (Lambda delivers as it) may send there, and no other role mentions the queue.
    for role in ("WorkerFunctionRole", "ApiFunctionRole", "ReaperFunctionRole"):
        text = str(resources[role]["Properties"].get("Policies", []))
        assert ("FailedFiringsQueue" in text) == (role == "WorkerFunctionRole"), role
    sends = [s for p in resources["WorkerFunctionRole"]["Properties"]["Policies"]
             for s in p["PolicyDocument"]["Statement"] if "sqs:" in str(s["Action"])]
    assert sends == [{"Effect": "Allow", "Action": "sqs:SendMessage", "Resource": {"Fn::GetAtt": ["FailedFiringsQueue", "Arn"]}}]


def test_alarms_on_the_queue_depth_and_on_dropped_firings(resources):
    depth = resources["FailedFiringsAlarm"]["Properties"]
    assert (depth["Namespace"], depth["MetricName"]) == ("AWS/SQS", "ApproximateNumberOfMessagesVisible")
    assert depth["Dimensions"] == [{"Name": "QueueName", "Value": {"Fn::Sub": "${AWS::StackName}-failed-firings"}}]
    assert resources["FailedFiringsQueue"]["Properties"]["QueueName"] == {"Fn::Sub": "${AWS::StackName}-failed-firings"}
    dropped = resources["FiringsDroppedAlarm"]["Properties"]
    assert (dropped["Namespace"], dropped["MetricName"], dropped["Statistic"]) == ("AWS/Lambda", "AsyncEventsDropped", "Sum")
    assert dropped["Dimensions"] == [{"Name": "FunctionName", "Value": {"Ref": "WorkerFunction"}},
                                     {"Name": "Resource", "Value": {"Fn::Sub": "${WorkerFunction}:schedules"}}]
    for alarm in (depth, dropped):
        assert (alarm["Threshold"], alarm["ComparisonOperator"]) == (0, "GreaterThanThreshold")
        assert alarm["AlarmActions"] == {"Fn::If": ["HasAlarmTopic", [{"Ref": "AlarmTopicArn"}], {"Ref": "AWS::NoValue"}]}


def test_the_reaper_is_never_retried_so_two_never_overlap(resources):
    reaper_config = _invoke_configs(resources)[("ReaperFunction", "$LATEST")]
    assert (reaper_config["MaximumRetryAttempts"], reaper_config["MaximumEventAgeInSeconds"]) == (0, 60)


def test_the_docs_say_what_a_firing_survives_and_promise_no_hour_of_lambda_retries():
    text = (REPO / "docs" / "serverless.md").read_text()
    assert "### What a schedule firing survives" in text
    assert "<stack>-failed-firings" in text
    assert "retries it for up to an hour (the" not in text, "Scheduler's hour covers only its Invoke call"


# -- 5. retention ---------------------------------------------------------------------------------
def test_retention_hours_reaches_the_reaper_only(resources):
    parameter = transformed()["Parameters"]["RetentionHours"]
    assert (parameter["Type"], parameter["Default"], parameter["MinValue"]) == ("Number", 168, 0)
    for name in ("ApiFunction", "WorkerFunction", "ReaperFunction"):
        variables = resources[name]["Properties"]["Environment"]["Variables"]
        assert (variables.get("RDQ_RETENTION_HOURS") == {"Ref": "RetentionHours"}) == (name == "ReaperFunction")


BUCKET = PAYLOAD_BUCKET


def _keys(s3: Any) -> list[str]:
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", []))


def test_retention_deletes_finished_tasks_with_their_objects_and_keeps_the_rest(s3, lambda_context, monkeypatch):
    storage = connection.shared_storage()
    client = Client(storage)
    big = {"text": "x" * 300_000}
    client.enqueue("reports", "big-result", big, id="done")
    # What the worker does with a large result: the object first, then the settlement.
    (item,) = storage.claim("reports", 1, 30)
    storage.settle([payloads.handler_outcome(item, {"rows": ["r" * 100] * 3000}, PolicyBook())])
    assert client.get("done").status.value == "SUCCEEDED"
    done_keys = _keys(s3)
    assert any(k.startswith("payloads/") for k in done_keys) and any(k.startswith("results/") for k in done_keys)
    time.sleep(0.5)
    # Enqueued after: pending (its object must stay), and not yet old.
    client.enqueue("reports", "digest", big, id="waiting", delay_seconds=3600)
    waiting_keys = sorted(set(_keys(s3)) - set(done_keys))
    assert len(waiting_keys) == 1

    monkeypatch.setenv("RDQ_RETENTION_HOURS", str(0.3 / 3600))
    summary = reaper.lambda_handler(load_event("reaper-scheduled"), lambda_context("rdq-reaper", 60))
    assert summary["retention_deleted"] == 1 and summary["failed_steps"] == [], summary
    assert storage.get("done") is None
    assert _keys(s3) == waiting_keys, "the purged task's payload and result are gone, the pending task's stays"


def test_a_task_the_purge_leaves_keeps_its_objects(s3, monkeypatch):
    storage = connection.shared_storage()
    client = Client(storage)
    client.enqueue("reports", "digest", {"text": "x" * 300_000}, id="finished")
    client.cancel("finished")
    keys = _keys(s3)
    time.sleep(0.4)
    # The store purges nothing (another reaper holds the rows): no object may go.
    monkeypatch.setattr(storage, "purge_succeeded", lambda older_than, limit: 0)
    assert payload_retention.purge_finished_tasks(storage, 0.3, 100) == 0
    assert _keys(s3) == keys and client.get("finished") is not None


def test_zero_retention_hours_keeps_everything(store_url, lambda_context, monkeypatch):
    client = Client(connection.shared_storage(), payload_store=None)
    client.enqueue("q", "quick", id="kept")
    client.cancel("kept")
    time.sleep(0.2)
    monkeypatch.setenv("RDQ_RETENTION_HOURS", "0")
    summary = reaper.lambda_handler(load_event("reaper-scheduled"), lambda_context("rdq-reaper", 60))
    assert summary["retention_deleted"] == 0 and client.get("kept") is not None


def test_retention_keeps_to_its_share_of_the_pass(store_url, monkeypatch):
    storage = connection.shared_storage()
    calls: list[float] = []
    now = [0.0]

    def chunk(*args: Any, **kwargs: Any) -> int:
        calls.append(now[0])
        now[0] += 4.0  # each chunk takes 4 s
        return maintenance.RETENTION_CHUNK

    monkeypatch.setattr(payload_retention, "purge_finished_tasks", chunk)
    purged = maintenance.apply_retention(storage, 1.0, deadline=10.0, clock=lambda: now[0])
    assert calls == [0.0, 4.0, 8.0] and purged == 3 * maintenance.RETENTION_CHUNK


# -- 5. gauges only for queues with live work ------------------------------------------------------
def test_per_queue_gauges_only_for_queues_with_live_work(store_url, lambda_context, monkeypatch):
    published: list[tuple[str, str, float]] = []
    monkeypatch.setattr(reaper, "publish_queue_gauge", lambda queue, name, value, *unit: published.append((queue, name, value)))
    monkeypatch.setattr(reaper, "_live_queues", set())
    client = Client(connection.shared_storage(), payload_store=None)
    client.enqueue("used-once", "quick", id="a")
    client.cancel("a")
    client.enqueue("busy", "quick", id="b")

    def gauged() -> set[str]:
        published.clear()
        reaper.lambda_handler(load_event("reaper-scheduled"), lambda_context("rdq-reaper", 60))
        return {queue for queue, _, _ in published}

    assert gauged() == {"busy"}, "a queue with only finished tasks publishes nothing"
    client.cancel("b")
    # The queue that just lost its live work gets zeros once (graphs and alarms fall to 0), then nothing.
    assert gauged() == {"busy"} and {value for _, _, value in published} == {0}
    assert gauged() == set()
