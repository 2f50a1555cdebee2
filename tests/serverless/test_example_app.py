"""examples/sam-app, the application that uses rdq without forking it: its template passes
`sam validate --lint`, hands rdq what rdq's template declares, and `sam build` builds its handlers
into a layer whose handlers a real rdq worker runs. (Deployed and run end to end on LocalStack:
tests/localstack/test_example_app.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rdq_core import Client
from rdq_core.compliance.support import wait_until

from .conftest import REPO
from .test_template import _python312_or_fail, _tool

EXAMPLE = REPO / "examples" / "sam-app"


def _template(path: Path) -> dict:
    from samtranslator.yaml_helper import yaml_parse

    return dict(yaml_parse(path.read_text()))


def test_example_passes_sam_validate_lint():
    result = subprocess.run([_tool("sam"), "validate", "--lint", "--template", str(EXAMPLE / "template.yaml")],
                            capture_output=True, text=True, cwd=EXAMPLE, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_example_hands_rdq_its_layer_modules_and_policy():
    example, rdq = _template(EXAMPLE / "template.yaml"), _template(REPO / "template.yaml")
    (application,) = [r for r in example["Resources"].values() if r["Type"] == "AWS::Serverless::Application"]
    given = application["Properties"]["Parameters"]
    assert set(given) <= set(rdq["Parameters"]), set(given) - set(rdq["Parameters"])
    # The handlers: a layer of this application, and modules that exist in it.
    layer = given["HandlerLayerArns"]["Ref"]
    assert example["Resources"][layer]["Type"] == "AWS::Serverless::LayerVersion"
    content = EXAMPLE / example["Resources"][layer]["Properties"]["ContentUri"]
    for module in given["HandlerModules"].split(","):
        assert (content / (module.strip().replace(".", "/") + ".py")).is_file(), module
    # Their permissions: a managed policy of this application, on rdq's worker role.
    assert example["Resources"][given["WorkerPolicyArns"]["Ref"]]["Type"] == "AWS::IAM::ManagedPolicy"
    # Every parameter the example passes on as it is accepts what rdq's accepts, no more, no less.
    for name, value in given.items():
        if value == {"Ref": name}:
            mine, theirs = example["Parameters"][name], rdq["Parameters"][name]
            for rule in ("AllowedValues", "AllowedPattern", "Default"):
                assert mine.get(rule) == theirs.get(rule), (name, rule)
    assert {"PermissionsBoundary", "StorageUrlSecretArn", "StorageUrlParameterName"} <= {
        name for name, value in given.items() if value == {"Ref": name}}


def test_the_readme_packages_rdq_where_the_template_nests_it():
    (application,) = [r for r in _template(EXAMPLE / "template.yaml")["Resources"].values()
                      if r["Type"] == "AWS::Serverless::Application"]
    location = application["Properties"]["Location"]
    readme = (EXAMPLE / "README.md").read_text()
    assert f"--output-template-file examples/sam-app/{location}" in readme
    assert location in (EXAMPLE / ".gitignore").read_text().splitlines(), "a build output, not a source file"


def _packaged_rdq(target: Path) -> None:
    """rdq's template as `sam package` leaves it (README step 1): code and layers in S3."""
    template = _template(REPO / "template.yaml")
    for name, resource in template["Resources"].items():
        props = resource.get("Properties", {})
        for key in ("CodeUri", "ContentUri"):
            if key in props:
                props[key] = f"s3://rdq-artifacts/{name}.zip"
    target.write_text(json.dumps(template))


@pytest.mark.sam_build
def test_example_builds_and_a_worker_runs_its_layers_handlers(tmp_path):
    py312 = _python312_or_fail()
    app = tmp_path / "app"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns(".aws-sam", "rdq.packaged.yaml", "__pycache__"))
    _packaged_rdq(app / "rdq.packaged.yaml")
    env = {**os.environ, "PATH": f"{py312}:{os.environ['PATH']}", "SAM_CLI_TELEMETRY": "0"}
    result = subprocess.run([_tool("sam"), "build", "--build-dir", str(app / "build")], capture_output=True, text=True,
                            cwd=app, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    built = _template(app / "build" / "template.yaml")
    assert built["Resources"]["Queue"]["Properties"]["Location"] == "Queue/template.yaml"
    assert (app / "build" / "Queue" / "template.yaml").is_file()
    layer = app / "build" / "OrdersHandlers" / "python"  # /opt/python on the worker
    assert (layer / "orders" / "handlers.py").is_file()
    assert not (layer / "rdq_core").exists(), "rdq_core comes with rdq's worker, not with the handlers' layer"

    # A real worker with only the built layer added to its path, as rdq's worker has it.
    url = f"sqlite:///{tmp_path}/orders.db"
    with Client(url) as client:
        client.storage.migrate()
        quote = client.enqueue("orders", "orders.quote", {"order": "A-17", "lines": [
            {"sku": "tea", "quantity": 2, "unit_cents": 450}]}).id
        refund = client.enqueue("orders", "orders.refund", {"order": "A-17", "charged_cents": 900, "refund_cents": 1200}).id
        worker = subprocess.Popen(
            [sys.executable, "-c", "from rdq_core.hosts.cli import main; main()", "--storage", url, "worker",
             "--handlers", "orders.handlers", "--queues", "orders"],
            env={**os.environ, "PYTHONPATH": f"{layer}{os.pathsep}{REPO}"}, cwd=tmp_path,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: {client.get(quote).status.value, client.get(refund).status.value} <= {"SUCCEEDED", "DEAD"},
                       timeout=30, interval=0.2, what="the worker to settle both tasks")
        finally:
            worker.terminate()
            _, errors = worker.communicate(timeout=30)
        done, dead = client.get(quote), client.get(refund)
        assert done.status.value == "SUCCEEDED", errors[-3000:]
        assert done.result == {"order": "A-17", "currency": "EUR", "items": 2, "total_cents": 900}
        assert dead.status.value == "DEAD" and [a.outcome.value for a in dead.attempts] == ["PERMANENT_FAILURE"], dead
