"""The LocalStack end-to-end suite's fixtures (marker ``localstack``; not in the default run).

One LocalStack 2.3.2 in host mode for the session (``localstack_host.py``), and per backend one
stack of the real ``template.yaml``: ``sam build`` with the bundled packaging for LocalStack's
Python 3.11, the built functions zipped into LocalStack's S3, the SAM transform applied, the
stack created through LocalStack's CloudFormation API, the storage URL in its SSM. Every wait
polls a condition against a deadline.

Known differences of the legacy executor from AWS, and what is done about them here:
* it does not set ``AWS_ENDPOINT_URL`` in the functions: the harness adds it to each function's
  environment after the stack is created (the API's wake-up, the SSM read need it);
* it drops the modules a handler imported and its context always answers 60000 ms: rdq copes
  itself (``rdq_core/hosts/aws_lambda/invocation.py``).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from .localstack_host import LocalStackProcess, ensure_venv

REPO = Path(__file__).resolve().parents[2]
BUCKET = "rdq-e2e-artifacts"
REGION = "us-east-1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Out of the default run: selected only by naming the marker (``-m localstack``)."""
    if "localstack" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("localstack") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


def wait_for(what: str, probe: Callable[[], Any], timeout: float, every: float = 0.5,
             explain: Callable[[], str] | None = None) -> Any:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` at the deadline, and
    with what ``explain`` then says of the state (where a bare timeout would leave the cause unknown)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() >= deadline:
            state = f"\n{explain()}" if explain is not None else ""
            pytest.fail(f"timed out after {timeout:g}s waiting for {what} (last: {last!r}){state}")
        time.sleep(every)


@pytest.fixture(scope="session")
def localstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStackProcess]:
    venv = ensure_venv(lambda line: print(line, file=sys.stderr))
    process = LocalStackProcess(tmp_path_factory.mktemp("localstack"))
    process.start(venv)
    try:
        yield process
    finally:
        process.stop()


def aws(localstack: LocalStackProcess, service: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(service, endpoint_url=localstack.endpoint, region_name=REGION, aws_access_key_id="test",
                        aws_secret_access_key="test", config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}))


def sam_build(build_dir: Path, backend: str) -> Path:
    """``sam build`` of the real template, each function bundled for LocalStack's Python 3.11."""
    env = {**os.environ, "RDQ_BUNDLE": backend, "RDQ_BUNDLE_PYTHON": "3.11", "SAM_CLI_TELEMETRY": "0"}
    sam = shutil.which("sam") or str(Path(sys.executable).with_name("sam"))
    result = subprocess.run([sam, "build", "--template", str(REPO / "template.yaml"), "--build-dir", str(build_dir),
                             "--cache-dir", str(build_dir.parent / f"{build_dir.name}-cache"), "--parallel"],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return build_dir


def _zip(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                archive.write(path, path.relative_to(folder).as_posix())
    return buffer.getvalue()


def packaged_template(localstack: LocalStackProcess, build_dir: Path, prefix: str, parameters: dict[str, str]) -> dict:
    """What ``sam deploy`` sends: code uploaded to S3, then the SAM transform (done here, as
    tests/serverless/test_template.py does, so LocalStack receives plain CloudFormation)."""
    from samtranslator.translator.transform import transform
    from samtranslator.yaml_helper import yaml_parse

    s3 = aws(localstack, "s3")
    template = yaml_parse((build_dir / "template.yaml").read_text())
    for name, resource in template["Resources"].items():
        props = resource.get("Properties", {})
        for key in ("CodeUri", "ContentUri"):
            if key in props:
                s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}.zip", Body=_zip(build_dir / props[key]))
                props[key] = f"s3://{BUCKET}/{prefix}/{name}.zip"

    class ManagedPolicies:
        def load(self) -> dict[str, str]:
            return {"AWSLambdaVPCAccessExecutionRole": "arn:aws:iam::aws:policy/service-role/AWSLambdaVPCAccessExecutionRole"}

    return transform(template, parameters, ManagedPolicies())


@dataclass
class Stack:
    backend: str
    name: str
    store_url: str
    api_base: str
    api_key: str
    worker: str
    reaper: str
    localstack: LocalStackProcess

    def lambda_client(self) -> Any:
        return aws(self.localstack, "lambda")

    def invoke(self, function: str, event_file: str) -> dict[str, Any]:
        payload = (REPO / "events" / event_file).read_bytes()
        reply = self.lambda_client().invoke(FunctionName=function, InvocationType="RequestResponse", Payload=payload)
        body = reply["Payload"].read().decode()
        assert "FunctionError" not in reply, body
        return json.loads(body) if body else {}


def deploy(localstack: LocalStackProcess, backend: str, store_url: str, build_dir: Path, *, name: str | None = None,
           extra_parameters: dict[str, str] | None = None) -> Stack:
    """The stack ``name`` (by default one per backend) from the built template; ``extra_parameters``
    are added to (or override) the suite's parameter values."""
    name = name or {"postgresql": "rdq-pg", "redis": "rdq-redis"}[backend]
    ssm = aws(localstack, "ssm")
    s3 = aws(localstack, "s3")
    try:
        s3.create_bucket(Bucket=BUCKET)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    parameter = f"/{name}/storage-url"
    ssm.put_parameter(Name=parameter, Type="SecureString", Value=store_url, Overwrite=True)
    # WorkerTimeout: the template's default; the example ``sleep`` handler (a 26 s timeout) can start
    # only while that much is left before an invocation's work deadline, which 30 s would leave ~1 s.
    parameters = {"Packaging": "bundled", "StorageBackend": backend, "StorageUrlParameterName": parameter,
                  "AuthMode": "API_KEY", "MaxWorkerConcurrency": "2", "WorkerTimeout": "60", **(extra_parameters or {})}
    body = packaged_template(localstack, build_dir, name, parameters)
    # From S3, as `sam deploy --resolve-s3` does: a TemplateBody may not exceed 51,200 bytes.
    s3.put_object(Bucket=BUCKET, Key=f"{name}/template.json", Body=json.dumps(body).encode())
    stack = create_stack(localstack, name, f"https://{BUCKET}.s3.amazonaws.com/{name}/template.json", parameters,
                         ["CAPABILITY_IAM"], timeout=300)
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
    resources = stack_resources(localstack, name)
    point_functions_at_localstack(localstack, resources)
    apigateway = aws(localstack, "apigateway")
    _spell_out_any_method(apigateway, outputs["ApiId"])
    key = apigateway.get_api_key(apiKey=outputs["ApiKeyId"], includeValue=True)["value"]
    return Stack(backend=backend, name=name, store_url=store_url,
                 api_base=f"{localstack.endpoint}/restapis/{outputs['ApiId']}/prod/_user_request_",
                 api_key=key, worker=resources["WorkerFunction"], reaper=resources["ReaperFunction"], localstack=localstack)


def create_stack(localstack: Any, name: str, template_url: str, parameters: dict[str, str], capabilities: list[str],
                 *, timeout: float) -> dict[str, Any]:
    """Create ``name`` from ``template_url`` and wait until it settles; the stack, or the test
    fails with the failed resources' reasons and LocalStack's log."""
    cfn = aws(localstack, "cloudformation")
    cfn.create_stack(StackName=name, TemplateURL=template_url, Capabilities=capabilities,
                     Parameters=[{"ParameterKey": k, "ParameterValue": v} for k, v in parameters.items()])

    def settled() -> dict[str, Any] | None:
        stack: dict[str, Any] = cfn.describe_stacks(StackName=name)["Stacks"][0]
        return stack if not stack["StackStatus"].endswith("IN_PROGRESS") else None

    stack = wait_for(f"stack {name}", settled, timeout, every=1.0)
    if stack["StackStatus"] != "CREATE_COMPLETE":
        events = cfn.describe_stack_events(StackName=name)["StackEvents"]
        reasons = [(e["LogicalResourceId"], e.get("ResourceStatusReason")) for e in events if "FAILED" in e["ResourceStatus"]]
        pytest.fail(f"{name}: {stack['StackStatus']}: {reasons}\n{localstack.tail(4000)}")
    return stack


def stack_resources(localstack: Any, name: str) -> dict[str, str]:
    """A stack's resources: logical id -> physical id."""
    return {r["LogicalResourceId"]: r.get("PhysicalResourceId")
            for r in aws(localstack, "cloudformation").describe_stack_resources(StackName=name)["StackResources"]}


def point_functions_at_localstack(localstack: Any, resources: dict[str, str]) -> None:
    """The legacy executor does not give functions an AWS endpoint (on AWS none is needed): set it
    on rdq's three functions."""
    lam = aws(localstack, "lambda")
    for logical in ("ApiFunction", "WorkerFunction", "ReaperFunction"):
        function = resources[logical]
        variables = lam.get_function_configuration(FunctionName=function)["Environment"]["Variables"]
        lam.update_function_configuration(FunctionName=function, Environment={
            "Variables": {**variables, "AWS_ENDPOINT_URL": localstack.endpoint}})


def _spell_out_any_method(apigateway: Any, api_id: str) -> None:
    """LocalStack 2.3.2 checks ``apiKeyRequired`` on the request's own method only, so an ``ANY``
    method's key requirement is never enforced (AWS enforces it). The same method, spelled out
    for each verb the routes use, makes LocalStack enforce the key the template asks for."""
    for resource in apigateway.get_resources(restApiId=api_id)["items"]:
        if "ANY" not in resource.get("resourceMethods", {}):
            continue
        method = apigateway.get_method(restApiId=api_id, resourceId=resource["id"], httpMethod="ANY")
        integration = method["methodIntegration"]
        assert method["apiKeyRequired"] is True, method
        for verb in ("GET", "POST", "DELETE"):
            apigateway.put_method(restApiId=api_id, resourceId=resource["id"], httpMethod=verb,
                                  authorizationType=method["authorizationType"], apiKeyRequired=True,
                                  requestParameters=method.get("requestParameters", {}))
            apigateway.put_integration(restApiId=api_id, resourceId=resource["id"], httpMethod=verb,
                                       type=integration["type"], integrationHttpMethod=integration["httpMethod"],
                                       uri=integration["uri"])
    apigateway.create_deployment(restApiId=api_id, stageName="prod")
