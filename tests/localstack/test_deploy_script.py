"""infra/localstack/: deploy.sh run against stand-ins for its tools (what it calls and prints),
and the compose file's network and ports. Runs in the default suite (no Docker needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "infra" / "localstack" / "deploy.sh"
COMPOSE = REPO / "infra" / "localstack" / "docker-compose.yml"

# Each stand-in appends its argv (and RDQ_BUNDLE) to calls.log; awslocal answers the queries
# deploy.sh makes, as LocalStack would.
STUBS = {
    "samlocal": 'echo "samlocal RDQ_BUNDLE=${RDQ_BUNDLE:-} $*" >> "$CALLS"',
    "rdq": 'echo "rdq $*" >> "$CALLS"',
    "curl": 'echo "curl $*" >> "$CALLS"',
    "awslocal": '''echo "awslocal $*" >> "$CALLS"
case "$*" in
  *OutputKey==\\'ApiId\\'*) echo abc123 ;;
  *OutputKey==\\'ApiKeyId\\'*) echo key-of-this-stack ;;
  *"get-api-key --api-key key-of-this-stack"*) echo the-key-value ;;
  *get-api-keys*) echo some-other-stacks-key ;;
esac''',
}


def _stub_path(tmp_path: Path, leave_out: str = "") -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        if name != leave_out:
            stub = bin_dir / name
            stub.write_text(f"#!/usr/bin/env bash\n{body}\n")
            stub.chmod(0o755)
    for tool in ("bash", "make", "dirname", "env", "cat"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return bin_dir


def _run(tmp_path: Path, *args: str, leave_out: str = "") -> tuple[subprocess.CompletedProcess[str], list[str]]:
    calls = tmp_path / "calls.log"
    env = {"PATH": str(_stub_path(tmp_path, leave_out)), "CALLS": str(calls), "HOME": str(tmp_path)}
    result = subprocess.run([shutil.which("bash") or "bash", str(SCRIPT), *args], capture_output=True, text=True,
                            env=env, timeout=60)
    return result, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize("backend, storage_backend, service", [("postgres", "postgresql", "postgres"),
                                                               ("redis", "redis", "redis"), ("mongo", "mongodb", "mongo")])
def test_deploy_builds_bundled_and_prints_the_path_style_url_and_this_stacks_key(tmp_path, backend, storage_backend,
                                                                                   service):
    result, calls = _run(tmp_path, backend)
    assert result.returncode == 0, result.stderr
    build = [c for c in calls if c.startswith("samlocal") and " build" in c]
    assert build == [f"samlocal RDQ_BUNDLE={storage_backend} build"]
    (deploy,) = [c for c in calls if c.startswith("samlocal") and " deploy" in c]
    assert "Packaging=bundled" in deploy and f"StorageBackend={storage_backend}" in deploy
    # The functions address the store by its compose service name; this machine by 127.0.0.1.
    (put,) = [c for c in calls if "ssm put-parameter" in c]
    function_url = put.split("--value ")[1].split()[0]
    assert urlsplit(function_url).hostname == service
    assert service in yaml.safe_load(COMPOSE.read_text())["services"]
    (migrate,) = [c for c in calls if c.startswith("rdq ")]
    assert urlsplit(migrate.split("--storage ")[1].split()[0]).hostname == "127.0.0.1"
    # The key is the stack's own (output ApiKeyId), never whichever key the account lists first.
    assert not any("get-api-keys" in c for c in calls)
    assert "API key: the-key-value" in result.stdout
    assert "API: http://127.0.0.1:4566/restapis/abc123/prod/_user_request_/v1/openapi.json" in result.stdout


@pytest.mark.parametrize("missing", ["samlocal", "awslocal", "rdq"])
def test_deploy_names_a_missing_prerequisite_before_doing_anything(tmp_path, missing):
    result, calls = _run(tmp_path, "postgres", leave_out=missing)
    assert result.returncode == 2 and f"needs '{missing}'" in result.stderr and "pip install" in result.stderr
    assert calls == []


def test_compose_publishes_on_loopback_only_and_puts_lambda_containers_on_its_network():
    compose = yaml.safe_load(COMPOSE.read_text())
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
    network = compose["networks"]["default"]["name"]
    assert compose["services"]["localstack"]["environment"]["LAMBDA_DOCKER_NETWORK"] == network
    assert "host.docker.internal" not in SCRIPT.read_text(), "not resolvable from Lambda containers on Linux"


def test_deploy_script_is_valid_bash():
    assert subprocess.run([shutil.which("bash") or "bash", "-n", str(SCRIPT)]).returncode == 0
    assert os.access(SCRIPT, os.X_OK)
