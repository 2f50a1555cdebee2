"""The stack's CloudWatch dashboard and alarms name only metrics that really exist.

The metrics rdq publishes are not listed here by hand: they are read back from the EMF lines the
worker, reaper and settler print while they run a scenario that makes every one of them happen.
Every widget of the dashboard (rendered from its ``Fn::Sub`` the way CloudFormation would) and
every alarm must name one of those, with the same namespace and dimensions, or an AWS/Lambda or
AWS/ApiGateway metric of a function or API this stack creates.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from typing import Any, Iterator

import pytest

from rdq_core import Client, handler
from rdq_core.hosts.aws_lambda import connection, observability, reaper, worker
from rdq_core.engine.outcomes import from_result
from rdq_core.engine.retry import PolicyBook
from rdq_core.engine.settling import BatchReport, ClaimLedger, Settler

from .conftest import REPO, load_event
from .test_template import _tool, of_type, transformed

STACK = "orders"
REGION = "eu-west-1"
ACCOUNT = "123456789012"

#: Parameter choices the dashboard must survive (each is one transform + condition evaluation).
CHOICES = {
    "defaults": {},
    "no-per-queue-alarms": {"PerQueueAlarms": "false"},
    "api-key-in-vpc-traced": {"AuthMode": "API_KEY", "SubnetIds": "subnet-1", "SecurityGroupIds": "sg-1",
                              "EnableTracing": "true"},
    "bundled-redis-alarm-topic": {"Packaging": "bundled", "StorageBackend": "redis",
                                  "AlarmTopicArn": f"arn:aws:sns:{REGION}:{ACCOUNT}:ops"},
    "named-queue-alarms": {"AlarmQueue1": "emails", "AlarmQueue3": "reports",
                           "AlarmTopicArn": f"arn:aws:sns:{REGION}:{ACCOUNT}:ops"},
}

#: What Ref / GetAtt would answer for the stack's own resources (the physical names CloudFormation
#: would give them; the worker's is set by the template itself).
PHYSICAL = {
    "ApiFunction": f"{STACK}-ApiFunction-Q1w2E3r4T5y6",
    "WorkerFunction": f"{STACK}-worker",
    "ReaperFunction": f"{STACK}-ReaperFunction-A1s2D3f4G5h6",
}


# -- rendering what CloudFormation would deploy ------------------------------------------------------

def _substitutions(template: dict, parameters: dict[str, str], resources: dict) -> dict[str, Any]:
    """What ``Ref`` / ``${...}`` answer in the stack: pseudo parameters, parameters (a
    CommaDelimitedList as its list), the functions' names and the alarms' ARNs."""
    values: dict[str, Any] = {"AWS::StackName": STACK, "AWS::Region": REGION, "AWS::AccountId": ACCOUNT,
                              "AWS::Partition": "aws", "AWS::NoValue": None}
    for name, declared in template["Parameters"].items():
        raw = str(parameters.get(name, declared.get("Default", "")))
        values[name] = raw.split(",") if declared["Type"] == "CommaDelimitedList" else raw
    values.update(PHYSICAL)
    for name, resource in resources.items():
        if resource["Type"] == "AWS::CloudWatch::Alarm":
            values[f"{name}.Arn"] = f"arn:aws:cloudwatch:{REGION}:{ACCOUNT}:alarm:{STACK}-{name}"
    return values


def _resolve(node: Any, values: dict[str, Any], conditions: dict[str, Any]) -> Any:
    """The intrinsic functions this template's dashboard, alarms and conditions use, evaluated as
    CloudFormation would; a name the stack cannot resolve fails the test instead of passing as text."""
    if isinstance(node, list):
        return [v for v in (_resolve(n, values, conditions) for n in node) if v is not None]
    if not isinstance(node, dict):
        return node
    if len(node) != 1 or not (next(iter(node)) == "Ref" or next(iter(node)).startswith(("Fn::", "Condition"))):
        return {key: _resolve(value, values, conditions) for key, value in node.items()}
    ((key, arg),) = node.items()
    if key == "Ref":
        assert arg in values, f"Ref {arg} is not a parameter, pseudo parameter or resource the test knows"
        return values[arg]
    if key == "Condition":
        return conditions[arg]
    if key == "Fn::If":
        name, yes, no = arg
        return _resolve(yes if conditions[name] else no, values, conditions)
    args = [_resolve(a, values, conditions) for a in arg] if isinstance(arg, list) else arg
    if key == "Fn::Join":
        return args[0].join(str(item) for item in args[1])
    if key == "Fn::Split":
        return args[1].split(args[0])
    if key == "Fn::Select":
        return args[1][int(args[0])]
    if key == "Fn::Equals":
        return args[0] == args[1]
    if key == "Fn::Not":
        return not args[0]
    if key == "Fn::And":
        return all(args)
    if key == "Fn::Or":
        return any(args)
    if key == "Fn::Contains":  # (Rules only)
        return args[1] in args[0]
    if key == "Fn::Sub":
        text, local = (arg, {}) if isinstance(arg, str) else (arg[0], _resolve(arg[1], values, conditions))
        scope = {**values, **local}

        def one(match: re.Match[str]) -> str:
            name = match.group(1)
            assert name in scope, f"${{{name}}} is not a parameter, pseudo parameter or resource of the stack"
            return str(scope[name])

        return re.sub(r"\$\{([^}!]+)\}", one, text)
    raise AssertionError(f"{key} is not evaluated by this test")


def _stack(parameters: dict[str, str]) -> dict[str, Any]:
    """The transformed template and the resources CloudFormation would create for ``parameters``."""
    template = transformed(parameters)
    values = _substitutions(template, parameters, template["Resources"])

    class Conditions(dict):  # each evaluated when first named (one may name a later one)
        def __missing__(self, name: str) -> bool:
            self[name] = bool(_resolve(template["Conditions"][name], values, self))
            return self[name]

    conditions = Conditions()
    resources = {name: r for name, r in template["Resources"].items()
                 if "Condition" not in r or conditions[r["Condition"]]}
    values = _substitutions(template, parameters, resources)
    return {"parameters": parameters, "template": template, "resources": resources, "values": values,
            "conditions": conditions}


def _sub(node: Any, stack: dict[str, Any]) -> str:
    rendered = _resolve(node, stack["values"], stack["conditions"])
    assert isinstance(rendered, str), node
    return rendered


@pytest.fixture(scope="module", params=list(CHOICES), ids=list(CHOICES))
def stack(request: pytest.FixtureRequest) -> dict[str, Any]:
    return _stack(CHOICES[request.param])


def _dashboard(stack: dict[str, Any]) -> tuple[str, dict]:
    (dashboard,) = of_type(stack["resources"], "AWS::CloudWatch::Dashboard").values()
    props = dashboard["Properties"]
    return _sub(props["DashboardName"], stack), json.loads(_sub(props["DashboardBody"], stack))


# -- what the code publishes ---------------------------------------------------------------------------

@handler("dashboard-transient-failure", timeout_seconds=2)
def transient_failure(payload: Any, ctx: Any) -> None:
    raise ConnectionError("the downstream service is away for a moment")  # retried with backoff


Metric = tuple[str, str, tuple[tuple[str, str], ...]]


def _emf_metrics(output: str) -> set[Metric]:
    """(namespace, name, dimensions) of every metric in the EMF blobs printed to ``output``."""
    found: set[Metric] = set()
    for line in output.splitlines():
        if not line.startswith('{"_aws"'):
            continue
        blob = json.loads(line)
        for directive in blob["_aws"]["CloudWatchMetrics"]:
            for dimension_set in directive["Dimensions"]:
                dims = tuple(sorted((key, str(blob[key])) for key in dimension_set))
                for metric in directive["Metrics"]:
                    found.add((directive["Namespace"], metric["Name"], dims))
    return found


def _wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        time.sleep(0.02)


@pytest.fixture
def published(store_url, lambda_context, monkeypatch, capsys) -> Iterator[set[Metric]]:
    """Runs a scenario in which every outcome the dashboard shows happens once at least, and
    yields the metrics the code printed as EMF along the way. The functions publish under their
    stack's name (POWERTOOLS_SERVICE_NAME in the template), here STACK's."""
    monkeypatch.setattr(observability, "SERVICE", STACK)
    monkeypatch.setattr(observability.metrics, "service", STACK)
    client = Client(connection.shared_storage())
    storage = client.storage
    client.enqueue("emails", "quick", {"n": 1}, id="ok-1")                              # Claimed, Succeeded
    client.enqueue("emails", "always-permanent", id="dead-1")                           # DeadLettered
    client.enqueue("emails", "dashboard-transient-failure", id="retry-1")              # Retried
    client.enqueue("reports", "needs-twenty-seconds", id="long-1")                     # Released, then too long
    # A 30 s function with 10 s left: the 20 s task does not fit this invocation and is handed back.
    monkeypatch.setenv("RDQ_WORKER_TIMEOUT_SECONDS", "30")
    worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 10))
    # A 10 s function can never run it: dead-lettered as too long for the worker.
    monkeypatch.setenv("RDQ_WORKER_TIMEOUT_SECONDS", "10")
    worker.lambda_handler(load_event("worker-scheduled"), lambda_context("rdq-worker", 10))
    assert client.get("long-1").status.value == "DEAD"

    # A worker that claimed and died on the task's last attempt: the reaper dead-letters it.
    client.enqueue("emails", "quick", id="crashed-1", max_attempts=1)
    (held,) = storage.claim("emails", 10, 0.05)
    _wait_until(lambda: len(storage.find_expired_leases(10)) == 1)
    summary = reaper.lambda_handler(load_event("reaper-scheduled"), lambda_context("rdq-reaper", 60))
    assert summary["expired"] == 1 and summary["dead_lettered"] == 1

    # That worker's late outcome arrives after the reap: fenced off, counted as stale.
    settler = Settler(storage, observability.MetricsTelemetry(), lease_seconds=30)
    report = BatchReport()
    settler.settle([from_result(held, {"late": True}, PolicyBook())], report, ClaimLedger())
    assert report.stale == 1
    observability.metrics.flush_metrics()

    yield _emf_metrics(capsys.readouterr().out)


def test_the_scenario_publishes_every_rate_and_gauge(published):
    names = {name for _, name, _ in published}
    assert {"Claimed", "Succeeded", "Retried", "DeadLettered", "LeaseExpired", "Released", "TooLongForWorker",
            "StaleSettlements", "ClaimLatency", "QueueDepth", "DeadTasks", "OldestPendingAge"} <= names
    assert ("rdq", "QueueDepth", (("queue", "reports"), ("service", STACK))) in published


def test_a_lease_that_expires_on_the_last_attempt_counts_as_dead_lettered(store_url, lambda_context, capsys):
    """The dead-lettered rate covers tasks the reaper dead-letters, not only the worker's."""
    client = Client(connection.shared_storage())
    client.enqueue("emails", "quick", id="crashed-1", max_attempts=1)
    client.enqueue("emails", "quick", id="crashed-2", max_attempts=3)
    client.storage.claim("emails", 10, 0.05)
    _wait_until(lambda: len(client.storage.find_expired_leases(10)) == 2)
    capsys.readouterr()

    reaper.lambda_handler(load_event("reaper-scheduled"), lambda_context("rdq-reaper", 60))

    blobs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"_aws"')]
    counted = [blob for blob in blobs if "DeadLettered" in blob]
    assert [blob["DeadLettered"] for blob in counted] in ([1], [1.0], [[1.0]]), blobs
    assert [blob["LeaseExpired"] for blob in counted] in ([2], [2.0], [[2.0]]), "one reap, both leases"
    assert client.get("crashed-1").status.value == "DEAD" and client.get("crashed-2").status.value == "PENDING"


