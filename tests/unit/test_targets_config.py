"""Bindings: how they are read and refused, how each host loads them, the documented signature
test vector, and a receiver in another language verifying a real request."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rdq_core.compliance.support import wait_until
from rdq_core.errors import ConfigurationError
from rdq_core.engine.handlers import HandlerRegistry
from rdq_core.hosts.aws_lambda.settings import Settings
from rdq_core.targets import (
    HttpsTarget,
    InvalidSignature,
    LambdaTarget,
    SecretRef,
    bind_targets,
    load_targets,
    parse_targets,
    signature_header,
    targets_from_json,
    verify_signature,
)

from .target_receivers import Answer, Authority, Receiver, make_authority

REPO = Path(__file__).resolve().parents[2]


# -- parsing ------------------------------------------------------------------------------------
def test_both_kinds_parse_with_their_defaults():
    targets = parse_targets({
        "notify": {"https": "https://hooks.example.com/rdq?v=2", "secret": "ssm:/rdq/notify", "timeout_seconds": 20},
        "resize": {"lambda": "arn:aws:lambda:eu-west-1:123456789012:function:resize:live"},
        "local": {"https": "http://127.0.0.1:3000/hook", "secret": ["old", "env:NEW"], "on_4xx": "retry"},
    })
    assert targets["notify"] == HttpsTarget("notify", "https://hooks.example.com/rdq?v=2", (SecretRef("ssm", "/rdq/notify"),),
                                            timeout_seconds=20.0)
    assert targets["resize"] == LambdaTarget("resize", "arn:aws:lambda:eu-west-1:123456789012:function:resize:live")
    local = targets["local"]
    assert isinstance(local, HttpsTarget) and not local.dead_on_4xx
    assert local.secrets == (SecretRef("literal", "old"), SecretRef("env", "NEW"))


@pytest.mark.parametrize(("spec", "message"), [
    ({"https": "http://hooks.example.com/x", "secret": "s"}, "must be an https:// URL"),
    ({"https": "https://user:pw@hooks.example.com/x", "secret": "s"}, "must not carry credentials"),
    ({"https": "https:///x", "secret": "s"}, "needs a host"),
    ({"https": "https://hooks.example.com/ü", "secret": "s"}, "must be ASCII"),
    ({"https": "https://hooks.example.com/x"}, "\"secret\" must be"),
    ({"https": "https://hooks.example.com/x", "secret": ["a", "b", "c"]}, "\"secret\" must be"),
    ({"https": "https://hooks.example.com/x", "secret": "s", "timout_seconds": 5}, "unknown key(s) 'timout_seconds'"),
    ({"https": "https://hooks.example.com/x", "secret": "s", "timeout_seconds": 0}, "\"timeout_seconds\" must be"),
    ({"https": "https://hooks.example.com/x", "secret": "s", "retry_statuses": [500]}, "4xx status codes"),
    ({"https": "https://hooks.example.com/x", "secret": "s", "on_4xx": "ignore"}, "\"on_4xx\""),
    ({"https": "https://a.example", "lambda": "f", "secret": "s"}, "exactly one of"),
    ({"lambda": "https://evil.example/fn"}, "function name or ARN"),
    ({"lambda": "arn:aws:s3:::bucket"}, "function name or ARN"),
    ({"lambda": "fn", "dead_on_errors": "ValueError"}, "list of error type names"),
    ({"https": "https://hooks.example.com/x", "secret": "s", "ca_file": "/no/such/ca.pem"}, "a PEM file that exists"),
    ("https://hooks.example.com", "expected an object"),
])
def test_a_malformed_binding_is_refused_naming_the_handler_and_the_problem(spec, message):
    with pytest.raises(ConfigurationError) as refused:
        parse_targets({"notify": spec})
    assert "target 'notify'" in str(refused.value) and message in str(refused.value)


def test_a_bad_handler_name_or_document_is_refused():
    with pytest.raises(ConfigurationError, match="not a handler name"):
        parse_targets({"Bad Name": {"lambda": "fn"}})
    with pytest.raises(ConfigurationError, match="RDQ_TARGETS is not valid JSON"):
        targets_from_json("{not json")


# -- hosts ----------------------------------------------------------------------------------------
def test_the_lambda_host_reads_rdq_targets_and_refuses_a_bad_one_at_start(monkeypatch):
    monkeypatch.setenv("RDQ_TARGETS", json.dumps({"resize": {"lambda": "resize:live", "timeout_seconds": 30}}))
    assert Settings.from_env().targets() == {"resize": LambdaTarget("resize", "resize:live", 30.0)}
    monkeypatch.setenv("RDQ_TARGETS", json.dumps({"resize": {"lambda": "resize", "qualifier": "live"}}))
    with pytest.raises(ConfigurationError, match="unknown key"):
        Settings.from_env()


def test_a_local_host_merges_the_file_and_rdq_targets_and_refuses_a_name_bound_twice(tmp_path):
    file = tmp_path / "rdq-targets.json"
    file.write_text(json.dumps({"notify": {"https": "https://hooks.example.com/a", "secret": "s"}}))
    env = {"RDQ_TARGETS": json.dumps({"resize": {"lambda": "resize"}})}
    assert sorted(load_targets(file, env)) == ["notify", "resize"]
    assert sorted(load_targets(None, {**env, "RDQ_TARGETS_FILE": str(file)})) == ["notify", "resize"]
    with pytest.raises(ConfigurationError, match="bound both"):
        load_targets(file, {"RDQ_TARGETS": file.read_text()})
    with pytest.raises(ConfigurationError, match="cannot read the targets file"):
        load_targets(tmp_path / "missing.json", {})


def test_binding_registers_the_names_once_and_never_over_a_python_handler():
    registry = HandlerRegistry()
    targets = parse_targets({"resize": {"lambda": "resize", "timeout_seconds": 12}})
    assert bind_targets(targets, into=registry) == ["resize"]
    spec = registry.get("resize")
    assert spec is not None and spec.timeout_seconds == 12.0  # the engine fits runs to the binding's timeout
    bind_targets(targets, into=registry)  # again (a warm container): the same handler stays
    assert registry.get("resize") is spec
    with pytest.raises(ConfigurationError, match="already registered"):
        bind_targets(parse_targets({"resize": {"lambda": "other"}}), into=registry)
    registry.register("send", lambda payload, ctx: None)
    with pytest.raises(ConfigurationError, match="already registered"):
        bind_targets(parse_targets({"send": {"lambda": "send"}}), into=registry)


# -- the documented algorithm ---------------------------------------------------------------------
def _documented_vector() -> dict[str, str]:
    text = (REPO / "docs" / "targets.md").read_text()
    block = text.split("<!-- signature test vector -->", 1)[1].split("```", 2)[1]
    return dict(re.findall(r"^(\w[\w ]*?):\s+(.*)$", block, re.MULTILINE))


def test_the_test_vector_in_the_docs_is_what_rdq_signs_and_verifies():
    vector = _documented_vector()
    body = vector["body"].encode()
    secrets = [vector["secret 1"], vector["secret 2"]]
    timestamp = int(vector["timestamp"])
    assert f"Rdq-Signature: {signature_header(secrets, timestamp, body)}" == vector["header"]
    headers = {"Rdq-Signature": vector["header"].split(": ", 1)[1]}
    for secret in secrets:
        verify_signature(headers, body, secret, now=timestamp + 10)
    with pytest.raises(InvalidSignature):
        verify_signature(headers, body + b" ", secrets, now=timestamp)


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_a_node_receiver_verifies_a_real_request_with_the_documented_algorithm(tmp_path, storage):
    """What docs/targets.md tells another language to do, done in JavaScript on a request rdq sent."""
    from .test_targets_https import binding, run

    authority = make_authority(tmp_path)
    receiver = Receiver(authority)
    try:
        receiver.route("/hook", Answer(200))
        run(storage, {"notify": binding(receiver.url("/hook"), authority, secret="whsec_node")}, {"handler": "notify"})
        (request,) = receiver.received("/hook")
    finally:
        receiver.close()
    script = r"""
