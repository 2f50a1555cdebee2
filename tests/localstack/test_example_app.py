"""examples/sam-app deployed into LocalStack: an application with its own template and handler
package, rdq nested in it as a packaged application, its handlers run by rdq's worker.

What is real: rdq built (bundled for LocalStack's Python 3.11, ``Packaging=bundled``) and packaged
by ``sam package`` into LocalStack's S3, as the README's step 1 does; the example built by
``sam build`` in a copy of its folder (its layer; rdq's packaged template as the nested
application) and packaged by ``sam package``; LocalStack's CloudFormation applying the SAM
transform of both templates and creating rdq as a nested stack (``AWS::CloudFormation::Stack``
from its S3) with what the example passes: ``HandlerModules``, ``HandlerLayerArns``,
``WorkerPolicyArns``; tasks enqueued through the nested stack's API Gateway, run by its worker.

What LocalStack 2.3.2 cannot do, and what stands in for it here: layers. ``PublishLayerVersion``
answers 404 (an ``AWS::Lambda::LayerVersion`` fails to create) and a function's ``Layers`` are
never applied. So before packaging, the example's layer resource is taken out of its built
template and a layer ARN of the same name stands in for its ``Ref``; and the harness does what
Lambda does with the layer: the built layer's ``python/`` folder goes on the worker's ``sys.path``
(into the worker's package: the local executor has no ``/opt``). As in conftest.py, the functions
are given ``AWS_ENDPOINT_URL`` and the API's ``ANY`` method is spelled out per verb.

Run: ``python -m pytest -m localstack tests/localstack/test_example_app.py``."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from rdq_core import open_storage
from rdq_testing import servers

from .conftest import (
    BUCKET, REGION, REPO, Stack, _spell_out_any_method, aws, create_stack, point_functions_at_localstack, sam_build,
    stack_resources, wait_for,
)
from .test_e2e import call, enqueue, task_in

pytestmark = [pytest.mark.localstack, pytest.mark.timeout(1500)]

EXAMPLE = REPO / "examples" / "sam-app"
NAME = "orders-app"
PREFIX = "example-app"


def _python312_path() -> str:
    """PATH with a python3.12 first: the example's layer is built by SAM's python3.12 workflow."""
    from tests.serverless.test_template import _python312_bin

    found = _python312_bin()
    if found is None:
        pytest.skip("python3.12 is needed to build the example's layer (not on PATH, nor in pyenv)")
    return f"{found}:{os.environ['PATH']}"


def _sam(args: list[str], cwd: Path, env: dict[str, str]) -> None:
    sam = shutil.which("sam") or str(Path(sys.executable).with_name("sam"))
    result = subprocess.run([sam, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _s3_key(uri: str) -> str:
    assert uri.startswith(f"s3://{BUCKET}/"), uri
    return uri[len(f"s3://{BUCKET}/"):]


def _with_layer(package: bytes, layer_python: Path) -> bytes:
    """The worker's package with the layer's python/ folder at its root: where the local executor
    looks for modules, as Lambda's runtime looks in /opt/python."""
    merged = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(package)) as source, zipfile.ZipFile(merged, "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            target.writestr(item, source.read(item.filename))
        for path in sorted(layer_python.rglob("*")):
            if path.is_file():
                target.write(path, path.relative_to(layer_python).as_posix())
    return merged.getvalue()


def _replace_refs(node: Any, name: str, value: str) -> Any:
    if isinstance(node, dict):
        if node == {"Ref": name}:
            return value
        return {key: _replace_refs(item, name, value) for key, item in node.items()}
    if isinstance(node, list):
        return [_replace_refs(item, name, value) for item in node]
    return node


@dataclass
class Deployed:
    stack: Stack  # the nested rdq stack
    parent_outputs: dict[str, str]  # the example's outputs, and its policy's ARN
    nested: str  # the nested stack's id
    layer_arn: str  # what stands in for the example's layer


def _packaged_app(localstack: Any, work: Path) -> tuple[Path, str]:
    """The README's steps with LocalStack's S3 as the bucket: rdq built and packaged, the
    application built and packaged. Returns the application's packaged template and the layer ARN
    that stands in for its layer."""
    s3 = aws(localstack, "s3")
    try:
        s3.create_bucket(Bucket=BUCKET)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    env = {**os.environ, "SAM_CLI_TELEMETRY": "0", "AWS_ENDPOINT_URL": localstack.endpoint, "AWS_DEFAULT_REGION": REGION,
           "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "PATH": _python312_path()}

    # Step 1: rdq built and packaged; step 2: the application built in (a copy of) its folder.
    rdq_build = sam_build(work / "rdq-build", "postgresql")
    app = work / "app"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns(".aws-sam", "rdq.packaged.yaml", "__pycache__"))
    _sam(["package", "--template-file", str(rdq_build / "template.yaml"), "--s3-bucket", BUCKET, "--s3-prefix",
          f"{PREFIX}/rdq", "--output-template-file", str(app / "rdq.packaged.yaml")], app, env)
    _sam(["build", "--build-dir", str(app / "build")], app, env)
    built = app / "build"
    layer_python = built / "OrdersHandlers" / "python"
    assert (layer_python / "orders" / "handlers.py").is_file()

    from samtranslator.yaml_helper import yaml_parse

    # Lambda's part, played here (LocalStack applies no layer): the built layer's python/ folder in
    # the package of the worker of the nested template as sam build copied it (rdq's packaged one).
    nested_path = built / "Queue" / "template.yaml"
    nested = yaml_parse(nested_path.read_text())
    worker = nested["Resources"]["WorkerFunction"]["Properties"]
    package = s3.get_object(Bucket=BUCKET, Key=_s3_key(worker["CodeUri"]))["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/worker-with-layer.zip", Body=_with_layer(package, layer_python))
    worker["CodeUri"] = f"s3://{BUCKET}/{PREFIX}/worker-with-layer.zip"
    nested_path.write_text(json.dumps(nested))
    # LocalStack cannot create the layer version: an ARN of the same name stands in for its Ref.
    parent_path = built / "template.yaml"
    parent = yaml_parse(parent_path.read_text())
    del parent["Resources"]["OrdersHandlers"]
    layer_arn = f"arn:aws:lambda:{REGION}:000000000000:layer:{NAME}-orders-handlers:1"
    parent_path.write_text(json.dumps(_replace_refs(parent, "OrdersHandlers", layer_arn)))
    # What `sam deploy` does: package (the nested template goes to S3), then CloudFormation, which
    # applies the SAM transform of both templates itself.
    _sam(["package", "--template-file", str(parent_path), "--s3-bucket", BUCKET, "--s3-prefix", f"{PREFIX}/app",
          "--output-template-file", str(app / "packaged.yaml")], app, env)
    return app / "packaged.yaml", layer_arn


def _deploy(localstack: Any, store_url: str, work: Path) -> Deployed:
    packaged, layer_arn = _packaged_app(localstack, work)
    s3, cfn = aws(localstack, "s3"), aws(localstack, "cloudformation")
    parameter = f"/{NAME}/storage-url"
    aws(localstack, "ssm").put_parameter(Name=parameter, Type="SecureString", Value=store_url, Overwrite=True)
    parameters = {"StorageBackend": "postgresql", "StorageUrlParameterName": parameter, "Packaging": "bundled",
                  "AuthMode": "API_KEY"}
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/app.yaml", Body=packaged.read_bytes())
    stack = create_stack(localstack, NAME, f"https://{BUCKET}.s3.amazonaws.com/{PREFIX}/app.yaml", parameters,
                         ["CAPABILITY_IAM", "CAPABILITY_AUTO_EXPAND"], timeout=420)
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
    parent_resources = stack_resources(localstack, NAME)
    nested_name = parent_resources["Queue"]
    nested_stack = cfn.describe_stacks(StackName=nested_name)["Stacks"][0]
    assert nested_stack["StackStatus"] == "CREATE_COMPLETE", nested_stack
    nested_outputs = {o["OutputKey"]: o["OutputValue"] for o in nested_stack.get("Outputs", [])}
    resources = stack_resources(localstack, nested_name)
    point_functions_at_localstack(localstack, resources)  # as conftest.deploy, for the legacy executor
    apigateway = aws(localstack, "apigateway")
    _spell_out_any_method(apigateway, nested_outputs["ApiId"])
    key = apigateway.get_api_key(apiKey=nested_outputs["ApiKeyId"], includeValue=True)["value"]
    rdq = Stack(backend="postgresql", name=nested_name, store_url=store_url,
                api_base=f"{localstack.endpoint}/restapis/{nested_outputs['ApiId']}/prod/_user_request_",
                api_key=key, worker=resources["WorkerFunction"], reaper=resources["ReaperFunction"], localstack=localstack)
    return Deployed(rdq, {**outputs, "OrdersHandlersPolicy": parent_resources["OrdersHandlersPolicy"]}, nested_name,
                    layer_arn)


@pytest.fixture(scope="module")
def deployed(localstack: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    with servers.pg_scratch_database(servers.SHARED_PG_URL, prefix="rdq_example_app_") as url:
        storage = open_storage(url)
        try:
            storage.migrate()
        finally:
            storage.close()
        yield _deploy(localstack, url, tmp_path_factory.mktemp("example-app"))


def test_the_parent_creates_rdq_nested_with_the_examples_handlers_layer_and_policy(deployed: Deployed):
    cfn = aws(deployed.stack.localstack, "cloudformation")
    nested = cfn.describe_stacks(StackName=deployed.nested)["Stacks"][0]
    given = {p["ParameterKey"]: p["ParameterValue"] for p in nested["Parameters"]}
    assert given["HandlerModules"] == "orders.handlers"
    assert given["HandlerLayerArns"] == deployed.layer_arn
    policy = deployed.parent_outputs["OrdersHandlersPolicy"]
    assert given["WorkerPolicyArns"] == policy
    # The parent's outputs are the nested stack's, through GetAtt Queue.Outputs.*.
    outputs = {o["OutputKey"]: o["OutputValue"] for o in nested["Outputs"]}
    assert deployed.parent_outputs["ApiId"] == outputs["ApiId"]
    assert deployed.parent_outputs["WorkerFunctionName"] == outputs["WorkerFunctionName"] == deployed.stack.worker
    # The example's policy is on rdq's worker role, the role its handlers run with.
    lam, iam = aws(deployed.stack.localstack, "lambda"), aws(deployed.stack.localstack, "iam")
    role = lam.get_function_configuration(FunctionName=deployed.stack.worker)["Role"].rsplit("/", 1)[-1]
    attached = [p["PolicyArn"] for p in iam.list_attached_role_policies(RoleName=role)["AttachedPolicies"]]
    assert policy in attached, attached


def test_an_examples_handler_succeeds_with_its_result(deployed: Deployed):
    order = {"order": "A-17", "currency": "EUR", "lines": [{"sku": "tea", "quantity": 2, "unit_cents": 450},
                                                          {"sku": "cup", "quantity": 1, "unit_cents": 1200}]}
    task_id = enqueue(deployed.stack, "orders", "orders.quote", payload=order)
    done = wait_for("the woken worker to run orders.quote", lambda: task_in(deployed.stack, task_id, "SUCCEEDED", "DEAD"), 90)
    assert done["status"] == "SUCCEEDED", done
    assert done["result"] == {"order": "A-17", "currency": "EUR", "items": 3, "total_cents": 2100}


def test_an_examples_permanent_failure_is_dead_at_once(deployed: Deployed):
    task_id = enqueue(deployed.stack, "orders", "orders.refund",
                      payload={"order": "A-17", "charged_cents": 900, "refund_cents": 1200})
    dead = wait_for("orders.refund dead-lettered", lambda: task_in(deployed.stack, task_id, "SUCCEEDED", "DEAD"), 90)
    assert dead["status"] == "DEAD", dead
    (attempt,) = dead["attempts"]
    assert attempt["outcome"] == "PERMANENT_FAILURE" and "cannot refund 1200 cents" in json.dumps(attempt), attempt
    status, _, page = call(deployed.stack, "GET", "/v1/queues/orders/dlq")
    assert status == 200 and task_id in {t["id"] for t in page["tasks"]}, page
