"""template.yaml for targets: the bindings reach the worker as RDQ_TARGETS, and the worker may
invoke exactly the functions named in TargetFunctionArns (nothing when none are)."""

from __future__ import annotations

import json
import subprocess

from .test_template import _tool, created, transformed
from .test_template_linters import FULL, _checkov_findings, _suppressions

TARGET_ARNS = ("arn:aws:lambda:us-east-1:123456789012:function:resize,"
               "arn:aws:lambda:us-east-1:123456789012:function:notify:live")
BINDINGS = json.dumps({"resize": {"lambda": "arn:aws:lambda:us-east-1:123456789012:function:resize"}})


def test_the_bindings_reach_the_worker_only():
    resources = transformed({"Targets": BINDINGS})["Resources"]
    assert resources["WorkerFunction"]["Properties"]["Environment"]["Variables"]["RDQ_TARGETS"] == {"Ref": "Targets"}
    for other in ("ApiFunction", "ReaperFunction"):
        assert "RDQ_TARGETS" not in resources[other]["Properties"]["Environment"]["Variables"], other


def test_invoke_is_granted_on_exactly_the_bound_functions_and_only_when_there_are_some():
    assert "TargetInvokePolicy" not in created({})
    policy = created({"Targets": BINDINGS, "TargetFunctionArns": TARGET_ARNS})["TargetInvokePolicy"]["Properties"]
    assert policy["Roles"] == [{"Ref": "WorkerFunctionRole"}]
    assert policy["PolicyDocument"]["Statement"] == [
        {"Effect": "Allow", "Action": "lambda:InvokeFunction", "Resource": {"Ref": "TargetFunctionArns"}}]


def test_both_linters_pass_with_targets_on_top_of_every_other_feature(tmp_path):
    path = tmp_path / "transformed.json"
    path.write_text(json.dumps(transformed({**FULL, "Targets": BINDINGS, "TargetFunctionArns": TARGET_ARNS})))
    result = subprocess.run([_tool("cfn-lint"), "--", str(path)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    new = sorted(_checkov_findings(path) - set(_suppressions()))
    assert not new, f"new checkov findings with targets bound: {new}"
