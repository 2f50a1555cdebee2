"""template.yaml's payload bucket, as CloudFormation receives it after the SAM transform: encryption,
no public access, lifecycle = retention that never touches live tasks' payloads, the variable the
functions read, and least-privilege IAM per function. (Lint: tests/serverless/test_template.py.)"""

from __future__ import annotations

import pytest

from .test_template import managed_policies, transformed

BUCKET_ARN = {"Fn::GetAtt": ["PayloadBucket", "Arn"]}


@pytest.fixture(scope="module")
def resources() -> dict:
    return transformed({"PayloadRetentionDays": "3"})["Resources"]


def _sub(text: str) -> dict:
    return {"Fn::Sub": text}


def test_the_bucket_is_encrypted_with_kms_private_and_tls_only(resources):
    bucket = resources["PayloadBucket"]
    assert bucket["Type"] == "AWS::S3::Bucket" and bucket["DeletionPolicy"] == "Retain"
    (rule,) = bucket["Properties"]["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert rule == {"ServerSideEncryptionByDefault": {"SSEAlgorithm": "aws:kms"}, "BucketKeyEnabled": True}
    assert bucket["Properties"]["PublicAccessBlockConfiguration"] == {
        "BlockPublicAcls": True, "BlockPublicPolicy": True, "IgnorePublicAcls": True, "RestrictPublicBuckets": True}
    assert bucket["Properties"]["OwnershipControls"] == {"Rules": [{"ObjectOwnership": "BucketOwnerEnforced"}]}
    (deny,) = resources["PayloadBucketPolicy"]["Properties"]["PolicyDocument"]["Statement"]
    assert deny["Effect"] == "Deny" and deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}


def test_the_lifecycle_expires_results_and_finished_payloads_only(resources):
    rules = {r["Id"]: r for r in resources["PayloadBucket"]["Properties"]["LifecycleConfiguration"]["Rules"]}
    retention = {"Ref": "PayloadRetentionDays"}
    assert rules["results"]["Prefix"] == "results/" and rules["results"]["ExpirationInDays"] == retention
    payloads = rules["finished-payloads"]
    assert payloads["Prefix"] == "payloads/" and payloads["ExpirationInDays"] == retention
    # Without the tag filter the rule would expire payloads of pending and dead tasks.
    assert payloads["TagFilters"] == [{"Key": "rdq-finished", "Value": "true"}]
    assert all(r["Status"] == "Enabled" for r in rules.values())
    expiring = [r for r in rules.values() if "ExpirationInDays" in r]
    assert all(r.get("Prefix") == "results/" or r.get("TagFilters") for r in expiring)


def test_every_function_is_told_the_bucket(resources):
    for name in ("ApiFunction", "WorkerFunction", "ReaperFunction"):
        variables = resources[name]["Properties"]["Environment"]["Variables"]
        assert variables["RDQ_PAYLOAD_BUCKET"] == {"Ref": "PayloadBucket"}, name
        assert variables["RDQ_PAYLOAD_THRESHOLD_BYTES"] == {"Ref": "PayloadThresholdBytes"}, name


def _grants(resources, policy: str) -> dict[str, set]:
    """Action -> the resources it is allowed on, for one managed policy."""
    grants: dict[str, set] = {}
    for statement in resources[policy]["Properties"]["PolicyDocument"]["Statement"]:
        assert statement["Effect"] == "Allow"
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        targets = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
        for action in actions:
            grants.setdefault(action, set()).update(repr(t) for t in targets)
    return grants


PAYLOADS, RESULTS = repr(_sub("${PayloadBucket.Arn}/payloads/*")), repr(_sub("${PayloadBucket.Arn}/results/*"))


def test_each_function_gets_only_what_it_does_with_the_bucket(resources):
    assert _grants(resources, "PayloadApiPolicy") == {
        "s3:PutObject": {PAYLOADS}, "s3:PutObjectTagging": {PAYLOADS}, "s3:DeleteObjectTagging": {PAYLOADS},
        "s3:GetObject": {PAYLOADS, RESULTS}, "s3:DeleteObject": {PAYLOADS, RESULTS},
        "s3:ListBucket": {repr(BUCKET_ARN)},
    }
    assert _grants(resources, "PayloadWorkerPolicy") == {
        "s3:GetObject": {PAYLOADS}, "s3:PutObjectTagging": {PAYLOADS}, "s3:PutObject": {RESULTS},
        "s3:ListBucket": {repr(BUCKET_ARN)},
    }
    roles = {name: managed_policies(resources[f"{name}Role"]) for name in ("ApiFunction", "WorkerFunction", "ReaperFunction")}
    assert {"Ref": "PayloadApiPolicy"} in roles["ApiFunction"] and {"Ref": "PayloadWorkerPolicy"} not in roles["ApiFunction"]
    worker_policies = roles["WorkerFunction"]
    assert {"Ref": "PayloadWorkerPolicy"} in worker_policies and {"Ref": "PayloadApiPolicy"} not in worker_policies
    # The reaper deletes the objects of the tasks retention purges (RetentionHours), and nothing else.
    assert _grants(resources, "PayloadReaperPolicy") == {"s3:DeleteObject": {PAYLOADS, RESULTS}}
    assert [p for p in roles["ReaperFunction"] if isinstance(p, dict) and "Payload" in str(p)] == [{"Ref": "PayloadReaperPolicy"}]
    # No inline statement anywhere grants S3 on the bucket beyond these two policies.
    for name in roles:
        for policy in resources[f"{name}Role"]["Properties"].get("Policies", []):
            assert "s3:" not in str(policy), name