# -- the dashboard -------------------------------------------------------------------------------------

_QUERY = re.compile(r"^SELECT (?P<stat>AVG|COUNT|MAX|MIN|SUM)\((?P<name>\w+)\) FROM SCHEMA\((?P<schema>[^)]*)\)"
                    r" WHERE service = '(?P<service>[^']*)'"
                    r" GROUP BY (?P<group>[\w, ]+?)(?: ORDER BY \w+\(\) (?:ASC|DESC))?(?: LIMIT \d+)?$")


def _query_metric(expression: str) -> tuple[str, str, tuple[str, ...], tuple[str, ...]]:
    """(namespace, metric, schema dimensions, GROUP BY keys) of a Metrics Insights query."""
    match = _QUERY.match(expression)
    assert match, f"not a grouped Metrics Insights query on one service: {expression!r}"
    assert match["service"] == STACK, "a query reads this stack's metrics only, not every stack's of the account"
    namespace, *dims = (part.strip().strip('"') for part in match["schema"].split(","))
    group = tuple(key.strip() for key in match["group"].split(","))
    assert set(group) <= set(dims), expression
    return namespace, match["name"], tuple(sorted(dims)), group


def _row_metric(row: list) -> Metric:
    namespace, name, *rest = row
    if rest and isinstance(rest[-1], dict):
        rest = rest[:-1]
    assert len(rest) % 2 == 0 and "." not in (namespace, name), row
    return namespace, name, tuple(sorted(zip(rest[0::2], rest[1::2], strict=True)))


