"""The template's Rules: what CloudFormation refuses before it creates anything, checked on the
transformed template with the parameters a user would give; and the limits no rule can state,
which docs/serverless.md names instead."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import REPO
from .test_template import transformed
from .test_template_account import _rules_hold

#: The functions CloudFormation accepts inside Rules (no Fn::Select, Fn::Split, Fn::Sub, Fn::If,
#: no length or number comparison, no pseudo parameter such as the stack name).
RULE_FUNCTIONS = {"Fn::And", "Fn::Contains", "Fn::EachMemberEquals", "Fn::EachMemberIn", "Fn::Equals", "Fn::Not",
                  "Fn::Or", "Fn::RefAll", "Fn::ValueOf", "Fn::ValueOfAll", "Ref"}
SECRET = "arn:aws:secretsmanager:us-east-1:123456789012:secret:rdq-url-AbCdEf"


def _functions(node: Any) -> set[str]:
    if isinstance(node, list):
        return set().union(*(_functions(n) for n in node)) if node else set()
    if isinstance(node, dict):
        found = {key for key in node if key == "Ref" or key.startswith("Fn::")}
        return found.union(*(_functions(v) for v in node.values()))
    return set()


def test_every_rule_uses_only_what_cloudformation_rules_accept():
    template = transformed()
    for name, rule in template["Rules"].items():
        used = _functions(rule)
        assert used <= RULE_FUNCTIONS, (name, used - RULE_FUNCTIONS)
        refs = {n["Ref"] for n in _walk(rule) if isinstance(n, dict) and "Ref" in n}
        assert refs <= set(template["Parameters"]), (name, refs - set(template["Parameters"]))
        assert all(a["AssertDescription"].endswith(".") for a in rule["Assertions"]), name


def _walk(node: Any) -> list[Any]:
    if isinstance(node, list):
        return [x for n in node for x in _walk(n)]
    if isinstance(node, dict):
        return [node, *(x for v in node.values() for x in _walk(v))]
    return []


@pytest.mark.parametrize("parameters, broken", [
    ({"StorageUrlParameterName": "/rdq/url"}, "not both"),
    ({"StorageUrlSecretArn": "", "StorageUrlParameterName": "/rdq/url", "StorageEndpoint": "postgresql://db:5432/rdq"},
     "StorageEndpoint takes a database secret's credentials"),
    ({"DeadTaskTopicEmail": "ops@example.com"}, "needs EventBusName"),
    ({"ApiVpcEndpointIds": "vpce-1"}, "only to ApiEndpointType=PRIVATE"),
    ({"ApiEndpointType": "PRIVATE"}, "needs ApiVpcEndpointIds"),
    ({"SubnetIds": "subnet-1,subnet-2", "SecurityGroupIds": "sg-1", "VpcId": "vpc-0abc", "CreateVpcEndpoints": "true"},
     "needs RouteTableIds"),
])
def test_a_rule_refuses_parameters_that_would_be_ignored_or_fail_later(parameters, broken):
    (found,) = _rules_hold(parameters)
    assert broken in found, found


@pytest.mark.parametrize("parameters", [
    {},
    {"StorageUrlSecretArn": "", "StorageUrlParameterName": "/rdq/url"},
    {"StorageEndpoint": "postgresql://db:5432/rdq"},
    {"EventBusName": "default", "DeadTaskTopicEmail": "ops@example.com"},
    {"ApiEndpointType": "PRIVATE", "ApiVpcEndpointIds": "vpce-1"},
    {"SubnetIds": "subnet-1,subnet-2", "SecurityGroupIds": "sg-1", "VpcId": "vpc-0abc", "CreateVpcEndpoints": "true",
     "VpcEndpointS3": "interface"},
], ids=["defaults", "parameter", "database-secret", "bus-and-topic", "private-api", "s3-interface"])
def test_complete_parameter_sets_pass_every_rule(parameters):
    assert _rules_hold(parameters) == []


def test_what_no_rule_can_say_is_documented():
    guide = (REPO / "docs" / "serverless.md").read_text()
    section = guide[guide.index("### What the template cannot check"):]
    section = section[: section.index("\n## ")]
    for subject in ("stack name", "EventBusName", "WorkerPolicyArns", "Availability Zone", "DNS hostnames",
                    "CloudWatch Logs role"):
        assert subject in section, subject
