"""Access control: nothing is reachable anonymously.

* The deployed API, on the template as CloudFormation receives it (after the SAM transform): in
  both auth modes every method of every path requires SigV4 (``AWS_IAM``, the default) or an API
  key (``API_KEY``), and every route of the route table — the task routes, the operator routes
  (DLQ list, redrive, purge, cancel), ``/v1/openapi.json`` — and any other path reaches the
  function only through such a method. The template has no anonymous option.
* ``rdq dev``: binds 127.0.0.1 by default, refuses a non-loopback bind without a token, and with
  ``RDQ_API_TOKEN`` answers 401 problem+json on every route (openapi.json included) to a request
  without the token or with a wrong one.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from .conftest import PROBLEM_JSON, REPO, TOKEN, assert_problem

pytest.importorskip("samtranslator")

HTTP_METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "x-amazon-apigateway-any-method"}
#: The template's (path, method) pairs: one proxy method takes every route of the route table.
TEMPLATE_METHODS = {("/{proxy+}", "x-amazon-apigateway-any-method")}


def _template_path_matches(template_path: str, path: str) -> bool:
    """Whether API Gateway would route ``path`` to the resource ``template_path``."""
    regex = "".join(".+" if part.endswith("+}") else "[^/]+" if part.startswith("{") else re.escape(part)
                    for part in re.split(r"(\{\w+\+?\})", template_path))
    return re.fullmatch(regex, path) is not None


def _template_method_matches(method: str, http_method: str) -> bool:
    return method == "x-amazon-apigateway-any-method" or method == http_method.lower()


def _resolve(node, conditions: dict[str, bool]):
    """Evaluate ``Fn::If`` the way CloudFormation will for the given condition values."""
    if isinstance(node, dict):
        if set(node) == {"Fn::If"} and node["Fn::If"][0] in conditions:
            name, if_true, if_false = node["Fn::If"]
            return _resolve(if_true if conditions[name] else if_false, conditions)
        return {k: _resolve(v, conditions) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, conditions) for v in node]
    return node


@pytest.fixture(scope="module", params=["AWS_IAM", "API_KEY"])
def deployed(request):
    from tests.serverless.test_template import transformed

    parameters = {} if request.param == "AWS_IAM" else {"AuthMode": "API_KEY"}
    template = transformed(parameters)
    return request.param, template, _resolve(template["Resources"], {"UseApiKey": request.param == "API_KEY"})


def test_auth_modes_offered_are_iam_by_default_and_api_key_and_nothing_anonymous():
    from tests.serverless.test_template import transformed

    auth = transformed()["Parameters"]["AuthMode"]
    assert auth["Default"] == "AWS_IAM"
    assert sorted(auth["AllowedValues"]) == ["API_KEY", "AWS_IAM"], "no NONE/anonymous mode"


def test_every_method_of_every_path_requires_auth(deployed):
    mode, _, resources = deployed
    apis = {name: r for name, r in resources.items() if r["Type"] == "AWS::ApiGateway::RestApi"}
    assert list(apis) == ["RdqApi"], "exactly one REST API"
    body = apis["RdqApi"]["Properties"]["Body"]
    schemes = body["components"]["securitySchemes"]
    assert "security" not in body or body["security"], "no empty top-level security override"
    seen = set()
    for path, item in body["paths"].items():
        for method, operation in item.items():
            if method not in HTTP_METHODS:
                continue
            seen.add((path, method))
            security = operation.get("security")
            assert security and all(requirement for requirement in security), (mode, path, method, security)
            for requirement in security:
                for scheme_name in requirement:
                    scheme = schemes[scheme_name]
                    if mode == "AWS_IAM":
                        # API Gateway imports this as AuthorizationType AWS_IAM on the method.
                        assert scheme.get("x-amazon-apigateway-authtype") == "awsSigv4", (path, method, scheme)
                    else:
                        # ... and this as ApiKeyRequired: true on the method.
                        assert (scheme["type"], scheme["in"], scheme["name"].lower()) == ("apiKey", "header", "x-api-key")
                        assert body["x-amazon-apigateway-api-key-source"] == "HEADER"
            assert operation["x-amazon-apigateway-integration"]["type"] == "aws_proxy"
    assert seen == TEMPLATE_METHODS, "a method was added or removed in the template: extend this test"
    # Every route of the table (and any unknown path, which the function answers 404) reaches the
    # function only through one of the authenticated methods checked above.
    from rdq_core.hosts.aws_lambda.routes import ROUTES

    samples = [(route.method, re.sub(r"\{\w+\}", "x", route.path)) for route in ROUTES] + [("PUT", "/no/such/route")]
    assert len(samples) == len(ROUTES) + 1 >= 10
    for http_method, path in samples:
        assert any(_template_path_matches(p, path) and _template_method_matches(m, http_method) for p, m in seen), (
            http_method, path)
    # No method defined outside the OpenAPI body (where it could carry AuthorizationType NONE).
    methods = [r for r in resources.values() if r["Type"] == "AWS::ApiGateway::Method"]
    assert all(m["Properties"].get("AuthorizationType") not in (None, "NONE") or m["Properties"].get("ApiKeyRequired")
               for m in methods), methods


def test_no_other_way_in(deployed):
    mode, template, resources = deployed
    kinds = {r["Type"] for r in resources.values()}
    # No function URL, no HTTP API, no second REST API that could expose the function.
    assert not kinds & {"AWS::Lambda::Url", "AWS::ApiGatewayV2::Api", "AWS::ApiGatewayV2::Route"}
    permissions = [r["Properties"] for r in resources.values() if r["Type"] == "AWS::Lambda::Permission"]
    for permission in permissions:
        if permission["FunctionName"] == {"Ref": "ApiFunction"}:
            assert permission["Principal"] == "apigateway.amazonaws.com"
            assert "${RdqApi}" in permission["SourceArn"]["Fn::Sub"], "only this API may invoke the function"
    usage = {name for name, r in resources.items()
             if r["Type"].startswith("AWS::ApiGateway::UsagePlan") or r["Type"] == "AWS::ApiGateway::ApiKey"}
    if mode == "API_KEY":
        assert usage == {"ApiKey", "UsagePlan", "UsagePlanKey"}
        assert resources["UsagePlan"]["Properties"]["Throttle"]["RateLimit"] > 0
    env = resources["ApiFunction"]["Properties"]["Environment"]["Variables"]
    assert env["RDQ_AUTH_MODE"] == ("api_key" if mode == "API_KEY" else "iam")
    # Secrets reach the functions by reference (ARN / parameter name), never by value.
    for name in ("ApiFunction", "WorkerFunction", "ReaperFunction"):
        variables = resources[name]["Properties"]["Environment"]["Variables"]
        # Declared empty only so `sam local invoke --env-vars` can set it locally; deployed, it
        # never carries a value (nor a reference to a parameter that would).
        assert variables.get("RDQ_STORAGE_URL", "") == "", \
            "the storage URL (with its password) must come from Secrets Manager/SSM"
        assert "RDQ_API_TOKEN" not in variables
    assert "RDQ_STORAGE_URL" not in json.dumps(template["Parameters"])


# -- rdq dev ------------------------------------------------------------------------------------
ALL_ROUTES = [
    ("POST", "/v1/queues/q/tasks", {"handler": "greet"}), ("POST", "/v1/queues/q/tasks:batch", {"tasks": [{"handler": "greet"}]}),
    ("GET", "/v1/tasks/some-id", None), ("DELETE", "/v1/tasks/some-id", None), ("GET", "/v1/queues/q/stats", None),
    ("GET", "/v1/queues", None), ("GET", "/v1/queues/q/metrics", None), ("GET", "/v1/metrics", None),
    ("GET", "/v1/queues/q/dlq", None), ("POST", "/v1/queues/q/dlq:redrive", {"all": True}),
    ("POST", "/v1/queues/q/dlq:purge", {"all": True}), ("GET", "/v1/openapi.json", None),
    ("GET", "/v1/queues/q/tasks", None), ("POST", "/v1/queues/q/tasks:cancel", {"all": True}),
    ("POST", "/v1/queues/q:pause", {}), ("POST", "/v1/queues/q:resume", {}), ("GET", "/v1/audit", None),
    ("GET", "/v1/operations", None), ("GET", "/v1/operations/OP1", None), ("POST", "/v1/operations/OP1:cancel", {}),
    ("POST", "/v1/schedules", {"name": "s", "expression": "rate(5 minutes)", "queue": "q", "handler": "greet"}),
    ("GET", "/v1/schedules", None), ("DELETE", "/v1/schedules/s", None),
    ("POST", "/v1/queues/q/payloads", {"size": 1, "sha256": "0" * 64}), ("GET", "/v1/tasks/some-id/objects", None),
    ("GET", "/no/such/route", None), ("PUT", "/v1/openapi.json", None),
]


def test_rdq_dev_token_is_required_on_every_route(dev_server):
    wrong = [False, "", "x", TOKEN + "x", TOKEN[:-1], TOKEN.upper(), f"{TOKEN} {TOKEN}"]
    from rdq_core.hosts.aws_lambda.routes import ROUTES

    untried = [r.operation_id for r in ROUTES if not any(m == r.method and r.pattern.match(p) for m, p, _ in ALL_ROUTES)]
    assert not untried, f"routes of the table missing from ALL_ROUTES: {untried}"
    for method, path, body in ALL_ROUTES:
        for token in wrong:
            status, headers, raw = dev_server.request(method, path, body, token=token)
            problem = assert_problem(status, headers, raw, 401)
            assert headers.get("WWW-Authenticate", "").startswith("Bearer"), headers
            assert TOKEN not in raw.decode()
        # Other schemes carrying the right token are not the bearer scheme.
        for header in (f"Basic {TOKEN}", TOKEN, f"Token {TOKEN}", f"Bearer{TOKEN}"):
            status, headers, raw = dev_server.request(method, path, body, token=None, headers={"Authorization": header})
            assert_problem(status, headers, raw, 401)
        assert problem["detail"]
    # With the token the routes answer (not 401): the test is not vacuous.
    status, headers, raw = dev_server.request("GET", "/v1/openapi.json")
    assert status == 200 and json.loads(raw)["openapi"].startswith("3.")
    assert dev_server.request("GET", "/v1/queues/q/stats")[0] == 200
    # The token never shows up in what rdq dev prints.
    assert TOKEN not in dev_server.output()


def _listening_addresses(port: int) -> set[str]:
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if int(port_hex, 16) == port and fields[3] == "0A":  # LISTEN
                found.add(address)
    return found


def test_rdq_dev_binds_loopback_by_default(dev_server_factory):
    server = dev_server_factory(token=None)
    assert _listening_addresses(server.port) == {"0100007F"}, "127.0.0.1 only"
    assert f"API on http://127.0.0.1:{server.port}" in server.output()
    # Without a token configured, the dev API is open — but only to this machine.
    assert server.request("GET", "/v1/queues/q/stats", token=None)[0] == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10"])
def test_rdq_dev_refuses_a_non_loopback_bind_without_a_token(tmp_path, host):
    env = {k: v for k, v in __import__("os").environ.items() if k != "RDQ_API_TOKEN"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [sys.executable, "-m", "rdq_core.hosts.cli", "--storage", f"sqlite:///{tmp_path}/x.db",
         "dev", "--host", host, "--port", "0"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "refusing to serve the dev API" in result.stdout + result.stderr
    assert PROBLEM_JSON  # (imported for symmetry with the other modules)