def _stack_owns(stack: dict[str, Any], metric: Metric) -> bool:
    """An AWS metric of a function or of the API this stack creates."""
    namespace, _, dims = metric
    resources, values = stack["resources"], stack["values"]
    if namespace == "AWS/Lambda":
        functions = {values[name] for name in of_type(resources, "AWS::Lambda::Function")}
        return len(dims) == 1 and dims[0][0] == "FunctionName" and dims[0][1] in functions
    if namespace == "AWS/ApiGateway":
        (api,) = of_type(resources, "AWS::ApiGateway::RestApi").values()
        stages = {s["Properties"]["StageName"] for s in of_type(resources, "AWS::ApiGateway::Stage").values()}
        wanted = {"ApiName": _sub(api["Properties"]["Name"], stack)}
        return dict(dims) in ({**wanted}, *({**wanted, "Stage": stage} for stage in stages))
    return False


def test_every_parameter_choice_creates_one_dashboard_named_after_the_stack(stack):
    name, body = _dashboard(stack)
    assert name == f"{STACK}-{REGION}", "dashboards are global to an account: the region keeps two stacks apart"
    assert _sub(stack["template"]["Outputs"]["DashboardName"]["Value"], stack) == name
    worker_name = stack["resources"]["WorkerFunction"]["Properties"]["FunctionName"]
    assert _sub(worker_name, stack) == PHYSICAL["WorkerFunction"], "the worker's name is the template's own"
    widgets = body["widgets"]
    assert all(w["x"] + w["width"] <= 24 for w in widgets), "the grid is 24 columns wide"
    cells = [(w["x"] + dx, w["y"] + dy) for w in widgets for dx in range(w["width"]) for dy in range(w["height"])]
    assert len(cells) == len(set(cells)), "no two widgets overlap"
    titles = " | ".join(w["properties"].get("title", "") for w in widgets).lower()
    for subject in ("queue depth", "oldest pending age", "dead tasks", "claimed", "succeeded", "retried",
                    "dead-lettered", "claim latency", "lease expiries", "errors", "throttles", "duration",
                    "4xx", "5xx", "api latency"):
        assert subject in titles, subject