const crypto = require("crypto");
const [header, secret] = process.argv.slice(1);  // node -e: the arguments follow the executable
const body = require("fs").readFileSync(0);
const parts = header.split(",").map((p) => p.split("="));
const t = parts.find(([k]) => k === "t")[1];
const want = crypto.createHmac("sha256", secret).update(Buffer.concat([Buffer.from(t + "."), body])).digest();
const ok = parts.filter(([k]) => k === "v1")
  .some(([, v]) => crypto.timingSafeEqual(Buffer.from(v, "hex"), want));
process.stdout.write(ok ? "valid" : "invalid");
"""
    for secret, verdict in (("whsec_node", "valid"), ("whsec_other", "invalid")):
        done = subprocess.run(["node", "-e", script, request.headers["Rdq-Signature"], secret], input=request.body,
                              capture_output=True, timeout=30, check=True)
        assert done.stdout.decode() == verdict


# -- rdq worker -------------------------------------------------------------------------------------
def test_rdq_worker_runs_a_handler_bound_in_a_targets_file_without_any_handler_module(tmp_path):
    authority: Authority = make_authority(tmp_path)
    receiver = Receiver(authority)
    receiver.route("/hook", Answer(200, {"delivered": True}))
    (tmp_path / "rdq-targets.json").write_text(json.dumps({"notify": {
        "https": receiver.url("/hook"), "secret": "env:NOTIFY_SECRET", "ca_file": str(authority.ca_file)}}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "RDQ_LOG_LEVEL": "WARNING", "NOTIFY_SECRET": "whsec_cli"}
    for name in ("RDQ_STORAGE_URL", "RDQ_HANDLERS", "RDQ_TARGETS", "RDQ_TARGETS_FILE"):
        env.pop(name, None)

    def rdq(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "rdq_core.hosts.cli", *args], cwd=tmp_path, env=env, check=True,
                              capture_output=True, text=True, timeout=60).stdout

    rdq("migrate")
    rdq("enqueue", "hooks", "notify", "--id", "n-1", "--payload", json.dumps({"to": "ada"}))
    worker = subprocess.Popen([sys.executable, "-m", "rdq_core.hosts.cli", "worker", "--queues", "hooks"], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: json.loads(rdq("task", "show", "n-1", "--json"))["status"] == "SUCCEEDED", timeout=30,
                   what="the bound task to succeed")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(15)
        receiver.close()
    assert worker.returncode == 0, worker.stderr.read()
    assert json.loads(rdq("task", "show", "n-1", "--json"))["result"] == {"delivered": True}
    (request,) = receiver.received("/hook")
    verify_signature(request.headers, request.body, "whsec_cli")
    # A file that binds badly stops the start with a usage error naming it.
    (tmp_path / "rdq-targets.json").write_text(json.dumps({"notify": {"https": "http://example.com/", "secret": "s"}}))
    refused = subprocess.run([sys.executable, "-m", "rdq_core.hosts.cli", "worker"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "must be an https:// URL" in refused.stderr
    assert "Traceback" not in refused.stderr


# -- the Lambda worker ------------------------------------------------------------------------------
def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RDQ_")}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO / "functions" / "worker", capture_output=True,
                          text=True, timeout=60, env={**base, "PYTHONPATH": str(REPO), **env})


def test_the_worker_functions_entry_point_binds_rdq_targets_and_a_bad_binding_fails_its_cold_start():
    code = "import app; from rdq_core.engine.handlers import registry; print(registry.names())"
    bindings = json.dumps({"resize": {"lambda": "resize:live"}, "notify": {"https": "https://h.example/", "secret": "s"}})
    done = _python(code, RDQ_TARGETS=bindings, RDQ_HANDLERS="")
    assert done.returncode == 0, done.stderr
    assert "'notify'" in done.stdout and "'resize'" in done.stdout
    refused = _python(code, RDQ_TARGETS=json.dumps({"resize": {"lambda": "resize", "role": "admin"}}))
    assert refused.returncode != 0 and "unknown key(s) 'role'" in refused.stderr


def test_rdq_invoke_worker_runs_a_task_bound_in_rdq_targets_through_the_lambda_host(tmp_path):
    """One local invocation of the Lambda worker (its deadline-driven runner, not rdq worker's)."""
    authority = make_authority(tmp_path)
    receiver = Receiver(authority)
    receiver.route("/hook", Answer(200, {"via": "lambda host"}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDQ_")}
    env.update({"PYTHONPATH": str(REPO), "RDQ_LOG_LEVEL": "WARNING", "RDQ_WAKE_WORKER": "false",
                "RDQ_TARGETS": json.dumps({"notify": {"https": receiver.url("/hook"), "secret": "whsec_invoke",
                                                      "ca_file": str(authority.ca_file)}})})

    def rdq(*args: str, stdin: str | None = None) -> str:
        return subprocess.run([sys.executable, "-m", "rdq_core.hosts.cli", *args], cwd=tmp_path, env=env, check=True,
                              capture_output=True, text=True, timeout=60, input=stdin).stdout

    try:
        rdq("migrate")
        rdq("enqueue", "hooks", "notify", "--id", "n-1")
        rdq("invoke", "worker", "-", "--timeout", "30",
            stdin=json.dumps({"source": "aws.events", "detail-type": "Scheduled Event", "detail": {}}))
        shown = json.loads(rdq("task", "show", "n-1", "--json"))
    finally:
        receiver.close()
    assert (shown["status"], shown["result"]) == ("SUCCEEDED", {"via": "lambda host"})
    (request,) = receiver.received("/hook")
    verify_signature(request.headers, request.body, "whsec_invoke")
