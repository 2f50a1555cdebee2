"""template.yaml on a real account, checked on the template as CloudFormation receives it (the SAM
transform, per parameter choice): private subnets and their endpoints, concurrency on new
accounts, the API's time and connection bounds, KMS, redeploying the stage when AuthMode changes,
log groups that cannot block re-creating the stack, and parameter validation."""

from __future__ import annotations

import json
import re
import subprocess
from types import SimpleNamespace
from typing import Any

import pytest

from .conftest import REPO
from .test_dashboard import _resolve
from .test_dashboard import _stack as _stack_of
from .test_template import SECRET_ARN, _tool, of_type, transformed

KEY_ARN = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"
VPC = {"SubnetIds": "subnet-1,subnet-2", "SecurityGroupIds": "sg-1,sg-2", "VpcId": "vpc-0abc"}


def _stack(parameters: dict[str, str]) -> dict[str, Any]:
    """The stack CloudFormation would create, storage URL in a secret unless ``parameters`` say otherwise."""
    return _stack_of({"StorageUrlSecretArn": SECRET_ARN, **parameters})


def _rules_hold(parameters: dict[str, str]) -> list[str]:
    """The descriptions of the template's Rules that ``parameters`` break (as CloudFormation checks
    them before creating anything)."""
    stack = _stack(parameters)
    broken = []
    for rule in stack["template"]["Rules"].values():
        applies = _resolve(rule.get("RuleCondition", True), stack["values"], stack["conditions"])
        for assertion in rule["Assertions"] if applies else ():
            if not _resolve(assertion["Assert"], stack["values"], stack["conditions"]):
                broken.append(assertion["AssertDescription"])
    return broken