def test_every_widget_names_a_metric_the_code_publishes_or_one_of_the_stacks_resources(stack, published):
    _, body = _dashboard(stack)
    shown = 0
    for widget in body["widgets"]:
        props = widget["properties"]
        if widget["type"] == "text":
            continue
        if widget["type"] == "alarm":
            alarm_arns = {stack["values"][f"{name}.Arn"] for name in of_type(stack["resources"], "AWS::CloudWatch::Alarm")}
            assert props["alarms"] and set(props["alarms"]) <= alarm_arns, props["alarms"]
            continue
        assert widget["type"] == "metric" and props["region"] == REGION, widget
        for row in props["metrics"]:
            if len(row) == 1 and "expression" in row[0]:
                namespace, name, dims, _ = _query_metric(row[0]["expression"])
                assert any((ns, n) == (namespace, name) and tuple(k for k, _ in d) == dims for ns, n, d in published), \
                    f"{props['title']}: nothing publishes {name} in {namespace} with dimensions {dims}"
            else:
                metric = _row_metric(row)
                assert metric in published or _stack_owns(stack, metric), f"{props['title']}: {metric} is not published"
            shown += 1
    assert shown >= 20


def test_the_per_queue_widgets_group_by_queue(stack):
    _, body = _dashboard(stack)
    grouped = {_query_metric(row[0]["expression"])[1]: _query_metric(row[0]["expression"])[3]
               for w in body["widgets"] if w["type"] == "metric" for row in w["properties"]["metrics"]
               if len(row) == 1 and "expression" in row[0]}
    assert grouped == {"QueueDepth": ("queue",), "OldestPendingAge": ("queue",), "DeadTasks": ("queue",)}


