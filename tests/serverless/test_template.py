"""template.yaml: SAM lint, cfn-lint on the transformed template, assertions on the resources
CloudFormation would create, and a real `sam build` for python3.12."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

SECRET_ARN = "arn:aws:secretsmanager:us-east-1:123456789012:secret:rdq-url-AbCdEf"


def _python312_bin() -> Path | None:
    """The directory of a working python3.12, found as a user's shell would: ``python3.12`` on
    PATH, else pyenv's own versions (``$(pyenv root)/versions/3.12*``). A pyenv shim on PATH
    may exist without serving 3.12 here, so each candidate is run and its real home returned."""
    candidates = [found] if (found := shutil.which("python3.12")) else []
    pyenv = shutil.which("pyenv")
    root = os.environ.get("PYENV_ROOT")
    if pyenv:
        probe = subprocess.run([pyenv, "root"], capture_output=True, text=True, timeout=30)
        root = probe.stdout.strip() if probe.returncode == 0 else root
    if root:
        candidates += [str(p) for p in sorted(Path(root).glob("versions/3.12*/bin/python3.12"), reverse=True)]
    for candidate in candidates:
        probe = subprocess.run([candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)"],
                               capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return Path(probe.stdout.strip()).parent
    return None


def _tool(name: str) -> str:
    found = shutil.which(name) or str(Path(sys.executable).with_name(name))
    if not Path(found).exists():
        pytest.skip(f"{name} is not installed (dev extra)")
    return found


def transformed(parameters: dict[str, str] | None = None) -> dict:
    """The template after the SAM transform, as CloudFormation receives it."""
    from samtranslator.translator.transform import transform
    from samtranslator.yaml_helper import yaml_parse

    template = yaml_parse((REPO / "template.yaml").read_text())
    for resource in template["Resources"].values():
        props = resource.get("Properties", {})
        for key in ("CodeUri", "ContentUri"):
            if key in props:  # what `sam package` does: local paths become S3 artifacts
                props[key] = f"s3://rdq-artifacts/{props[key].strip('./').replace('/', '-') or 'root'}.zip"

    class ManagedPolicies:
        def load(self) -> dict[str, str]:
            return {"AWSLambdaVPCAccessExecutionRole": "arn:aws:iam::aws:policy/service-role/AWSLambdaVPCAccessExecutionRole"}

    return transform(template, {"StorageUrlSecretArn": SECRET_ARN, **(parameters or {})}, ManagedPolicies())


@pytest.fixture(scope="module")
def resources() -> dict:
    return transformed()["Resources"]


def of_type(resources: dict, kind: str) -> dict:
    return {name: r for name, r in resources.items() if r["Type"] == kind}


def test_sam_validate_lint():
    result = subprocess.run([_tool("sam"), "validate", "--lint", "--template", str(REPO / "template.yaml")],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("parameters", [{}, {"AuthMode": "API_KEY", "SubnetIds": "subnet-1,subnet-2", "SecurityGroupIds": "sg-1",
                                              "EnableTracing": "true"}],
                         ids=["defaults", "api-key-in-vpc-traced"])
def test_cfn_lint_on_the_transformed_template(tmp_path, parameters):
    path = tmp_path / "transformed.json"
    path.write_text(json.dumps(transformed(parameters)))
    result = subprocess.run([_tool("cfn-lint"), "--", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_three_functions_on_python312_with_thin_handlers(resources):
    functions = of_type(resources, "AWS::Lambda::Function")
    assert set(functions) == {"ApiFunction", "WorkerFunction", "ReaperFunction"}
    for name, fn in functions.items():
        props = fn["Properties"]
        assert props["Runtime"] == "python3.12"
        assert props["Handler"] == "app.lambda_handler"
        # X-Ray is opt-in (EnableTracing): the function mode and the Powertools switch agree.
        assert props["TracingConfig"] == {"Mode": {"Fn::If": ["TracingOn", "Active", "PassThrough"]}}
        assert props["Environment"]["Variables"]["POWERTOOLS_TRACE_DISABLED"] == {"Fn::If": ["TracingOn", "false", "true"]}
        # With layered packaging, the chosen backend's engine layer, plus the X-Ray layer only when
        # tracing is on; with bundled packaging, none. (SAM suffixes layer logical ids with a
        # content hash, hence the prefixes.)
        # (The worker's own list adds your handler layers: resolved in the tests below.)
        engine, tracing = (props if name != "WorkerFunction" else functions["ApiFunction"]["Properties"])["Layers"]
        on_layers, chosen, no_engine = engine["Fn::If"]
        assert on_layers == "UseLayers" and no_engine == {"Ref": "AWS::NoValue"}
        on_postgres, postgres_layer, otherwise = chosen["Fn::If"]
        on_redis, redis_layer, mongo_layer = otherwise["Fn::If"]
        assert (on_postgres, on_redis) == ("UsePostgres", "UseRedis")
        assert postgres_layer["Ref"].startswith("RdqPostgresLayer") and redis_layer["Ref"].startswith("RdqRedisLayer")
        assert mongo_layer["Ref"].startswith("RdqMongoLayer")
        on_tracing, tracing_layer, no_layer = tracing["Fn::If"]
        assert on_tracing == "TracingLayerAttached" and tracing_layer["Ref"].startswith("RdqTracingLayer")
        assert no_layer == {"Ref": "AWS::NoValue"}
        # One network placement for all three (Globals): the database's subnets, when given.
        placement = {"SubnetIds": {"Ref": "SubnetIds"}, "SecurityGroupIds": {"Ref": "SecurityGroupIds"}}
        assert props["VpcConfig"] == {"Fn::If": ["UseVpc", placement, {"Ref": "AWS::NoValue"}]}
        folder = {"ApiFunction": "api", "WorkerFunction": "worker", "ReaperFunction": "reaper"}[name]
        assert (REPO / "functions" / folder / "app.py").exists()


# -- what CloudFormation would create for given parameters: conditions evaluated ------------------

def _value(template: dict, parameters: dict[str, str], node: object, conditions: dict[str, bool]) -> object:
    if isinstance(node, dict) and len(node) == 1:
        ((key, arg),) = node.items()
        if key == "Ref" and arg in template["Parameters"]:
            declared = template["Parameters"][arg]
            raw = parameters.get(arg, str(declared.get("Default", "")))
            return raw.split(",") if declared["Type"] == "CommaDelimitedList" and raw else ([] if declared["Type"] ==
                                                                                                 "CommaDelimitedList" else raw)
        if key == "Fn::Join":  # a resource's Ref joins as its logical id
            separator, items = arg
            return separator.join(i["Ref"] if isinstance(i, dict) and "Ref" in i else str(i)
                                  for i in _value(template, parameters, items, conditions))
        if key == "Fn::Split":
            separator, text = arg
            return str(_value(template, parameters, text, conditions)).split(separator)
        if key == "Fn::Equals":
            left, right = (_value(template, parameters, a, conditions) for a in arg)
            return left == right
        if key == "Fn::Not":
            return not _value(template, parameters, arg[0], conditions)
        if key == "Fn::And":
            return all(_value(template, parameters, a, conditions) for a in arg)
        if key == "Fn::Or":
            return any(_value(template, parameters, a, conditions) for a in arg)
        if key == "Condition":
            return _condition(template, parameters, arg, conditions)
        if key == "Fn::If":
            name, yes, no = arg
            return _value(template, parameters, yes if _condition(template, parameters, name, conditions) else no, conditions)
    if isinstance(node, list):
        return [v for v in (_value(template, parameters, n, conditions) for n in node) if v != {"Ref": "AWS::NoValue"}]
    return node


def _condition(template: dict, parameters: dict[str, str], name: str, conditions: dict[str, bool]) -> bool:
    if name not in conditions:
        conditions[name] = bool(_value(template, parameters, template["Conditions"][name], conditions))
    return conditions[name]


def created(parameters: dict[str, str]) -> dict:
    """The resources CloudFormation would create for these parameters (conditions applied), each
    function's ``Layers`` resolved to the layer logical ids it would really get."""
    template = transformed(parameters)
    given = {"StorageUrlSecretArn": SECRET_ARN, **parameters}
    conditions: dict[str, bool] = {}
    kept = {name: r for name, r in template["Resources"].items()
            if "Condition" not in r or _condition(template, given, r["Condition"], conditions)}
    for fn in of_type(kept, "AWS::Lambda::Function").values():
        layers = _value(template, given, fn["Properties"].get("Layers", []), conditions)
        fn["Properties"]["Layers"] = [] if layers == {"Ref": "AWS::NoValue"} else [
            layer["Ref"] if isinstance(layer, dict) else layer for layer in layers]
    return kept