# -- 1. private subnets ------------------------------------------------------------------------------
def _endpoints(stack: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The stack's VPC endpoints by service (the last part of their service name)."""
    return {_resolve(r["Properties"]["ServiceName"], stack["values"], stack["conditions"]).rsplit(".", 1)[1]: r
            for r in of_type(stack["resources"], "AWS::EC2::VPCEndpoint").values()}


@pytest.mark.parametrize("storage, endpoint", [({}, "secretsmanager"),
                                               ({"StorageUrlSecretArn": "", "StorageUrlParameterName": "/rdq/url"}, "ssm")])
def test_create_vpc_endpoints_makes_interface_endpoints_for_every_api_the_functions_call(storage, endpoint):
    stack = _stack({**VPC, "CreateVpcEndpoints": "true", "VpcEndpointS3": "interface", "EventBusName": "default",
                    **storage})
    endpoints = _endpoints(stack)
    # The storage URL's service (every cold start), Lambda (fan-out, wake-up), S3 (large payloads),
    # Scheduler (the schedule routes), EventBridge (the reaper's PutEvents, with a bus). Only the
    # storage URL's service in use.
    assert set(endpoints) == {endpoint, "lambda", "s3", "scheduler", "events"}
    values = {**stack["values"], "VpcEndpointSecurityGroup": "sg-endpoints"}
    for found in endpoints.values():
        props = _resolve(found["Properties"], values, stack["conditions"])
        assert props["VpcEndpointType"] == "Interface" and props["PrivateDnsEnabled"] is True
        assert props["SubnetIds"] == ["subnet-1", "subnet-2"] and props["VpcId"] == "vpc-0abc"
        assert props["SecurityGroupIds"] == ["sg-endpoints"]
    (group,) = of_type(stack["resources"], "AWS::EC2::SecurityGroup").values()
    (ingress,) = _resolve(group["Properties"]["SecurityGroupIngress"], stack["values"], stack["conditions"])
    assert (ingress["FromPort"], ingress["ToPort"], ingress["SourceSecurityGroupId"]) == (443, 443, "sg-1")


@pytest.mark.parametrize("parameters", [{}, VPC, {"CreateVpcEndpoints": "true", **VPC, "SubnetIds": ""}],
                         ids=["no-vpc", "vpc-with-nat", "endpoints-without-subnets"])
def test_no_endpoint_without_subnets_and_the_flag(parameters):
    stack = _stack({k: v for k, v in parameters.items() if v})
    assert not of_type(stack["resources"], "AWS::EC2::VPCEndpoint")


ENDPOINTS = {**VPC, "CreateVpcEndpoints": "true", "RouteTableIds": "rtb-1,rtb-2"}


@pytest.mark.parametrize("off, gone", [
    ({"VpcEndpointStorage": "false"}, "secretsmanager"), ({"VpcEndpointLambda": "false"}, "lambda"),
    ({"VpcEndpointScheduler": "false"}, "scheduler"), ({"VpcEndpointEvents": "false"}, "events"),
    ({"VpcEndpointS3": "none"}, "s3"), ({"EventBusName": ""}, "events"),
])
def test_each_endpoint_has_its_own_switch(off, gone):
    # A VPC that already has a private-DNS endpoint for one service keeps it: the stack creates the others.
    everything = {"secretsmanager", "lambda", "scheduler", "events", "s3"}
    stack = _stack({**ENDPOINTS, "EventBusName": "default", **off})
    assert set(_endpoints(stack)) == everything - {gone}


def test_s3_is_a_free_gateway_endpoint_on_the_given_route_tables_by_default():
    stack = _stack(ENDPOINTS)
    s3 = _resolve(_endpoints(stack)["s3"]["Properties"], stack["values"], stack["conditions"])
    assert s3 == {"VpcEndpointType": "Gateway", "VpcId": "vpc-0abc", "RouteTableIds": ["rtb-1", "rtb-2"],
                  "ServiceName": "com.amazonaws.eu-west-1.s3"}
    assert stack["template"]["Parameters"]["VpcEndpointS3"]["Default"] == "gateway"
    # No private DNS for S3: the gateway's routes carry the VPC's S3 traffic under S3's public names.
    assert "PrivateDnsEnabled" not in s3 and "DnsOptions" not in s3
    interface = _stack({**ENDPOINTS, "VpcEndpointS3": "interface"})
    props = _endpoints(interface)["s3"]["Properties"]
    assert props["VpcEndpointType"] == "Interface"
    assert props["DnsOptions"] == {"PrivateDnsOnlyForInboundResolverEndpoint": "AllResolvers"}


def test_the_endpoint_security_group_exists_only_for_interface_endpoints():
    only_s3_gateway = {**ENDPOINTS, "VpcEndpointStorage": "false", "VpcEndpointLambda": "false",
                       "VpcEndpointScheduler": "false"}
    stack = _stack(only_s3_gateway)
    assert set(_endpoints(stack)) == {"s3"} and not of_type(stack["resources"], "AWS::EC2::SecurityGroup")
    assert of_type(_stack({**only_s3_gateway, "VpcEndpointLambda": "true"})["resources"], "AWS::EC2::SecurityGroup")


@pytest.mark.parametrize("parameters, broken", [
    ({}, []),
    (VPC, []),
    ({"SubnetIds": "subnet-1"}, ["SubnetIds needs SecurityGroupIds"]),
    ({"CreateVpcEndpoints": "true", "SubnetIds": "subnet-1", "SecurityGroupIds": "sg-1", "VpcEndpointS3": "none"},
     ["needs VpcId and SubnetIds"]),
    ({"CreateVpcEndpoints": "true", "VpcEndpointS3": "interface"}, ["needs VpcId and SubnetIds"]),
    ({**VPC, "CreateVpcEndpoints": "true"}, ["VpcEndpointS3=gateway needs RouteTableIds"]),
    ({**VPC, "CreateVpcEndpoints": "true", "RouteTableIds": "rtb-1"}, []),
    ({"StorageUrlSecretArn": ""}, ["Give StorageUrlSecretArn or StorageUrlParameterName"]),
])
def test_rules_refuse_an_incomplete_network_before_anything_is_created(parameters, broken):
    found = _rules_hold(parameters)
    assert len(found) == len(broken) and all(b in f for b, f in zip(broken, found, strict=True)), found


@pytest.mark.parametrize("name, good, bad", [
    ("StorageUrlSecretArn", ["", "arn:aws:secretsmanager:eu-west-1:123456789012:secret:rdq/url-AbCdEf",
                             "arn:aws-us-gov:secretsmanager:us-gov-west-1:123456789012:secret:x-1"],
     ["rdq/url", "rdq-url", "arn:aws:ssm:eu-west-1:123456789012:parameter/x"]),
    ("StorageKmsKeyArn", ["", KEY_ARN], ["alias/aws/secretsmanager", "1234abcd-12ab-34cd-56ef-1234567890ab"]),
    ("StorageEndpoint", ["", "postgresql://db.example.rds.amazonaws.com:5432/rdq?sslmode=verify-full"],
     ["postgresql://user:pw@db/rdq", "redis://cache:6379"]),
    ("VpcId", ["", "vpc-0abc123"], ["subnet-1"]),
])
def test_parameters_refuse_what_would_make_an_invalid_policy_or_url(name, good, bad):
    pattern = transformed()["Parameters"][name]["AllowedPattern"]
    assert all(re.fullmatch(pattern, value) for value in good), pattern
    assert not any(re.fullmatch(pattern, value) for value in bad), pattern


# -- 2. reserved concurrency on new accounts -------------------------------------------------------
@pytest.mark.parametrize("reserve", ["false", "true"])
def test_reservation_is_optional_and_bounded(reserve):
    stack = _stack({"ReserveConcurrency": reserve})
    reserved = {name: _resolve(r["Properties"].get("ReservedConcurrentExecutions"), stack["values"], stack["conditions"])
                for name, r in of_type(stack["resources"], "AWS::Lambda::Function").items()}
    if reserve == "false":  # a new account (limit 10, 10 kept unreserved) accepts the stack
        assert set(reserved.values()) == {None}
    else:
        assert reserved == {"WorkerFunction": "4", "ReaperFunction": 1, "ApiFunction": "10"}
    parameters = stack["template"]["Parameters"]
    # Even at the default limit (1000), 100 must stay unreserved: the caps leave that and more.
    assert parameters["MaxWorkerConcurrency"]["MaxValue"] + parameters["ApiMaxConcurrency"]["MaxValue"] + 1 <= 900


# -- 4. and 7. the API's time and connections ------------------------------------------------------
def test_the_api_ends_before_the_gateway_and_each_statement_before_the_function():
    api = transformed()["Resources"]["ApiFunction"]["Properties"]
    statement = api["Environment"]["Variables"]["RDQ_PG_STATEMENT_TIMEOUT"]
    assert api["Timeout"] < 29, "API Gateway's integration limit"
    assert statement.endswith("s") and float(statement[:-1]) * 2 <= api["Timeout"], \
        "two statements (a count, then the bounded action) fit in the function's time"


@pytest.mark.parametrize("auth", ["AWS_IAM", "API_KEY"])
def test_the_stage_is_throttled_in_every_auth_mode(auth):
    stack = _stack({"AuthMode": auth, "ApiThrottleRateLimit": "20", "ApiThrottleBurstLimit": "40"})
    (stage,) = of_type(stack["resources"], "AWS::ApiGateway::Stage").values()
    (setting,) = _resolve(stage["Properties"]["MethodSettings"], stack["values"], stack["conditions"])
    assert setting == {"ResourcePath": "/*", "HttpMethod": "*", "ThrottlingRateLimit": "20", "ThrottlingBurstLimit": "40"}


# -- 5. KMS ------------------------------------------------------------------------------------------
def test_a_customer_managed_key_may_decrypt_only_through_secrets_manager_or_ssm():
    assert "StorageKeyDecryptPolicy" not in _stack({})["resources"]
    stack = _stack({"StorageKmsKeyArn": KEY_ARN})
    policy = stack["resources"]["StorageKeyDecryptPolicy"]
    roles = [ref["Ref"] for ref in policy["Properties"]["Roles"]]
    assert roles == ["ApiFunctionRole", "WorkerFunctionRole", "ReaperFunctionRole"]
    (kms,) = _resolve(policy["Properties"]["PolicyDocument"], stack["values"], stack["conditions"])["Statement"]
    assert (kms["Action"], kms["Resource"]) == ("kms:Decrypt", KEY_ARN)
    assert kms["Condition"] == {"StringEquals": {"kms:ViaService": ["secretsmanager.eu-west-1.amazonaws.com",
                                                                     "ssm.eu-west-1.amazonaws.com"]}}


# -- 6. AuthMode redeploys the stage ----------------------------------------------------------------
def _deployment_ids(template_text: str, auth: str) -> list[str]:
    from samtranslator.translator.transform import transform
    from samtranslator.yaml_helper import yaml_parse

    template = yaml_parse(template_text)
    for resource in template["Resources"].values():
        props = resource.get("Properties", {})
        for key in ("CodeUri", "ContentUri"):
            if key in props:
                props[key] = "s3://rdq-artifacts/code.zip"

    class ManagedPolicies:
        def load(self) -> dict[str, str]:
            return {}

    transformed_template = transform(template, {"StorageUrlSecretArn": SECRET_ARN, "AuthMode": auth}, ManagedPolicies())
    return [name for name, r in transformed_template["Resources"].items() if r["Type"] == "AWS::ApiGateway::Deployment"]


def test_changing_auth_mode_deploys_the_stage_again(monkeypatch):
    import samtranslator.model.apigateway as sam_apigateway

    text = (REPO / "template.yaml").read_text()
    assert "      AlwaysDeploy: true\n" in text
    # What the issue found: without AlwaysDeploy, SAM names the Deployment after the body with its
    # !If unresolved, so AWS_IAM and API_KEY get the same logical id and an update deploys nothing.
    hashed_only = text.replace("      AlwaysDeploy: true\n", "")
    assert _deployment_ids(hashed_only, "AWS_IAM") == _deployment_ids(hashed_only, "API_KEY")
    # With it, SAM names the Deployment after the time of the transform (whole seconds): a stack
    # update (a later transform) from AWS_IAM to API_KEY, or back, gets a new Deployment, and so
    # the stage serves the security the new AuthMode asks for.
    clock = iter([1_800_000_000.0, 1_800_000_060.0, 1_800_000_120.0])
    monkeypatch.setattr(sam_apigateway, "time", SimpleNamespace(time=lambda: next(clock)))
    created, updated, updated_back = (_deployment_ids(text, "AWS_IAM"), _deployment_ids(text, "API_KEY"),
                                      _deployment_ids(text, "AWS_IAM"))
    assert len(created) == len(updated) == len(updated_back) == 1
    assert len({*created, *updated, *updated_back}) == 3


def test_one_stage_named_prod_and_no_stage_named_stage():
    resources = transformed()["Resources"]
    (stage,) = of_type(resources, "AWS::ApiGateway::Stage").values()
    assert stage["Properties"]["StageName"] == "prod"
    for deployment in of_type(resources, "AWS::ApiGateway::Deployment").values():
        assert "StageName" not in deployment["Properties"], "a Deployment with StageName creates a stage of that name"


# -- 8. log groups -----------------------------------------------------------------------------------
def test_each_function_logs_to_a_group_it_depends_on_so_deletion_cannot_leave_one_behind():
    resources = transformed()["Resources"]
    for function, group in (("ApiFunction", "ApiLogGroup"), ("WorkerFunction", "WorkerLogGroup"),
                            ("ReaperFunction", "ReaperLogGroup")):
        assert resources[function]["Properties"]["LoggingConfig"] == {"LogGroup": {"Ref": group}}
        # The group's name must not name the function (that would make the group depend on it).
        name = resources[group]["Properties"]["LogGroupName"]["Fn::Sub"]
        assert re.fullmatch(r"/aws/lambda/\$\{AWS::StackName\}-(api|worker|reaper)", name), name


# -- minor -------------------------------------------------------------------------------------------
def test_throttled_async_events_expire_after_a_minute():
    configs = of_type(transformed()["Resources"], "AWS::Lambda::EventInvokeConfig").values()
    (config,) = [c for c in configs if c["Properties"]["FunctionName"] == {"Ref": "WorkerFunction"}
                 and c["Properties"]["Qualifier"] == "$LATEST"]
    assert (config["Properties"]["MaximumRetryAttempts"], config["Properties"]["MaximumEventAgeInSeconds"]) == (0, 60)
    assert "dropped, not queued" not in (REPO / "template.yaml").read_text()


@pytest.mark.parametrize("parameters", [
    {**VPC, "CreateVpcEndpoints": "true", "StorageKmsKeyArn": KEY_ARN, "ReserveConcurrency": "true"},
    {**VPC, "CreateVpcEndpoints": "true", "StorageUrlSecretArn": "", "StorageUrlParameterName": "/rdq/url",
     "StorageEndpoint": "postgresql://db:5432/rdq", "AuthMode": "API_KEY"},
], ids=["endpoints-kms-reserved", "endpoints-ssm-api-key"])
def test_cfn_lint_on_the_account_choices(tmp_path, parameters):
    path = tmp_path / "transformed.json"
    path.write_text(json.dumps(transformed(parameters)))
    result = subprocess.run([_tool("cfn-lint"), "--", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


