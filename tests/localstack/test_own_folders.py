"""The suite's LocalStack keeps what it unpacks to itself: the legacy executor extracts function
code and writes its scripts into ``config.dirs.tmp``, which defaults to ``/var/lib/localstack/tmp``
when LocalStack believes it runs in a container (any container: ``/.dockerenv``) and to
``.filesystem`` inside the installed package otherwise: folders every LocalStack of the machine
or of that virtualenv shares, and each clears on start and stop. ``localstack_host`` roots them
in the run's own folder (host mode, ``FILESYSTEM_ROOT``)."""

from __future__ import annotations

import io
import json
import subprocess
import uuid
import zipfile
from pathlib import Path

import pytest

from .conftest import aws, wait_for
from .localstack_host import LocalStackProcess, venv_path

pytestmark = [pytest.mark.localstack, pytest.mark.timeout(600)]

HANDLER = "import os\n\ndef handler(event, context):\n    return {'file': __file__, 'cwd': os.getcwd()}\n"


def shared_runtime_folders() -> list[Path]:
    """``dirs.tmp`` of a LocalStack of this virtualenv left to its defaults, in and out of a container."""
    probe = subprocess.run([str(venv_path() / "bin" / "python"), "-c",
                            "from localstack import constants; print(constants.LOCALSTACK_ROOT_FOLDER)"],
                           capture_output=True, text=True, timeout=60, check=True)
    return [Path("/var/lib/localstack/tmp"), Path(probe.stdout.strip()) / ".filesystem"]


def entries(folders: list[Path]) -> set[str]:
    return {str(path) for folder in folders if folder.exists() for path in folder.rglob("*")}


def test_function_code_is_unpacked_inside_the_runs_own_folder(localstack: LocalStackProcess) -> None:
    shared = shared_runtime_folders()
    before = entries(shared)
    code = io.BytesIO()
    with zipfile.ZipFile(code, "w") as archive:
        archive.writestr("where_am_i.py", HANDLER)
    name = f"rdq-own-folder-{uuid.uuid4().hex[:8]}"
    functions = aws(localstack, "lambda")
    functions.create_function(FunctionName=name, Runtime="python3.11", Handler="where_am_i.handler",
                              Role="arn:aws:iam::000000000000:role/rdq-test", Code={"ZipFile": code.getvalue()}, Timeout=30)
    try:
        wait_for("the function to be active",
                 lambda: functions.get_function(FunctionName=name)["Configuration"].get("State", "Active") == "Active", 60)
        answer = functions.invoke(FunctionName=name, Payload=b"{}")
        where = json.loads(answer["Payload"].read())
    finally:
        functions.delete_function(FunctionName=name)
    own = localstack.filesystem_root.resolve()
    assert Path(where["file"]).resolve().is_relative_to(own), (where, own)
    assert Path(where["cwd"]).resolve().is_relative_to(own), (where, own)
    assert entries(shared) <= before, f"LocalStack wrote into a shared folder: {sorted(entries(shared) - before)[:5]}"
