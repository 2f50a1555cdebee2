"""A newcomer's first hour, setting rdq up: what they run is what these tests run, the README's
commands included (its demo block line by line against a real ``rdq dev``, its command reference
against the real parser, its test commands against the suite's own markers).

Each test here once failed a new user: a database driver the quick start does not install, a
loopback API that asked for AWS credentials, options missing from the command reference, an
``rdq invoke`` event without its HTTP fields, lifecycle events the demo did not show, and a
scratch database an interrupted test run left behind (``test_first_hour_scratch_databases.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rdq_core.hosts.cli import build_parser
from rdq_core.compliance.support import wait_until
from tests.loopback import without_rdq_settings
from tests.rdq_servers import dev_server

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
RDQ = shutil.which("rdq") or pytest.fail("the rdq executable is not installed (python -m pip install -e .)")

#: ``python -c`` prelude that makes the named top-level modules unimportable, as in an
#: environment where they were never installed.
HIDE_MODULES = textwrap.dedent('''
    import sys
    HIDDEN = set(sys.argv.pop(1).split(","))

    class NotInstalled:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HIDDEN:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
''')


def newcomer_environment(workdir: Path) -> dict[str, str]:
    """A shell with no rdq settings and no AWS credentials anywhere botocore would look."""
    env = {k: v for k, v in without_rdq_settings(os.environ).items() if not k.startswith("AWS_")}
    env.update({"AWS_CONFIG_FILE": str(workdir / "no-aws-config"), "AWS_SHARED_CREDENTIALS_FILE": str(workdir / "no-aws"),
                "AWS_EC2_METADATA_DISABLED": "true", "PYTHONPATH": str(REPO)})
    return env


# -- a missing database driver -------------------------------------------------------------------

@pytest.mark.parametrize("url, driver, extra", [
    ("postgresql://postgres@127.0.0.1:5432/postgres", "psycopg", "postgres"),
    ("redis://127.0.0.1:6379/0", "redis", "redis"),
    ("mongodb://127.0.0.1:27017/rdq", "pymongo", "mongo"),
])
def test_rdq_migrate_without_the_driver_is_a_configuration_error_naming_the_install(tmp_path, url, driver, extra):
    program = HIDE_MODULES + "from rdq_core.hosts.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    done = subprocess.run([sys.executable, "-c", program, driver, "--storage", url, "migrate"], cwd=REPO,
                          env=newcomer_environment(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"needs the {driver} driver" in done.stderr and f"python -m pip install -e '.[{extra}]'" in done.stderr
    assert "unexpected" not in done.stderr and "ModuleNotFoundError" not in done.stderr


def test_client_without_the_driver_raises_a_configuration_error_naming_the_install(tmp_path):
    program = HIDE_MODULES + textwrap.dedent('''
        from rdq_core import Client
        from rdq_core.errors import ConfigurationError
        try:
            Client("postgresql://app@db/app")
        except ConfigurationError as exc:
            print(exc)
    ''')
    done = subprocess.run([sys.executable, "-c", program, "psycopg"], cwd=tmp_path, env=newcomer_environment(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # Outside the clone's directory the command names the clone's path.
    assert f"python -m pip install -e '{REPO}[postgres]'" in done.stdout, done.stdout


def test_the_readme_puts_the_driver_install_beside_the_client_line():
    lines = README.splitlines()
    at = next(i for i, line in enumerate(lines) if 'Client("postgresql://' in line)
    nearby = "\n".join(lines[at - 2:at + 4])
    assert "pip install 'rdq[postgres]'" in nearby and "pip install -e '.[postgres]'" in nearby


# -- the README's demo, against a real rdq dev ------------------------------------------------------

def readme_demo_lines() -> list[str]:
    """The commands of the block the README asks to paste while ``rdq dev`` runs."""
    block = README.split("With it running, paste", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_the_readme_demo_shows_both_dead_events_and_the_redrive_through_the_cli_and_the_api(tmp_path):
    """Pasted as written, in a shell without AWS credentials: the CLI's redrive writes its event
    as the API's would, ``rdq --api`` reaches the loopback dev API without credentials, and the
    final ``curl`` shows both dead tasks and the redrive within the 5 s delivery the README states."""
    lines = readme_demo_lines()
    assert lines[-1].startswith("curl -s http://127.0.0.1:8787/v1/events"), lines[-1]
    assert "5 s" in README.split("With it running, paste", 1)[1].split("## Using it", 1)[0]
    env = newcomer_environment(tmp_path)
    # rdq dev's defaults as the README states them: the worker every 1 s, the reaper every 5 s.
    with dev_server(tmp_path, storage_url=f"sqlite:///{tmp_path}/rdq.db",
                    env={"RDQ_DEV_WORKER_EVERY_SECONDS": "1", "RDQ_DEV_REAPER_EVERY_SECONDS": "5"}) as dev:
        here = f"127.0.0.1:{dev.port}"
        script = "set -euo pipefail\n" + "\n".join(line.replace("127.0.0.1:8787", here) for line in lines[:-1])
        ran = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert "SUCCEEDED" in ran.stdout and re.search(r"^demo\s+pending=", ran.stdout, re.M), ran.stdout
        assert "credentials" not in ran.stderr

        def events() -> dict[str, list[str]] | None:
            shown = subprocess.run(["bash", "-c", lines[-1].replace("127.0.0.1:8787", here)], env=env,
                                   capture_output=True, text=True, timeout=30)
            seen: dict[str, list[str]] = {}
            for event in json.loads(shown.stdout)["events"]:
                seen.setdefault(event["type"], []).append(event["task_id"])
            return seen if len(seen.get("rdq.task.dead", [])) == 2 and seen.get("rdq.task.redriven") else None

        seen = wait_until(events, timeout=12, interval=0.5, what="the demo's events at /v1/events")
    assert seen["rdq.task.redriven"] == ["needs-a-fix"] and "needs-a-fix" in seen["rdq.task.dead"]


# -- rdq --api against rdq dev: no AWS credentials needed on loopback ------------------------------

def test_rdq_api_reaches_a_loopback_rdq_dev_without_aws_credentials_and_signs_elsewhere(tmp_path):
    env = newcomer_environment(tmp_path)
    with dev_server(tmp_path) as dev:
        subprocess.run([RDQ, "--storage", dev.storage_url, "enqueue", "mail", "greet", "--delay", "600"], cwd=tmp_path,
                       env=env, check=True, capture_output=True, timeout=60)
        listed = subprocess.run([RDQ, "--api", dev.url, "queues", "--json"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert [q["queue"] for q in json.loads(listed.stdout)["queues"]] == ["mail"]
        # Asking for SigV4 on loopback still signs: with no credentials that is refused, and says why.
        signed = subprocess.run([RDQ, "--api", dev.url, "--region", "us-east-1", "queues"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=60)
        assert signed.returncode == 1 and "no AWS credentials found" in signed.stderr, signed.stderr
    elsewhere = subprocess.run([RDQ, "--api", "https://abc.execute-api.eu-west-1.amazonaws.com/prod", "queues"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert elsewhere.returncode == 1 and "no AWS credentials found" in elsewhere.stderr, elsewhere.stderr


def test_http_client_defaults_match_what_the_readme_says():
    from rdq_core.http_client import HttpClient, NoAuth, SigV4

    assert isinstance(HttpClient("http://127.0.0.1:8787").auth, NoAuth)
    assert isinstance(HttpClient("http://[::1]:8787").auth, NoAuth)
    assert isinstance(HttpClient("https://abc.execute-api.eu-west-1.amazonaws.com/prod").auth, SigV4)
    said = " ".join(README.split("`rdq_core.HttpClient(api_url)`", 1)[1].split("\n\n", 1)[0].split())
    assert "by default SigV4" in said and "no credentials for an API on a loopback address" in said


# -- the command reference ----------------------------------------------------------------------

def parser_options(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], list[str]]:
    """Every command path (``("dlq", "redrive")``) with the long options its parser takes."""
    found: dict[tuple[str, ...], list[str]] = {path: []}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(parser_options(sub, (*path, name)))
        elif action.option_strings and action.help != argparse.SUPPRESS:
            found[path] += [o for o in action.option_strings if o.startswith("--") and o != "--help"][:1]
    return found


def readme_command_entries() -> list[str]:
    """The README's command reference, one entry per ``rdq …`` form: comments dropped, indented
    continuation lines joined to their command, ``a | rdq b`` split in two."""
    block = README.split("### Command line\n\n```\n", 1)[1].split("```", 1)[0]
    joined: list[str] = []
    for line in block.splitlines():
        text = line.split("  #", 1)[0].rstrip()
        if line.startswith((" ", "\t")) and joined:
            joined[-1] += " " + text.strip()
        elif text:
            joined.append(text)
    return [part if part.startswith("rdq") else "rdq " + part for line in joined for part in line.split(" | rdq ")]


def test_every_option_the_parser_takes_is_in_the_readme_command_reference():
    entries = readme_command_entries()
    missing = []
    for path, options in parser_options(build_parser()).items():
        if not path:  # global options: anywhere in the reference
            where = [" ".join(entries)]
        else:
            between = r"(?:\s+[\[(][^\])]*[\])])*\s+"  # optional [--option VALUE] groups between the words
            form = re.compile(r"^rdq" + between + between.join(map(re.escape, path)) + r"(?:\s|$)")
            where = [entry for entry in entries if form.search(entry)]
            if not where:
                missing.append(f"rdq {' '.join(path)} (the command itself)")
                continue
        # --json is said once for all the commands that take it.
        missing += [f"rdq {' '.join(path)} {option}" for option in options
                    if option != "--json" and not any(re.search(re.escape(option) + r"(?![\w-])", w) for w in where)]
    assert not missing, "README's command reference lacks: " + ", ".join(missing)
    assert "take `--json`" in README


def test_rdq_invoke_api_with_an_event_that_is_not_a_proxy_event_is_an_input_error(tmp_path):
    env = newcomer_environment(tmp_path)
    done = subprocess.run(f"echo '{{}}' | '{RDQ}' invoke api -", shell=True, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "not an API Gateway REST proxy event" in done.stderr and "httpMethod" in done.stderr
    assert "unexpected" not in done.stderr and "KeyError" not in done.stderr
    wrong = subprocess.run([RDQ, "invoke", "api", "-"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
                           input='{"httpMethod": "GET", "path": "/v1/queues", "headers": ["x"]}')
    assert wrong.returncode == 2 and "'headers' must be null or an object of strings" in wrong.stderr, wrong.stderr
    fine = subprocess.run([RDQ, "invoke", "api", "-"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
                          input='{"httpMethod": "GET", "path": "/v1/queues"}')
    assert fine.returncode == 0 and json.loads(fine.stdout)["statusCode"] == 200, fine.stderr


def test_the_serverless_local_flows_show_rdq_invoke():
    local_flows = (REPO / "docs" / "serverless.md").read_text().split("## Local flows", 1)[1].split("\n## ", 1)[0]
    assert "rdq invoke api events/api-enqueue.json" in local_flows
    assert "rdq invoke worker events/worker-scheduled.json" in local_flows