@pytest.mark.parametrize("backend, layer", [("postgresql", "RdqPostgresLayer"), ("redis", "RdqRedisLayer"),
                                            ("mongodb", "RdqMongoLayer")])
def test_layered_packaging_attaches_the_chosen_backends_layer_only(backend, layer):
    for tracing in ("false", "true"):
        resources = created({"StorageBackend": backend, "EnableTracing": tracing})
        layers = sorted(name.rstrip("0123456789abcdef") for name in of_type(resources, "AWS::Lambda::LayerVersion"))
        expected = sorted([layer] + (["RdqTracingLayer"] if tracing == "true" else []))
        assert layers == expected
        for fn in of_type(resources, "AWS::Lambda::Function").values():
            assert sorted(ref.rstrip("0123456789abcdef") for ref in fn["Properties"]["Layers"]) == expected


@pytest.mark.parametrize("tracing", ["false", "true"])
def test_bundled_packaging_creates_and_attaches_no_layer(tracing):
    # LocalStack Community accepts layer resources but never applies them: none may be needed.
    resources = created({"Packaging": "bundled", "StorageBackend": "redis", "EnableTracing": tracing})
    assert of_type(resources, "AWS::Lambda::LayerVersion") == {}
    functions = of_type(resources, "AWS::Lambda::Function")
    assert len(functions) == 3 and all(fn["Properties"]["Layers"] == [] for fn in functions.values())
    assert transformed()["Parameters"]["Packaging"]["Default"] == "layers", "AWS keeps the layers"