# -- the alarms ----------------------------------------------------------------------------------------

#: Alarms on the functions themselves (AWS/Lambda metrics), not on what rdq publishes.
FUNCTION_ALARMS = {"ReaperSilentAlarm", "FunctionErrorsAlarm", "FailedFiringsAlarm", "FiringsDroppedAlarm",
                   "ApiServerErrorsAlarm"}  # (its API metric: test_production_checklist.py)


def _alarms(stack: dict[str, Any]) -> dict[str, dict]:
    return {name: a["Properties"] for name, a in of_type(stack["resources"], "AWS::CloudWatch::Alarm").items()}


def test_alarms_name_published_metrics_and_the_per_queue_ones_name_the_queue(stack, published):
    alarms = {name: props for name, props in _alarms(stack).items() if name not in FUNCTION_ALARMS}
    per_queue = {name: props for name, props in alarms.items() if "Metrics" in props}
    expected = {"QueueDeadTasksAlarm", "QueueOldestPendingAgeAlarm"}
    assert set(per_queue) == (set() if stack["parameters"].get("PerQueueAlarms") == "false" else expected)
    assert {"DeadTasksAlarm", "OldestPendingAgeAlarm"} <= set(alarms), "the all-queue alarms stay"
    for name, props in alarms.items():
        if "MetricName" in props:
            rendered = _resolve(props, stack["values"], stack["conditions"])
            metric = (rendered["Namespace"], rendered["MetricName"],
                      tuple(sorted((d["Name"], d["Value"]) for d in rendered["Dimensions"])))
            assert metric in published, (name, metric)  # named queues: the scenario's emails and reports
            continue
        (query,) = props["Metrics"]
        expression = _sub(query["Expression"], stack)
        namespace, metric_name, dims, group = _query_metric(expression)
        assert group == ("queue",) and query["ReturnData"] is True, name
        assert "ORDER BY" in expression, "a multi-time-series alarm needs GROUP BY and ORDER BY"
        assert any((ns, n) == (namespace, metric_name) and tuple(k for k, _ in d) == dims for ns, n, d in published)
        alarm_name = _sub(props["AlarmName"], stack)
        description = _sub(props["AlarmDescription"], stack)
        assert alarm_name.startswith(f"{STACK}-rdq-") and alarm_name.endswith("-per-queue"), alarm_name
        assert STACK in description and "queue attribute names the queue" in description, description
        threshold = {"QueueDeadTasksAlarm": "DeadTasksAlarmThreshold",
                     "QueueOldestPendingAgeAlarm": "OldestPendingAgeAlarmSeconds"}[name]
        assert props["Threshold"] == {"Ref": threshold}, "the same threshold as the all-queue alarm"
        assert threshold in description, "named, not substituted: see test_no_sub_names_a_number_parameter"


def _api_kwargs(logical_id: str, props: dict, stack: dict[str, Any]) -> dict[str, Any]:
    """An alarm resource's properties as the PutMetricAlarm request CloudFormation makes of them
    (an alarm without a name gets a generated one, as CloudFormation gives it)."""
    kwargs: dict[str, Any] = {"AlarmName": f"{STACK}-{logical_id}-1A2B3C4D5E6F"}
    for key, value in _resolve(props, stack["values"], stack["conditions"]).items():
        if value is not None:
            kwargs[key] = float(value) if key == "Threshold" else value
    return kwargs


