"""template.yaml through both linters, as CI runs them: cfn-lint on the SAM source and on the
transformed template (default and full parameter sets), and checkov on the transformed template,
where a finding fails unless tests/serverless/checkov_suppressions.yaml accepts it with a reason."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from .conftest import REPO
from .test_template import SECRET_ARN, _tool, transformed

SUPPRESSIONS = Path(__file__).with_name("checkov_suppressions.yaml")

#: Every optional feature on at once, so that every conditional resource and branch is linted.
FULL = {
    "AuthMode": "API_KEY", "SubnetIds": "subnet-1,subnet-2", "SecurityGroupIds": "sg-1", "VpcId": "vpc-0abc",
    "CreateVpcEndpoints": "true", "RouteTableIds": "rtb-1,rtb-2", "EnableTracing": "true", "ReserveConcurrency": "true",
    "StorageKmsKeyArn": "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab",
    "EventBusName": "default", "DeadTaskTopicEmail": "ops@example.com",
    "AlarmTopicArn": "arn:aws:sns:us-east-1:123456789012:ops", "AlarmQueue1": "emails", "ExampleSchedule": "true",
    "WorkerPolicyArns": "arn:aws:iam::123456789012:policy/a,arn:aws:iam::123456789012:policy/b",
    "PermissionsBoundary": "arn:aws:iam::123456789012:policy/boundary",
    "ApiEndpointType": "PRIVATE", "ApiVpcEndpointIds": "vpce-0abc", "ApiAccessLogs": "true", "ApiBodyLimitFirewall": "true",
    "Targets": '{"resize":{"lambda":"arn:aws:lambda:us-east-1:123456789012:function:resize"}}',
    "TargetFunctionArns": "arn:aws:lambda:us-east-1:123456789012:function:resize",
}
PARAMETER_SETS = {"defaults": {}, "full": FULL}


def _cfn_lint(*arguments: str) -> None:
    result = subprocess.run([_tool("cfn-lint"), *arguments], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("parameters", list(PARAMETER_SETS), ids=list(PARAMETER_SETS))
def test_cfn_lint_on_the_sam_source(parameters):
    # cfn-lint applies the SAM transform itself, with these parameter values.
    given = {"StorageUrlSecretArn": SECRET_ARN, **PARAMETER_SETS[parameters]}
    _cfn_lint("--parameters", *(f"{k}={v}" for k, v in given.items()), "--", "template.yaml")


@pytest.fixture(scope="module", params=list(PARAMETER_SETS), ids=list(PARAMETER_SETS))
def transformed_file(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("transformed") / f"{request.param}.json"
    path.write_text(json.dumps(transformed(PARAMETER_SETS[request.param])))
    return path


def test_cfn_lint_on_the_transformed_template(transformed_file):
    _cfn_lint("--", str(transformed_file))


def _suppressions() -> dict[tuple[str, str], str]:
    accepted: dict[tuple[str, str], str] = {}
    for entry in yaml.safe_load(SUPPRESSIONS.read_text()):
        assert set(entry) == {"check", "resources", "reason"}, entry
        assert len(entry["reason"].split()) >= 8, f"{entry['check']}: say why, not just that"
        for resource in entry["resources"]:
            assert (entry["check"], resource) not in accepted, (entry["check"], resource)
            accepted[(entry["check"], resource)] = entry["reason"]
    return accepted


def _checkov_findings(path: Path) -> set[tuple[str, str]]:
    result = subprocess.run([_tool("checkov"), "-f", str(path), "--framework", "cloudformation", "-o", "json",
                             "--quiet", "--compact"], capture_output=True, text=True, timeout=300, cwd=path.parent)
    assert result.returncode in (0, 1), result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout)
    reports = report if isinstance(report, list) else [report]
    assert reports and all(r.get("check_type") == "cloudformation" for r in reports), result.stdout[:500]
    assert sum(r.get("summary", {}).get("parsing_errors", 0) for r in reports) == 0
    assert sum(r.get("summary", {}).get("passed", 0) for r in reports) > 50, "checkov read the template"
    return {(f["check_id"], f["resource"].split(".", 1)[1]) for r in reports for f in r["results"]["failed_checks"]}


def test_checkov_finds_nothing_that_is_not_suppressed_with_a_reason(transformed_file):
    findings = _checkov_findings(transformed_file)
    new = sorted(findings - set(_suppressions()))
    assert not new, f"new checkov findings: fix them, or add each to {SUPPRESSIONS.name} with its reason: {new}"


def test_every_suppression_still_matches_a_finding(tmp_path):
    # Under the full parameter set every resource exists, so each entry must still be needed there.
    path = tmp_path / "full.json"
    path.write_text(json.dumps(transformed(FULL)))
    stale = sorted(set(_suppressions()) - _checkov_findings(path))
    assert not stale, f"no longer found: remove from {SUPPRESSIONS.name}: {stale}"


def test_ci_runs_the_linters_through_the_readme_test_command():
    # .ci/run runs `python -m pytest` (this file included) after installing the dev extra.
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"checkov' in pyproject and '"cfn-lint' in pyproject
    assert "python -m pytest\n" in (REPO / ".ci" / "run").read_text()