HANDLER_LAYERS = ["arn:aws:lambda:us-east-1:123456789012:layer:orders-handlers:3",
                  "arn:aws:lambda:us-east-1:123456789012:layer:orders-deps:1"]


@pytest.mark.parametrize("packaging, tracing", [("layers", "false"), ("layers", "true"), ("bundled", "false")])
def test_handler_layers_follow_rdqs_own_on_the_worker_only(packaging, tracing):
    """HandlerLayerArns (examples/sam-app): your layers after rdq's, in order, on the worker alone,
    and never an empty or placeholder entry (the list is joined and split, no AWS::NoValue in it)."""
    base = {"Packaging": packaging, "StorageBackend": "redis", "EnableTracing": tracing}
    rdq_own = ([] if packaging == "bundled" else ["RdqRedisLayer"] + (["RdqTracingLayer"] if tracing == "true" else []))
    for given, handler_layers in (({}, []), ({"HandlerLayerArns": HANDLER_LAYERS[0]}, HANDLER_LAYERS[:1]),
                                  ({"HandlerLayerArns": ",".join(HANDLER_LAYERS)}, HANDLER_LAYERS)):
        functions = of_type(created({**base, **given}), "AWS::Lambda::Function")
        worker = [layer.rstrip("0123456789abcdef") if layer.startswith("Rdq") else layer
                  for layer in functions["WorkerFunction"]["Properties"]["Layers"]]
        assert worker == rdq_own + handler_layers, given
        for name in ("ApiFunction", "ReaperFunction"):
            assert not set(HANDLER_LAYERS) & set(functions[name]["Properties"]["Layers"]), name
    template = transformed()
    assert template["Parameters"]["HandlerLayerArns"] == {**template["Parameters"]["HandlerLayerArns"],
                                                          "Type": "CommaDelimitedList", "Default": ""}
    (worker_group,) = [group for group in template["Metadata"]["AWS::CloudFormation::Interface"]["ParameterGroups"]
                       if group["Label"]["default"] == "Worker"]
    assert "HandlerLayerArns" in worker_group["Parameters"]


