"""The production checklist of docs/serverless.md, checked on the template as CloudFormation
receives it: alarms that fire on what the code publishes, least-privilege roles, the API's
endpoint type, and the parameter guards."""

from __future__ import annotations

import json
import re
import time
from datetime import datetime, timezone
from typing import Any

import pytest

from rdq_core import Client
from rdq_core.events import EventSettings, OutboxEvent
from rdq_core.hosts.aws_lambda import connection, observability, reaper

from .conftest import load_event
from .test_dashboard import STACK, _emf_metrics, _resolve, _stack, _stack_owns, published  # noqa: F401 - a fixture
from .test_template import SECRET_ARN, transformed

VPC = {"SubnetIds": "subnet-1,subnet-2", "SecurityGroupIds": "sg-1"}
BOUNDARY = "arn:aws:iam::123456789012:policy/boundary"
EXTRA = ["arn:aws:iam::123456789012:policy/orders-table", "arn:aws:iam::123456789012:policy/reports-bucket"]
XRAY = "arn:aws:iam::aws:policy/AWSXrayWriteOnlyAccess"
ENI = "arn:aws:iam::aws:policy/service-role/AWSLambdaVPCAccessExecutionRole"
BASIC = "arn:aws:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole"


def _created(parameters: dict[str, str]) -> dict[str, Any]:
    stack = _stack({"StorageUrlSecretArn": SECRET_ARN, **parameters})
    # What Ref answers for the stack's own policies, groups and endpoints (their ARN or name).
    stack["values"].update({name: f"ref:{name}" for name in stack["resources"] if name not in stack["values"]})
    stack["values"].update({f"{name}.Arn": f"getatt:{name}.Arn" for name in stack["resources"]})
    return stack