def test_the_dashboard_and_alarms_are_accepted_by_the_cloudwatch_api(stack):
    """Each request is validated against the CloudWatch API model by botocore, then stored by moto."""
    import boto3
    from moto import mock_aws

    name, body = _dashboard(stack)
    with mock_aws():
        cloudwatch = boto3.client("cloudwatch", region_name=REGION)
        cloudwatch.put_dashboard(DashboardName=name, DashboardBody=json.dumps(body))
        assert json.loads(cloudwatch.get_dashboard(DashboardName=name)["DashboardBody"]) == body
        for logical_id, props in _alarms(stack).items():
            cloudwatch.put_metric_alarm(**_api_kwargs(logical_id, props, stack))
        described = {a["AlarmName"]: a for a in cloudwatch.describe_alarms()["MetricAlarms"]}
        assert len(described) == len(_alarms(stack))
        per_queue = [a for a in described.values() if a["AlarmName"].endswith("-per-queue")]
        assert len(per_queue) == (0 if stack["parameters"].get("PerQueueAlarms") == "false" else 2)
        for alarm in per_queue:
            assert alarm["Metrics"][0]["Expression"].startswith("SELECT MAX(")
            assert alarm["AlarmActions"] == ([stack["values"]["AlarmTopicArn"]] if stack["values"]["AlarmTopicArn"] else [])


@pytest.mark.parametrize("queues", [
    {},
    {"AlarmQueue1": "emails"},
    {"AlarmQueue1": "emails", "AlarmQueue3": "reports.eu-west_1"},
    {f"AlarmQueue{n}": f"q{n}" for n in range(1, 4)},
], ids=["none", "one", "two-with-a-gap", "all-three"])
def test_alarm_queue_parameters_create_alarms_named_after_each_queue(queues):
    stack = _stack(queues)
    named = {name: props for name, props in _alarms(stack).items() if name.startswith("QueueAlarm")}
    assert len(named) == 2 * len(queues)
    found: dict[str, set[str]] = {}
    for name, props in named.items():
        rendered = _resolve(props, stack["values"], stack["conditions"])
        queue = queues[f"AlarmQueue{name[len('QueueAlarm')]}"]
        assert rendered["Dimensions"] == [{"Name": "queue", "Value": queue}, {"Name": "service", "Value": STACK}]
        kind = {"DeadTasks": "dead-tasks", "OldestPendingAge": "oldest-pending-age"}[rendered["MetricName"]]
        assert rendered["AlarmName"] == f"{STACK}-rdq-queue-{queue}-{kind}"
        assert f"queue {queue}:" in rendered["AlarmDescription"] and f" {queue}`" in rendered["AlarmDescription"]
        found.setdefault(queue, set()).add(kind)
    assert found == {queue: {"dead-tasks", "oldest-pending-age"} for queue in queues.values()}


def test_the_alarm_queue_parameters_take_only_queue_names():
    from rdq_core.validation import QUEUE_NAME

    parameters = transformed()["Parameters"]
    assert not {name for name in parameters if name.startswith("AlarmQueue")} - {f"AlarmQueue{n}" for n in range(1, 4)}
    for n in range(1, 4):
        declared = parameters[f"AlarmQueue{n}"]
        assert declared["Default"] == "" and declared["Type"] == "String"
        pattern = re.compile(declared["AllowedPattern"])
        for candidate in ("", "emails", "reports.eu-west_1", "Emails", "a b", "a,b", "-x", "x" * 121):
            assert bool(pattern.fullmatch(candidate)) == (candidate == "" or bool(QUEUE_NAME.fullmatch(candidate))), \
                candidate


#: What LocalStack 2.3.2's condition evaluator (the LocalStack suite deploys this template) accepts.
LOCALSTACK_CONDITION_FUNCTIONS = {"Ref", "Condition", "Fn::FindInMap", "Fn::If", "Fn::Not", "Fn::And", "Fn::Or",
                                  "Fn::Equals", "Fn::Join", "Fn::Sub"}