def test_functions_are_built_by_the_functions_makefile():
    from samtranslator.yaml_helper import yaml_parse

    template = yaml_parse((REPO / "template.yaml").read_text())
    makefile = (REPO / "functions" / "Makefile").read_text()
    for name in ("ApiFunction", "WorkerFunction", "ReaperFunction"):
        assert template["Resources"][name]["Metadata"] == {"BuildMethod": "makefile", "ContextPath": "functions"}
        assert f"build-{name}" in makefile


def test_worker_timeout_leaves_room_for_the_lease_margin(resources):
    worker = resources["WorkerFunction"]["Properties"]
    template = transformed()
    assert worker["Timeout"] == {"Ref": "WorkerTimeout"}
    env = worker["Environment"]["Variables"]
    assert env["RDQ_LEASE_GRACE_SECONDS"] == {"Ref": "LeaseGraceSeconds"}
    params = template["Parameters"]
    assert params["WorkerTimeout"]["MaxValue"] <= 900 and params["WorkerTimeout"]["MinValue"] >= 10
    # The reaper must finish well inside a lease grace: it never runs longer than the smallest grace.
    assert resources["ReaperFunction"]["Properties"]["Timeout"] <= 900
    assert params["LeaseGraceSeconds"]["MinValue"] >= 5
    assert resources["ApiFunction"]["Properties"]["Timeout"] <= 29, "API Gateway's integration limit"


def test_reserved_concurrency_is_opt_in_and_then_the_fan_out_cap(resources):
    template = transformed()
    # A new account's limit is 10 with 10 kept unreserved: any reservation would fail there.
    assert template["Parameters"]["ReserveConcurrency"]["Default"] == "false"
    assert template["Conditions"]["ReserveLambdaConcurrency"] == {"Fn::Equals": [{"Ref": "ReserveConcurrency"}, "true"]}
    worker = resources["WorkerFunction"]["Properties"]
    assert worker["ReservedConcurrentExecutions"] == {
        "Fn::If": ["ReserveLambdaConcurrency", {"Ref": "MaxWorkerConcurrency"}, {"Ref": "AWS::NoValue"}]}
    assert worker["Environment"]["Variables"]["RDQ_MAX_WORKER_CONCURRENCY"] == {"Ref": "MaxWorkerConcurrency"}
    assert resources["ReaperFunction"]["Properties"]["ReservedConcurrentExecutions"] == {
        "Fn::If": ["ReserveLambdaConcurrency", 1, {"Ref": "AWS::NoValue"}]}
    invoke_config = of_type(resources, "AWS::Lambda::EventInvokeConfig")
    # Ticks, fan-outs and wake-ups, and the reaper, are never retried; schedule firings (the
    # worker's schedules alias) are (tests/serverless/test_failed_firings_and_retention.py).
    retries = {(c["Properties"]["FunctionName"]["Ref"], c["Properties"]["Qualifier"]): c["Properties"]["MaximumRetryAttempts"]
               for c in invoke_config.values()}
    assert retries == {("WorkerFunction", "$LATEST"): 0, ("ReaperFunction", "$LATEST"): 0, ("WorkerFunction", "schedules"): 2}


