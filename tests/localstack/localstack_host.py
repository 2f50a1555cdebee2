"""LocalStack 2.3.2 in host mode, owned by the test run: a cached virtualenv, one process on a
free 127.0.0.1 port with its own temporary, volume and filesystem folders (where the legacy
executor unpacks function code), stopped by its PID.

Why 2.3.2: it is the last release whose legacy Lambda provider runs Python functions without
Docker (``PROVIDER_OVERRIDE_LAMBDA=legacy``, ``LAMBDA_EXECUTOR=local``: each invocation is a
fork of the LocalStack process, on its Python 3.11). Its install needs the pins in
``requirements-localstack-2.3.2.txt``.

Usable as a script too: ``python tests/localstack/localstack_host.py`` creates the virtualenv
(idempotent) and prints its path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements-localstack-2.3.2.txt"
DEFAULT_VENV = Path.home() / ".cache" / "rdq-localstack-2.3.2"
SERVICES = "lambda,apigateway,events,logs,iam,sts,s3,cloudformation,secretsmanager,ssm,cloudwatch"


def venv_path() -> Path:
    return Path(os.environ.get("RDQ_LOCALSTACK_VENV") or DEFAULT_VENV)


def _python311() -> str:
    """LocalStack 2.3.2 and the functions it forks run on Python 3.11."""
    candidates = [sys.executable, shutil.which("python3.11") or ""]
    root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    candidates += [str(p) for p in sorted(Path(root).glob("versions/3.11*/bin/python3.11"), reverse=True)]
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 11)"],
                               capture_output=True, timeout=30)
        if probe.returncode == 0:
            return candidate
    raise RuntimeError("LocalStack 2.3.2 needs a Python 3.11 (python3.11 on PATH or in pyenv)")


def ensure_venv(log: Callable[[str], object] = print) -> Path:
    """The virtualenv with the pinned LocalStack, created once; a stamp of the pins' hash says
    it is complete (an interrupted install is redone, not trusted)."""
    venv = venv_path()
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    stamp = venv / ".rdq-requirements-sha256"
    if stamp.exists() and stamp.read_text().strip() == digest and (venv / "bin" / "python").exists():
        return venv
    log(f"creating the LocalStack 2.3.2 virtualenv in {venv} (once)")
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([_python311(), "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "-r", str(REQUIREMENTS)], check=True)
    stamp.write_text(digest)
    return venv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalStackProcess:
    """One LocalStack, started and stopped by this object only."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        self.log_path = workdir / "localstack.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def filesystem_root(self) -> Path:
        """Where this LocalStack keeps its runtime folders (``config.dirs``): their ``tmp`` (function
        code unpacked by the legacy executor, cleared on start and stop) would otherwise be
        ``/var/lib/localstack/tmp`` inside a container, or ``.filesystem`` in the installed package
        elsewhere, shared by every LocalStack of the machine or of the virtualenv."""
        return self.workdir / "filesystem"

    def environment(self) -> dict[str, str]:
        tmp = self.workdir / "tmp"
        volume = self.workdir / "volume"
        for folder in (tmp, volume, self.filesystem_root):
            folder.mkdir(parents=True, exist_ok=True)
        return {
            **os.environ,
            "GATEWAY_LISTEN": f"127.0.0.1:{self.port}",
            "PROVIDER_OVERRIDE_LAMBDA": "legacy",
            "LAMBDA_EXECUTOR": "local",
            "SERVICES": SERVICES,
            # Its own folders: LocalStack clears its tmp folder on start and stop.
            "TMPDIR": str(tmp),
            "LOCALSTACK_VOLUME_DIR": str(volume),
            # Its runtime folders (config.dirs: the unpacked function code, the scripts the legacy
            # executor writes) under FILESYSTEM_ROOT. That holds in host mode only: LocalStack
            # takes any container it runs in (/.dockerenv) for its own and then uses the fixed
            # /var/lib/localstack, shared by every LocalStack on the machine. It runs on this
            # host's Python, not in its image: OVERRIDE_IN_DOCKER says so.
            "OVERRIDE_IN_DOCKER": "0",
            "FILESYSTEM_ROOT": str(self.filesystem_root),
            "SKIP_INFRA_DOWNLOADS": "1",
            "DISABLE_EVENTS": "1",
            "SKIP_SSL_CERT_DOWNLOAD": "1",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self, venv: Path, timeout: float = 180.0) -> None:
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [str(venv / "bin" / "python"), "-m", "localstack.cli.main", "start", "--host", "--no-banner"],
            stdout=log, stderr=subprocess.STDOUT, env=self.environment(), cwd=self.workdir,
            start_new_session=True,  # its forks share its process group, stopped with it
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"LocalStack exited with {self.process.returncode}:\n{self.tail()}")
            if self.ready():
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"LocalStack not ready after {timeout:g}s:\n{self.tail()}")

    def ready(self) -> bool:
        """The gateway answers its health route, and no service it was asked for is in error."""
        try:
            with urllib.request.urlopen(f"{self.endpoint}/_localstack/health", timeout=2) as reply:
                services = json.loads(reply.read().decode()).get("services", {})
        except (OSError, ValueError):
            return False
        wanted = SERVICES.split(",")
        return all(services.get(name) in ("available", "running") for name in wanted)

    def tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the process group this object started (LocalStack and its Lambda forks), then SIGKILL."""
        if self.process is None or self.process.poll() is not None:
            return
        pgid = self.process.pid  # start_new_session: the group id is the PID we started
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait(timeout=10)


if __name__ == "__main__":
    started = time.monotonic()
    print(ensure_venv(), f"({time.monotonic() - started:.1f}s)")
