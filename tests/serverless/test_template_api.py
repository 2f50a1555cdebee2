"""The API stage's options on the transformed template: access logs (ApiAccessLogs) and the body
limit at the gateway (ApiBodyLimitFirewall), whose 413 is the function's own problem."""

from __future__ import annotations

import json
import random
import re

import pytest

from rdq_core.hosts.aws_lambda.settings import Settings
from rdq_core.problems import problem_json

from .test_dashboard import _resolve
from .test_production_checklist import _created, _props


def test_access_logs_are_off_by_default_and_go_to_their_own_group_when_on():
    plain = _created({})
    assert _props(plain, "RdqApiprodStage").get("AccessLogSetting") is None
    assert "ApiAccessLogGroup" not in plain["resources"]

    stack = _created({"ApiAccessLogs": "true"})
    setting = _props(stack, "RdqApiprodStage")["AccessLogSetting"]
    assert setting["DestinationArn"] == "getatt:ApiAccessLogGroup.Arn"
    group = _props(stack, "ApiAccessLogGroup")
    assert group == {"LogGroupName": "/aws/apigateway/orders-api-access", "RetentionInDays": "30"}
    # One JSON object per request: who called (principal or key), what, the answer, the WAF's code.
    line = json.loads(setting["Format"])
    assert {"requestId", "userArn", "apiKeyId", "method", "path", "status", "wafResponseCode"} <= set(line)
    assert all(value.startswith("$context.") for value in line.values())
    description = stack["template"]["Parameters"]["ApiAccessLogs"]["Description"]
    assert "CloudWatch Logs role" in description, "the account-level prerequisite is said where it is chosen"


def _regex(stack) -> str:
    (rule,) = _props(stack, "ApiBodyLimitWebAcl")["Rules"]
    statement = rule["Statement"]["RegexMatchStatement"]
    assert statement["FieldToMatch"] == {"SingleHeader": {"Name": "content-length"}}
    assert statement["TextTransformations"] == [{"Priority": 0, "Type": "NONE"}]
    return str(statement["RegexString"])


def test_the_firewall_is_opt_in_and_guards_this_apis_stage():
    assert not {"ApiBodyLimitWebAcl", "ApiBodyLimitWebAclAssociation"} & set(_created({})["resources"])
    stack = _created({"ApiBodyLimitFirewall": "true"})
    acl = _props(stack, "ApiBodyLimitWebAcl")
    assert acl["Scope"] == "REGIONAL" and acl["DefaultAction"] == {"Allow": {}}
    association = _props(stack, "ApiBodyLimitWebAclAssociation")
    assert association == {"ResourceArn": "arn:aws:apigateway:eu-west-1::/restapis/ref:RdqApi/stages/prod",
                           "WebACLArn": "getatt:ApiBodyLimitWebAcl.Arn"}
    assert stack["resources"]["ApiBodyLimitWebAclAssociation"]["DependsOn"] == "RdqApiprodStage"


def test_the_firewall_answers_the_functions_own_413_problem():
    stack = _created({"ApiBodyLimitFirewall": "true"})
    acl = _props(stack, "ApiBodyLimitWebAcl")
    (rule,) = acl["Rules"]
    response = rule["Action"]["Block"]["CustomResponse"]
    assert response["ResponseCode"] == 413
    body = acl["CustomResponseBodies"][response["CustomResponseBodyKey"]]
    limit = Settings().max_body_bytes
    assert body["ContentType"] == "APPLICATION_JSON"
    assert json.loads(body["Content"]) == json.loads(problem_json(413, f"the request body exceeds {limit} bytes"))


@pytest.mark.parametrize("length, refused", [
    (0, False), (1, False), (999_999, False), (1_048_570, False), (1_048_576, False), (1_048_577, True),
    (1_048_579, True), (1_048_580, True), (1_048_600, True), (1_049_000, True), (1_050_000, True),
    (1_100_000, True), (2_000_000, True), (6_291_456, True), (9_999_999, True), (10_485_760, True),
    (123_456_789, True),
])
def test_the_content_length_rule_refuses_exactly_the_bodies_over_the_functions_limit(length, refused):
    pattern = re.compile(_regex(_created({"ApiBodyLimitFirewall": "true"})))
    assert bool(pattern.fullmatch(str(length))) is refused
    assert bool(pattern.fullmatch("00" + str(length))) is refused, "leading zeros are the same length"


def test_the_content_length_rule_agrees_with_the_limit_everywhere_near_it_and_beyond():
    pattern = re.compile(_regex(_created({"ApiBodyLimitFirewall": "true"})))
    limit = Settings().max_body_bytes
    lengths = [*range(limit - 20_000, limit + 20_000), *random.Random(7).sample(range(0, 10**9), 5000)]
    wrong = [n for n in lengths if bool(pattern.fullmatch(str(n))) != (n > limit)]
    assert not wrong, wrong[:10]
    assert not pattern.fullmatch("1e9") and not pattern.fullmatch("-5") and not pattern.fullmatch("")


def test_bodies_over_ten_megabytes_get_the_gateways_413_as_a_problem():
    """Above API Gateway's own 10 MB limit, its REQUEST_TOO_LARGE response (413) goes through the
    DEFAULT_4XX template: a problem document with the gateway's status."""
    stack = _created({})
    responses = _props(stack, "RdqApi")["Body"]["x-amazon-apigateway-gateway-responses"]
    template = responses["DEFAULT_4XX"]["responseTemplates"]["application/json"]
    assert '"status": $context.error.statusCode' in template
    assert responses["DEFAULT_4XX"]["responseParameters"] == {
        "gatewayresponse.header.Content-Type": "'application/problem+json'"}
    assert _resolve({"Ref": "ApiBodyLimitFirewall"}, stack["values"], stack["conditions"]) == "false"