def test_schedules_target_worker_and_reaper(resources):
    rules = of_type(resources, "AWS::Events::Rule")
    targets = {r["Properties"]["Targets"][0]["Arn"]["Fn::GetAtt"][0]: r["Properties"]["ScheduleExpression"]
               for r in rules.values() if "ScheduleExpression" in r["Properties"]}
    assert targets == {"WorkerFunction": {"Ref": "WorkerSchedule"}, "ReaperFunction": {"Ref": "ReaperSchedule"}}
    assert transformed()["Parameters"]["WorkerSchedule"]["Default"] == "rate(1 minute)"


def test_rest_api_sends_every_path_to_the_api_function_with_auth(resources):
    (api,) = of_type(resources, "AWS::ApiGateway::RestApi").values()
    paths = api["Properties"]["Body"]["paths"]
    # One proxy resource: the routes are the function's route table, not repeated here
    # (tests/hostile/test_access_control.py checks every route of the table is behind it).
    assert {(p, m) for p, ops in paths.items() for m in ops} == {("/{proxy+}", "x-amazon-apigateway-any-method")}
    for ops in paths.values():
        for op in ops.values():
            assert op["x-amazon-apigateway-integration"]["type"] == "aws_proxy"
            assert "ApiFunction.Arn" in op["x-amazon-apigateway-integration"]["uri"]["Fn::Sub"]
            assert op["security"] == {"Fn::If": ["UseApiKey", [{"api_key": []}], [{"SigV4": []}]]}
    schemes = api["Properties"]["Body"]["components"]["securitySchemes"]
    assert schemes["SigV4"]["x-amazon-apigateway-authtype"] == "awsSigv4"
    # The name API Gateway's importer and SAM's own key auth use for the x-api-key header.
    assert schemes["api_key"] == {"type": "apiKey", "name": "x-api-key", "in": "header"}
    assert {r["Condition"] for r in resources.values() if r["Type"].startswith("AWS::ApiGateway::UsagePlan")} == {"UseApiKey"}
    permission = resources["ApiInvokePermission"]["Properties"]
    assert permission["Principal"] == "apigateway.amazonaws.com" and "${RdqApi}" in permission["SourceArn"]["Fn::Sub"]


def _statements(role: dict) -> list:
    """The inline statements of a role; a policy that exists only under a condition counts as if
    the condition held (the stricter reading: its statements are checked too)."""
    found = []
    for policy in role["Properties"].get("Policies", []):
        if "Fn::If" in policy:
            policy = policy["Fn::If"][1]
        for statement in policy["PolicyDocument"]["Statement"]:
            found.append(statement)
    return found


def _scoped(statement: dict) -> dict:
    body = statement["Fn::If"][1] if "Fn::If" in statement else statement
    assert body["Effect"] == "Allow"
    assert body["Resource"] != "*" and "*" not in json.dumps(body["Action"]), body
    assert isinstance(body["Action"], str)
    return body


#: The AWS managed policies SAM attaches: logs, X-Ray (the Tracing setting), ENIs (VpcConfig).
SAM_MANAGED = {
    "arn:aws:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole",
    "arn:aws:iam::aws:policy/AWSXrayWriteOnlyAccess",
    "arn:aws:iam::aws:policy/service-role/AWSLambdaVPCAccessExecutionRole",
}


def managed_policies(role: dict) -> list:
    """A role's managed policies: its list, or for a list joined and split again (how the roles
    leave optional ARNs out), each stack policy it names as a Ref and each fixed ARN as written."""
    arns = role["Properties"]["ManagedPolicyArns"]
    if isinstance(arns, list):
        return arns
    found: list = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if "Fn::Sub" in node:
                found.extend({"Ref": name} for name in re.findall(r"\$\{(\w+)\}", node["Fn::Sub"]))
                found.extend({"Fn::Sub": arn.lstrip(",")} for arn in re.findall(r",?arn:[^,]+", node["Fn::Sub"]))
                return
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(arns)
    return found