def _attributes_named(node: Any) -> Any:
    """GetAtt of the stack's own resources as a name (``getatt:Resource.Attribute``): what is
    checked here is where a value goes, not what AWS makes of it."""
    if isinstance(node, dict):
        if set(node) == {"Fn::GetAtt"}:
            return "getatt:" + ".".join(node["Fn::GetAtt"])
        return {key: _attributes_named(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_attributes_named(item) for item in node]
    return node


def _props(stack: dict[str, Any], name: str) -> dict[str, Any]:
    properties = _attributes_named(stack["resources"][name]["Properties"])
    return _resolve(properties, stack["values"], stack["conditions"])


# -- 1. alarms -----------------------------------------------------------------------------------------

def _evaluate(expression: str, datapoints: dict[str, float]) -> float | None:
    """One period of a sum of terms, as CloudWatch metric math computes it: a bare metric with no
    datapoint voids the sum; FILL(m, 0) stands in 0."""
    total = 0.0
    for term in expression.replace(" ", "").split("+"):
        filled = re.fullmatch(r"FILL\((\w+),0\)", term)
        name = filled.group(1) if filled else term
        if name not in datapoints and not filled:
            return None
        total += datapoints.get(name, 0.0)
    return total


@pytest.mark.parametrize("failing", ["workererrors", "reapererrors", "workerthrottles"])
def test_function_errors_alarm_fires_while_the_api_is_idle(failing):
    alarm = transformed()["Resources"]["FunctionErrorsAlarm"]["Properties"]
    (total,) = [m for m in alarm["Metrics"] if m.get("ReturnData")]
    # At night only the failing function publishes a datapoint (a function not invoked has none).
    value = _evaluate(total["Expression"], {failing: 2.0})
    assert value is not None and value >= alarm["Threshold"], total["Expression"]
    assert _evaluate(total["Expression"].replace("FILL(", "").replace(", 0)", ""), {failing: 2.0}) is None, \
        "the plain sum this replaces would have had no datapoint"


def test_dead_lettering_rate_and_api_5xx_alarms_read_what_is_published(published):  # noqa: F811
    stack = _created({})
    rate = _props(stack, "DeadLetteredAlarm")
    metric = (rate["Namespace"], rate["MetricName"], tuple(sorted((d["Name"], d["Value"]) for d in rate["Dimensions"])))
    assert metric in published, metric  # the worker's and the reaper's dead-letterings
    assert (rate["Statistic"], rate["Threshold"], rate["TreatMissingData"]) == ("Sum", "1", "notBreaching")
    api = _props(stack, "ApiServerErrorsAlarm")
    metric = (api["Namespace"], api["MetricName"], tuple(sorted((d["Name"], d["Value"]) for d in api["Dimensions"])))
    assert metric[1] == "5XXError" and _stack_owns(stack, metric), metric
    assert api["AlarmName"] == f"{STACK}-rdq-api-5xx"


def test_dropped_schedule_firings_alarm_on_the_alias_only():
    # Ticks, fan-outs and wake-ups are dropped by design at the worker's cap; a firing is not.
    props = transformed()["Resources"]["FiringsDroppedAlarm"]["Properties"]
    assert props["MetricName"] == "AsyncEventsDropped"
    assert {"Name": "Resource", "Value": {"Fn::Sub": "${WorkerFunction}:schedules"}} in props["Dimensions"]


class _Refusing:
    def __init__(self) -> None:
        self.calls = 0

    def publish(self, events):
        self.calls += 1
        raise ConnectionError("no route to EventBridge")


class _Accepting:
    def publish(self, events):
        return [True] * len(events)


def _age(out: str) -> float:
    (blob,) = [json.loads(line) for line in out.splitlines() if '"OutboxUndeliveredAge"' in line]
    value = blob["OutboxUndeliveredAge"]
    return float(value[0] if isinstance(value, list) else value)


@pytest.mark.parametrize("publisher, undelivered", [(_Refusing, True), (_Accepting, False)], ids=["refused", "delivered"])
def test_the_outbox_alarm_reads_the_age_the_reaper_publishes(store_url, lambda_context, capsys, monkeypatch,
                                                             publisher, undelivered):
    storage = Client(connection.shared_storage()).storage
    storage.configure_events(EventSettings(enabled=True, bus="default"))
    storage.record_events([OutboxEvent(id="evt-1", type="rdq.task.dead", queue="emails", task_id="t-1",
                                       at=datetime.now(timezone.utc))])
    time.sleep(0.05)  # the store stamps the event; the age is counted from that
    monkeypatch.setattr(reaper, "publisher", publisher())
    # The functions publish under their stack's name (POWERTOOLS_SERVICE_NAME in the template).
    monkeypatch.setattr(observability, "SERVICE", STACK)
    monkeypatch.setattr(observability.metrics, "service", STACK)
    capsys.readouterr()
    reaper.lambda_handler(load_event("reaper-scheduled"), lambda_context("rdq-reaper", 60))
    reaper.metrics.flush_metrics()
    out = capsys.readouterr().out
    age = _age(out)
    assert (age > 0) if undelivered else age == 0.0, age
    stack = _created({"EventBusName": "default"})
    alarm = _props(stack, "OutboxAgeAlarm")
    metric = (alarm["Namespace"], alarm["MetricName"], tuple(sorted((d["Name"], d["Value"]) for d in alarm["Dimensions"])))
    assert metric in _emf_metrics(out), metric
    assert alarm["Statistic"] == "Maximum" and alarm["Threshold"] == "600"
    assert "OutboxAgeAlarm" not in _created({})["resources"], "no bus, no outbox delivery, no alarm"


# -- 3. IAM ----------------------------------------------------------------------------------------------

ROLES = ("ApiFunctionRole", "WorkerFunctionRole", "ReaperFunctionRole")


@pytest.mark.parametrize("parameters", [{}, VPC, {"EnableTracing": "true"}, {**VPC, "EnableTracing": "true"}],
                         ids=["plain", "vpc", "traced", "vpc-traced"])
def test_eni_and_xray_policies_only_when_in_use(parameters):
    stack = _created(parameters)
    for role in ROLES:
        managed = _props(stack, role)["ManagedPolicyArns"]
        assert BASIC in managed and "ref:StorageUrlReadPolicy" in managed, (role, managed)
        assert (ENI in managed) == ("SubnetIds" in parameters), (role, managed)
        assert (XRAY in managed) == ("EnableTracing" in parameters), (role, managed)
        assert "" not in managed and len(managed) == len(set(managed))
    functions = {name: r for name, r in stack["resources"].items() if r["Type"] == "AWS::Lambda::Function"}
    assert {f["Properties"]["Role"]["Fn::GetAtt"][0] for f in functions.values()} == set(ROLES)


def test_worker_policy_arns_reach_the_worker_role_only():
    stack = _created({"WorkerPolicyArns": ",".join(EXTRA)})
    assert _props(stack, "WorkerFunctionRole")["ManagedPolicyArns"][-2:] == EXTRA
    for role in ("ApiFunctionRole", "ReaperFunctionRole", "SchedulerRole"):
        assert not set(EXTRA) & set(_props(stack, role).get("ManagedPolicyArns", []))


@pytest.mark.parametrize("boundary", ["", BOUNDARY], ids=["none", "given"])
def test_permissions_boundary_on_every_role(boundary):
    stack = _created({"PermissionsBoundary": boundary} if boundary else {})
    roles = [name for name, r in stack["resources"].items() if r["Type"] == "AWS::IAM::Role"]
    assert set(roles) == {*ROLES, "SchedulerRole"}
    for role in roles:
        assert _props(stack, role).get("PermissionsBoundary") == (boundary or None), role
    pattern = transformed()["Parameters"]["PermissionsBoundary"]["AllowedPattern"]
    assert re.fullmatch(pattern, BOUNDARY) and not re.fullmatch(pattern, "boundary")


def test_list_bucket_is_held_to_the_payload_prefixes():
    resources = transformed()["Resources"]
    for name in ("PayloadApiPolicy", "PayloadWorkerPolicy"):
        (listing,) = [s for s in resources[name]["Properties"]["PolicyDocument"]["Statement"] if s["Action"] == "s3:ListBucket"]
        assert listing["Condition"] == {"StringLikeIfExists": {"s3:prefix": ["payloads/*", "results/*"]}}


def test_scheduler_role_trusts_only_this_stacks_schedule_group():
    stack = _created({})
    (statement,) = _props(stack, "SchedulerRole")["AssumeRolePolicyDocument"]["Statement"]
    assert statement["Condition"]["StringEquals"] == {"aws:SourceAccount": "123456789012"}
    assert statement["Condition"]["ArnLike"] == {
        "aws:SourceArn": "arn:aws:scheduler:eu-west-1:123456789012:schedule/ref:RdqScheduleGroup/*"}


# -- 4. API endpoint type --------------------------------------------------------------------------------

def test_the_api_is_regional_by_default_and_private_on_request():
    stack = _created({})
    props = _props(stack, "RdqApi")
    # (None: AWS::NoValue, the key CloudFormation leaves out)
    assert {k: v for k, v in props["EndpointConfiguration"].items() if v is not None} == {"Types": ["REGIONAL"]}
    assert props["Body"].get("x-amazon-apigateway-policy") is None
    private = _created({"ApiEndpointType": "PRIVATE", "ApiVpcEndpointIds": "vpce-1,vpce-2"})
    props = _props(private, "RdqApi")
    assert props["EndpointConfiguration"] == {"Types": ["PRIVATE"], "VpcEndpointIds": ["vpce-1", "vpce-2"]}
    allow, deny = props["Body"]["x-amazon-apigateway-policy"]["Statement"]
    assert allow["Effect"] == "Allow" and deny["Effect"] == "Deny"
    assert deny["Condition"] == {"StringNotEquals": {"aws:SourceVpce": ["vpce-1", "vpce-2"]}}


# -- 7. guards -------------------------------------------------------------------------------------------

def test_a_private_api_needs_its_endpoints():
    from .test_template_account import _rules_hold

    assert any("ApiVpcEndpointIds" in broken for broken in _rules_hold({"ApiEndpointType": "PRIVATE"}))
    assert _rules_hold({"ApiEndpointType": "PRIVATE", "ApiVpcEndpointIds": "vpce-1"}) == []


def test_alarm_topic_arn_takes_only_a_topic_arn():
    pattern = transformed()["Parameters"]["AlarmTopicArn"]["AllowedPattern"]
    for good in ("", "arn:aws:sns:eu-west-1:123456789012:ops", "arn:aws-cn:sns:cn-north-1:123456789012:ops.fifo"):
        assert re.fullmatch(pattern, good), good
    for bad in ("ops", "arn:aws:sqs:eu-west-1:123456789012:ops", "arn:aws:sns:eu-west-1:1234:ops"):
        assert not re.fullmatch(pattern, bad), bad


#: Names the template builds from the stack name, and the service's limit on each.
NAME_LIMITS = {("WorkerFunction", "FunctionName"): 64, ("RdqScheduleGroup", "Name"): 64,
               ("FailedFiringsQueue", "QueueName"): 80, ("RdqApi", "Name"): 1024}
#: The longest stack name every named resource accepts (docs/serverless.md, Production checklist).
MAX_STACK_NAME = 54


def test_the_documented_stack_name_limit_is_the_tightest_resource_name_limit():
    template = transformed()
    longest = {}
    for (resource, prop), limit in NAME_LIMITS.items():
        text = template["Resources"][resource]["Properties"][prop]["Fn::Sub"]
        longest[resource] = limit - len(text.replace("${AWS::StackName}", ""))
    assert min(longest.values()) == MAX_STACK_NAME, longest
    from .conftest import REPO

    assert f"at most {MAX_STACK_NAME} characters" in (REPO / "docs" / "serverless.md").read_text()


def test_every_test_the_checklist_names_exists():
    """A ticked item names its tests: each ``test_...`` and ``tests/...py`` in the checklist must
    exist, so that a renamed test cannot leave an item pointing at nothing."""
    from .conftest import REPO

    guide = (REPO / "docs" / "serverless.md").read_text()
    checklist = guide[guide.index("## Production checklist"):]
    checklist = checklist[: checklist.index("\n### ")]
    defined = {name for path in (REPO / "tests").rglob("test_*.py")
               for name in re.findall(r"^def (test_\w+)", path.read_text(), re.M)}
    named = set(re.findall(r"`(test_\w+)`", checklist))
    assert len(named) > 20 and not named - defined, sorted(named - defined)
    files = set(re.findall(r"`(tests/[\w/]+\.py)`", checklist))
    assert files and all((REPO / f).exists() for f in files), sorted(f for f in files if not (REPO / f).exists())


# -- 6. several stacks in one account -------------------------------------------------------------------

def _service_dimensions(stack: dict[str, Any]) -> set[str]:
    """Every value the stack's alarms and dashboard give the ``service`` dimension, and the service
    its Metrics Insights queries are held to."""
    found: set[str] = set()
    for name, resource in stack["resources"].items():
        if resource["Type"] == "AWS::CloudWatch::Alarm":
            props = _props(stack, name)
            found |= {d["Value"] for d in props.get("Dimensions", []) if d["Name"] == "service"}
            text = json.dumps(props.get("Metrics", []))
        elif resource["Type"] == "AWS::CloudWatch::Dashboard":
            text = _props(stack, name)["DashboardBody"]
            body = json.loads(text)
            for widget in body["widgets"]:
                for row in widget["properties"].get("metrics", []):
                    cells = [c for c in row if isinstance(c, str)]
                    found |= {cells[i + 1] for i in range(len(cells) - 1) if cells[i] == "service"}
        else:
            continue
        found |= set(re.findall(r"WHERE service = '([^']*)'", text))
    return found


@pytest.mark.parametrize("stack_name", ["orders", "billing-eu"])
def test_each_stack_publishes_and_watches_its_own_service_dimension(stack_name):
    # Two stacks in one account and Region: each function publishes under its stack's name, and
    # every alarm and dashboard widget of the stack reads that name only, so they never mix.
    stack = _created({"AlarmQueue1": "emails"})
    stack["values"]["AWS::StackName"] = stack_name
    services = {_resolve(stack["resources"][f]["Properties"]["Environment"]["Variables"]["POWERTOOLS_SERVICE_NAME"],
                         stack["values"], stack["conditions"])
                for f in ("ApiFunction", "WorkerFunction", "ReaperFunction")}
    assert services == {stack_name}
    assert _service_dimensions(stack) == {stack_name}
