"""The per-queue IAM policies of docs/security.md ("Per-queue access with IAM"), evaluated as IAM
evaluates ``execute-api:Invoke`` on method ARNs, against every route of the route table and the
deployed API's shape in the transformed template. A renamed or added route changes what a
policy's ARNs match: the test then fails instead of a policy silently allowing more (or nothing)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from rdq_core.hosts.aws_lambda.routes import ROUTES, Route

from .conftest import REPO
from .test_template import transformed

SECURITY = REPO / "docs" / "security.md"
API_ARN = "arn:aws:execute-api:eu-west-1:111122223333:a1b2c3d4e5"
STAGE = "prod"
QUEUE, OTHER_QUEUE = "emails", "reports"
#: A value for each path parameter of the table (the queue is given per request).
SAMPLES = {"task_id": "t-1", "operation_id": "01JOP", "schedule": "nightly"}

GETS = {route.operation_id for route in ROUTES if route.method == "GET"}
#: What each documented role may call, by operation id (and, for the producer, on its queue only).
EXPECTED = {
    "producer": {"enqueueTask", "enqueueBatch", "createPayloadUpload"},
    "read-only-operator": GETS,
    "operator": GETS | {"redriveDead", "cancelSelected", "pauseQueue", "resumeQueue", "cancelTask", "cancelOperation"},
    "full-operator": {route.operation_id for route in ROUTES},
}


def documented_policies() -> dict[str, dict[str, Any]]:
    """Each ``<!-- iam-policy: NAME -->`` of docs/security.md with the JSON block after it."""
    text = SECURITY.read_text()
    found = re.findall(r"<!-- iam-policy: ([\w-]+) -->\s*```json\n(.*?)```", text, re.S)
    return {name: json.loads(body) for name, body in found}


def _pattern(arn: str) -> re.Pattern[str]:
    """An IAM resource pattern: ``*`` any characters (``/`` included), ``?`` one."""
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in arn))


def _as_list(value: Any) -> list[str]:
    return value if isinstance(value, list) else [value]


def _allows(policy: dict[str, Any], method_arn: str) -> bool:
    """IAM's answer for one request: an explicit Deny wins, else an Allow is needed."""
    matching = [s["Effect"] for s in policy["Statement"]
                if "execute-api:Invoke" in _as_list(s["Action"])
                and any(_pattern(resource).fullmatch(method_arn) for resource in _as_list(s["Resource"]))]
    return "Allow" in matching and "Deny" not in matching


def _requests(route: Route) -> list[tuple[str, str]]:
    """(queue or None, method ARN) of a request to ``route`` on each sample queue."""
    queues = [QUEUE, OTHER_QUEUE] if "queue" in route.path_parameters else [""]
    requests = []
    for queue in queues:
        values = {**SAMPLES, "queue": queue}
        path = re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], route.path)  # noqa: B023 - used at once
        requests.append((queue, f"{API_ARN}/{STAGE}/{route.method}{path}"))
    return requests


def test_the_four_roles_are_documented():
    assert set(documented_policies()) == set(EXPECTED)


@pytest.mark.parametrize("role", list(EXPECTED))
def test_each_documented_policy_allows_exactly_its_roles_routes(role):
    policy = documented_policies()[role]
    allowed: set[str] = set()
    for route in ROUTES:
        assert set(route.path_parameters) <= {"queue", *SAMPLES}, f"a new path parameter: give it a sample ({route.path})"
        for queue, arn in _requests(route):
            if _allows(policy, arn):
                allowed.add(route.operation_id)
                if role == "producer":
                    assert queue == QUEUE, f"the producer of {QUEUE} may call {arn}"
    assert allowed == EXPECTED[role], (sorted(allowed - EXPECTED[role]), sorted(EXPECTED[role] - allowed))
    assert "purgeDead" not in allowed or role == "full-operator"


@pytest.mark.parametrize("role", list(EXPECTED))
def test_every_documented_resource_names_a_route(role):
    # A resource that matches no route is a policy for a path that was renamed: dead today, and
    # whatever takes that path later would inherit it.
    every_request = [arn for route in ROUTES for _, arn in _requests(route)]
    for statement in documented_policies()[role]["Statement"]:
        assert _as_list(statement["Action"]) == ["execute-api:Invoke"]
        for resource in _as_list(statement["Resource"]):
            assert resource.startswith(f"{API_ARN}/{STAGE}/"), resource
            assert any(_pattern(resource).fullmatch(arn) for arn in every_request), f"{resource} matches no route"


def test_method_arns_carry_the_real_path_because_every_path_reaches_the_function_as_is():
    """What the policies rely on in the deployed API: one stage named prod, SigV4 on one greedy
    proxy resource for every method, and no other path (a declared path would have its own ARN)."""
    template = transformed()
    resources = template["Resources"]
    (stage,) = [r for r in resources.values() if r["Type"] == "AWS::ApiGateway::Stage"]
    assert stage["Properties"]["StageName"] == STAGE
    body = resources["RdqApi"]["Properties"]["Body"]
    assert set(body["paths"]) == {"/{proxy+}"}
    (method,) = body["paths"]["/{proxy+}"].values()
    assert method["x-amazon-apigateway-integration"]["type"] == "aws_proxy"
    assert method["security"] == {"Fn::If": ["UseApiKey", [{"api_key": []}], [{"SigV4": []}]]}
    assert template["Parameters"]["AuthMode"]["Default"] == "AWS_IAM", "IAM policies apply to SigV4 callers"
    # The Lambda permission lets the API invoke the function for any stage, method and path.
    source = resources["ApiInvokePermission"]["Properties"]["SourceArn"]["Fn::Sub"]
    assert source.endswith("${RdqApi}/*/*/*")