def test_iam_is_scoped_to_each_functions_own_needs(resources):
    # The storage URL read, which every function needs, is one managed policy attached to the three
    # roles and to nothing else; it grants the one secret and/or parameter given, each only when given.
    storage_read = resources["StorageUrlReadPolicy"]
    assert storage_read["Type"] == "AWS::IAM::ManagedPolicy"
    assert not {"Roles", "Users", "Groups"} & set(storage_read["Properties"]), "attached only through the functions' roles"
    storage_statements = storage_read["Properties"]["PolicyDocument"]["Statement"]
    assert [s["Fn::If"][0] for s in storage_statements] == ["HasSecret", "HasParameter"]
    secret, parameter = (_scoped(s) for s in storage_statements)
    assert (secret["Action"], secret["Resource"]) == ("secretsmanager:GetSecretValue", {"Ref": "StorageUrlSecretArn"})
    assert parameter["Action"] == "ssm:GetParameter"
    assert parameter["Resource"]["Fn::Sub"].endswith(":parameter${StorageUrlParameterName}")
    for name in ("ApiFunctionRole", "WorkerFunctionRole", "ReaperFunctionRole"):
        managed = managed_policies(resources[name])
        assert {"Ref": "StorageUrlReadPolicy"} in managed, name
        assert {arn for arn in managed if isinstance(arn, str)} <= SAM_MANAGED, (name, managed)
        assert len(managed) == len({json.dumps(arn) for arn in managed}), name
        for statement in _statements(resources[name]):
            _scoped(statement)
    attached = [name for name, r in resources.items()
                if r["Type"] == "AWS::IAM::Role"
                and "ManagedPolicyArns" in r["Properties"] and {"Ref": "StorageUrlReadPolicy"} in managed_policies(r)]
    assert sorted(attached) == ["ApiFunctionRole", "ReaperFunctionRole", "WorkerFunctionRole"]
    api_policies = resources["ApiFunctionRole"]["Properties"]["Policies"]
    assert [p["Fn::If"][0] for p in api_policies] == ["WakeEnabled"], "no wake-up, no invoke permission"
    assert [json.dumps(s) for s in _statements(resources["ApiFunctionRole"])] == [json.dumps(
        {"Effect": "Allow", "Action": "lambda:InvokeFunction", "Resource": {"Fn::GetAtt": ["WorkerFunction", "Arn"]}})], \
        "wake-up targets the worker only"
    assert _statements(resources["WorkerFunctionRole"]) == [{"Effect": "Allow", "Action": "lambda:InvokeFunction",
                               "Resource": {"Fn::Sub": "arn:${AWS::Partition}:lambda:${AWS::Region}:${AWS::AccountId}"
                                                       ":function:${AWS::StackName}-worker"}},
                              # the on-failure destination of schedule firings, which Lambda writes as the worker
                              {"Effect": "Allow", "Action": "sqs:SendMessage",
                               "Resource": {"Fn::GetAtt": ["FailedFiringsQueue", "Arn"]}}]
    assert _statements(resources["ReaperFunctionRole"]) == [{
        "Effect": "Allow", "Action": "events:PutEvents",
        "Resource": {"Fn::Sub": "arn:${AWS::Partition}:events:${AWS::Region}:${AWS::AccountId}:event-bus/${EventBusName}"}}], \
        "the reaper needs the storage URL, and PutEvents on the event bus when one is given"