def test_no_sub_names_a_number_parameter():
    """LocalStack 2.3.2's Fn::Sub fails on a Number parameter (its default stays an int), which
    fails the LocalStack suite's whole stack."""
    template = transformed()
    numbers = {name for name, p in template["Parameters"].items() if p["Type"] == "Number"}

    def subs(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "Fn::Sub":
                    yield value if isinstance(value, str) else value[0]
                yield from subs(value)
        elif isinstance(node, list):
            for item in node:
                yield from subs(item)

    for section in ("Resources", "Outputs"):
        for text in subs(template[section]):
            named = set(re.findall(r"\$\{([^}!.]+)\}", text))
            assert not named & numbers, (named & numbers, text[:120])


def test_every_condition_uses_only_functions_localstack_evaluates():
    def functions(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                yield key
                yield from functions(value)
        elif isinstance(node, list):
            for item in node:
                yield from functions(item)

    for name, condition in transformed()["Conditions"].items():
        used = set(functions(condition))
        assert used <= LOCALSTACK_CONDITION_FUNCTIONS, (name, used - LOCALSTACK_CONDITION_FUNCTIONS)


@pytest.mark.parametrize("parameters", [{"PerQueueAlarms": "false"}, {"AlarmQueue1": "emails", "AlarmQueue3": "reports"}],
                         ids=["no-per-queue-alarms", "named-queue-alarms"])
def test_cfn_lint_on_the_other_alarm_choices(tmp_path, parameters):
    path = tmp_path / "transformed.json"
    path.write_text(json.dumps(transformed(parameters)))
    result = subprocess.run([_tool("cfn-lint"), "--", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_transformed_template_fits_a_create_stack_request_from_s3():
    """CloudFormation takes at most 51,200 bytes in the request itself (TemplateBody) and 1 MB from
    S3 (TemplateURL). Every deployment documented here goes through S3 (`sam deploy --resolve-s3`,
    infra/localstack/deploy.sh, the LocalStack suite), so 1 MB is the limit, with headroom kept."""
    size = len(json.dumps(transformed()).encode())
    assert size <= 500_000, f"{size} bytes: half of the 1 MB a TemplateURL allows"
    localstack = (REPO / "tests" / "localstack" / "conftest.py").read_text()
    assert "TemplateURL=" in localstack and "TemplateBody=" not in localstack
    assert "--resolve-s3" in (REPO / "infra" / "localstack" / "deploy.sh").read_text()
    assert 'resolve_s3 = true' in (REPO / "samconfig.toml").read_text()


def test_a_dead_reaper_and_failing_or_throttled_functions_raise_alarms(stack):
    """The queue gauges come from the reaper and treat missing data as fine; so its silence is an
    alarm of its own (missing data breaches), and so is any function's error or throttle."""
    alarms = _alarms(stack)
    silent = alarms["ReaperSilentAlarm"]
    assert silent["TreatMissingData"] == "breaching" and silent["ComparisonOperator"] == "LessThanThreshold"
    stats = {m["Id"]: m["MetricStat"]["Metric"] for m in silent["Metrics"] if "MetricStat" in m}
    assert {(m["MetricName"], m["Dimensions"][0]["Value"]["Ref"]) for m in stats.values()} == {
        ("Invocations", "ReaperFunction"), ("Errors", "ReaperFunction")}
    errors = alarms["FunctionErrorsAlarm"]
    named = {(m["MetricStat"]["Metric"]["MetricName"], m["MetricStat"]["Metric"]["Dimensions"][0]["Value"]["Ref"])
             for m in errors["Metrics"] if "MetricStat" in m}
    assert named == {(metric, fn) for metric in ("Errors", "Throttles")
                     for fn in ("ApiFunction", "WorkerFunction", "ReaperFunction")}
    (total,) = [m for m in errors["Metrics"] if m.get("ReturnData")]
    # Each term FILLed with 0: a function with no datapoint in a period must not void the sum.
    terms = total["Expression"].replace(" ", "").split("+")
    assert all(re.fullmatch(r"FILL\(\w+,0\)", term) for term in terms), total["Expression"]
    assert {term[5:-3] for term in terms} == {m["Id"] for m in errors["Metrics"] if "MetricStat" in m}