def test_log_retention_alarms_and_outputs(resources):
    groups = of_type(resources, "AWS::Logs::LogGroup")
    # The three functions' groups, and the API's access logs when ApiAccessLogs is on.
    assert set(groups) == {"ApiLogGroup", "WorkerLogGroup", "ReaperLogGroup", "ApiAccessLogGroup"}
    assert [name for name, g in groups.items() if "Condition" in g] == ["ApiAccessLogGroup"]
    assert all(g["Properties"]["RetentionInDays"] == {"Ref": "LogRetentionDays"} for g in groups.values())
    # The all-queue alarms watch one metric each; the per-queue ones (a Metrics Insights query each)
    # are checked in test_dashboard.py.
    alarms = {a["Properties"]["MetricName"] for a in of_type(resources, "AWS::CloudWatch::Alarm").values()
              if "MetricName" in a["Properties"]}
    # (and the failed-firings queue's depth and the firings Lambda dropped: test_failed_firings_and_retention.py)
    # (the rates, the API's 5xx and the outbox age: test_production_checklist.py)
    assert alarms == {"DeadTasks", "OldestPendingAge", "ApproximateNumberOfMessagesVisible", "AsyncEventsDropped",
                      "DeadLettered", "5XXError", "OutboxUndeliveredAge"}
    outputs = transformed()["Outputs"]
    assert "execute-api" in outputs["ApiUrl"]["Value"]["Fn::Sub"]


def _python312_or_fail() -> Path:
    py312 = _python312_bin()
    if py312 is None:
        message = "python3.12 (the Lambda runtime) is not installed: not on PATH, nor in $(pyenv root)/versions"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return py312


def _sam_build(tmp_path: Path, env: dict[str, str]) -> Path:
    """``sam build`` of the real template into ``tmp_path/build``; fails with its output."""
    build_dir = tmp_path / "build"
    result = subprocess.run(
        [_tool("sam"), "build", "--template", str(REPO / "template.yaml"), "--build-dir", str(build_dir),
         "--cache-dir", str(tmp_path / "cache"), "--parallel"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return build_dir


@pytest.mark.sam_build
def test_sam_build_for_python312(tmp_path):
    py312 = _python312_or_fail()
    env = {**os.environ, "PATH": f"{py312}:{os.environ['PATH']}"}
    env.pop("RDQ_BUNDLE", None)
    build_dir = _sam_build(tmp_path, env)
    drivers = {"RdqPostgresLayer": "psycopg", "RdqRedisLayer": "redis", "RdqMongoLayer": "pymongo"}
    for function in ("ApiFunction", "WorkerFunction", "ReaperFunction"):
        assert (build_dir / function / "app.py").exists()
        assert not (build_dir / function / "rdq_core").exists(), "with layers, a function's own code is one file"
    tracing = build_dir / "RdqTracingLayer" / "python"
    assert (tracing / "aws_xray_sdk").is_dir() and not (tracing / "botocore").exists()
    for layer_name, driver in drivers.items():
        layer = build_dir / layer_name / "python"
        assert (layer / "rdq_core" / "hosts" / "aws_lambda" / "api.py").exists()
        assert not (layer / "rdq_core" / "compliance").exists(), "the compliance kit (pytest) stays out of Lambda"
        assert not (layer / "botocore").exists(), "boto3/botocore come with the runtime"
        assert (layer / driver).is_dir() and (layer / "aws_lambda_powertools").is_dir(), layer_name
        others = set(drivers.values()) - {driver}
        assert not any((layer / other).exists() for other in others), f"{layer_name} carries one driver only"
        assert not (layer / "aws_xray_sdk").exists(), "the X-Ray SDK lives in the tracing layer"
        size = sum(f.stat().st_size for f in layer.rglob("*") if f.is_file())
        # A packaging guard only; the measured sizes are reported by bench/ (target 15 MB).
        assert size < 20 * 1000 * 1000, f"{layer_name} unpacked size {size} bytes"
        # The built package imports on python3.12 (the runtime's boto3 stands in from the host when present).
        check = subprocess.run(
            [str(py312 / "python3.12"), "-c", f"import rdq_core.hosts.aws_lambda.settings, rdq_core.examples, {driver}"],
            capture_output=True, text=True, env={**env, "PYTHONPATH": str(layer)}, timeout=60,
        )
        assert check.returncode == 0, check.stderr


def test_sam_local_invoke_env_vars_reach_every_function():
    """`sam local invoke --env-vars events/env.json` overrides only the variables the template
    declares: resolved by SAM's own code, each function gets every value env.json sets for it,
    and the store it names is a server every invocation's container can share."""
    local_lambda = pytest.importorskip("samcli.commands.local.lib.local_lambda")
    from samcli.lib.providers.sam_function_provider import SamFunctionProvider
    from samcli.lib.providers.sam_stack_provider import SamLocalStackProvider

    env_file = json.loads((REPO / "events" / "env.json").read_text())
    stacks, _ = SamLocalStackProvider.get_stacks(str(REPO / "template.yaml"))
    provider = SamFunctionProvider(stacks)
    runner = local_lambda.LocalLambdaRunner(local_runtime=None, function_provider=provider, cwd=str(REPO),
                                            real_path=str(REPO), aws_region="us-east-1", env_vars_values=env_file)
    url = env_file["Parameters"]["RDQ_STORAGE_URL"]
    assert url.split(":", 1)[0] in {"postgresql", "redis", "mongodb"}, "each invocation is a new container: no SQLite file"
    for name in ("ApiFunction", "WorkerFunction", "ReaperFunction"):
        function = provider.get(name)
        assert function is not None, name
        resolved = runner._make_env_vars(function).resolve()
        wanted = {**env_file["Parameters"], **env_file.get(name, {})}
        assert {key: resolved.get(key) for key in wanted} == wanted, name


@pytest.mark.sam_build
def test_sam_build_bundled_puts_the_engine_into_each_function(tmp_path):
    """RDQ_BUNDLE=<backend> (deployed with Packaging=bundled): every function's own package carries
    rdq_core, Powertools and that one driver, and imports on the runtime's Python; the layers are
    left empty (nothing attaches them)."""
    py312 = _python312_or_fail()
    env = {**os.environ, "PATH": f"{py312}:{os.environ['PATH']}", "RDQ_BUNDLE": "redis"}
    env.pop("RDQ_BUNDLE_PYTHON", None)
    build_dir = _sam_build(tmp_path, env)
    for function in ("ApiFunction", "WorkerFunction", "ReaperFunction"):
        package = build_dir / function
        assert (package / "app.py").exists() and (package / "rdq_core" / "hosts" / "aws_lambda" / "worker.py").exists(), function
        assert (package / "redis").is_dir() and (package / "aws_lambda_powertools").is_dir(), function
        assert not (package / "psycopg").exists() and not (package / "pymongo").exists(), "one driver only"
        assert not (package / "botocore").exists() and not (package / "rdq_core" / "compliance").exists()
        # (Powertools itself needs the runtime's jmespath, which no package ships.)
        imports = "import rdq_core.hosts.aws_lambda.settings, rdq_core.examples, redis"
        check = subprocess.run([str(py312 / "python3.12"), "-c", imports], capture_output=True, text=True, cwd=package,
                               env={**env, "PYTHONPATH": str(package)}, timeout=60)
        assert check.returncode == 0, check.stderr
    for layer in ("RdqPostgresLayer", "RdqRedisLayer", "RdqMongoLayer", "RdqTracingLayer"):
        assert not (build_dir / layer / "python" / "rdq_core").exists(), layer


def test_the_declared_storage_url_is_empty_so_deployments_read_it_by_reference(resources):
    # Declared only so that `sam local invoke --env-vars` may set it; a deployed stack never
    # carries a URL (with its password) by value: it is empty and no parameter feeds it.
    for name in ("ApiFunction", "WorkerFunction", "ReaperFunction"):
        variables = resources[name]["Properties"]["Environment"]["Variables"]
        assert variables["RDQ_STORAGE_URL"] == "" and variables["RDQ_AUTO_MIGRATE"] == "false", name
    assert "RDQ_STORAGE_URL\"" not in json.dumps(transformed()["Parameters"])
