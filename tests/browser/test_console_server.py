"""The console's two servers over plain HTTP (no browser): the static files ``rdq dev`` and
``rdq console`` serve and their headers, and what ``rdq console`` refuses, forwards and passes back."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from rdq_core.hosts.console.assets import ASSETS
from rdq_core.hosts.console.server import canonical_query
from tests.browser.conftest import ConsoleProcess
from tests.loopback import raw_request as request
from tests.loopback import without_rdq_settings
from tests.rdq_servers import REPO, DevServer, Proxy

TOKEN = "console-server-token-3"




@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    server = DevServer(tmp_path_factory.mktemp("console-server-dev"), token=TOKEN)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def recorder(dev: DevServer) -> Iterator[Proxy]:
    """A plain proxy in front of rdq dev that records the headers each request arrived with."""
    proxy = Proxy(dev)
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def console(recorder: Proxy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConsoleProcess]:
    process = ConsoleProcess(tmp_path_factory.mktemp("console"), recorder.url, "--token", "upstream-token-9")
    try:
        yield process
    finally:
        process.stop()


def check_static(port: int) -> None:
    for path, (_, content_type) in ASSETS.items():
        status, headers, body = request(port, "GET", path)
        assert status == 200 and body, path
        assert headers["content-type"] == content_type
        assert headers["cache-control"] == "no-cache"
        assert headers["x-content-type-options"] == "nosniff"
        policy = headers["content-security-policy"]
        assert "default-src 'self'" in policy and "script-src 'self'" in policy and "unsafe" not in policy
        head_status, head_headers, head_body = request(port, "HEAD", path)
        assert (head_status, head_body, head_headers["content-length"]) == (200, b"", str(len(body)))
        if path.endswith((".html", ".js", ".css")) or path == "/":
            # uPlot's licence banner names its home page: a comment, never a request.
            text = body.replace(b"https://github.com/leeoniya/uPlot", b"") if "/vendor/uplot/" in path else body
            assert b"http://" not in text and b"https://" not in text, f"{path} names another origin"
    _, _, index = request(port, "GET", "/index.html?from=bookmark")
    assert b'<script src="app.js" defer>' in index and b'href="app.css"' in index  # relative: any prefix works
    for path in ("/../pyproject.toml", "/static/app.js", "/app.js/", "/%2e%2e/pyproject.toml", "/static/../app.js",
                 "//etc/passwd", "/console/static/index.html", "/assets.py"):
        status, headers, body = request(port, "GET", path)
        assert status in (401, 404), (path, status)
        assert b"[project]" not in body and b"def asset_for" not in body and b"<script" not in body


def test_rdq_dev_serves_the_console_without_its_token_and_the_api_only_with_it(dev: DevServer) -> None:
    check_static(dev.port)
    assert request(dev.port, "GET", "/v1/queues")[0] == 401
    assert request(dev.port, "GET", "/v1/queues", {"Authorization": f"Bearer {TOKEN}"})[0] == 200
    assert request(dev.port, "POST", "/", body=b"{}")[0] in (401, 404, 405)  # only GET/HEAD are static
    assert "  console: " + dev.url + "/" in dev.out.read_text()


def test_rdq_dev_without_a_token_keeps_its_host_check_for_the_console_too(tmp_path: Path) -> None:
    server = DevServer(tmp_path)
    try:
        assert request(server.port, "GET", "/")[0] == 200
        assert request(server.port, "GET", "/", {"Host": "attacker.example"})[0] == 421
        assert request(server.port, "GET", "/app.js", {"Origin": "http://attacker.example"})[0] == 403
    finally:
        server.stop()


def test_rdq_console_serves_the_same_files(console: ConsoleProcess) -> None:
    check_static(console.port)
    assert f"rdq console: {console.url}/?token={console.token}" in console.out.read_text()


def test_rdq_console_forwards_with_its_own_credentials_only(console: ConsoleProcess, recorder: Proxy) -> None:
    recorder.seen.clear()
    body = json.dumps({"handler": "greet", "payload": {"name": "Lin"}, "delay_seconds": 3600}).encode()
    status, headers, answer = request(console.port, "POST", "/v1/queues/console-forward/tasks", {
        "Content-Type": "application/json", **console.auth, "Cookie": "session=abc",
        "X-Forwarded-For": "10.0.0.1", "Origin": f"http://127.0.0.1:{console.port}"}, body)
    assert status == 201 and json.loads(answer)["queue"] == "console-forward"
    assert headers["content-type"] == "application/json"
    arrived = recorder.seen[-1]
    assert arrived["Authorization"] == "Bearer upstream-token-9"
    assert not {"Cookie", "X-Forwarded-For", "Origin"} & set(arrived)
    assert console.token not in json.dumps(recorder.seen)  # the page's session token stays here


def test_rdq_console_passes_api_errors_back_as_they_are(console: ConsoleProcess, dev: DevServer) -> None:
    direct = request(dev.port, "GET", "/v1/tasks/no-such-task", {"Authorization": f"Bearer {TOKEN}"})
    through = request(console.port, "GET", "/v1/tasks/no-such-task", console.auth)
    assert through[0] == direct[0] == 404
    assert json.loads(through[2]) == json.loads(direct[2])
    assert through[1]["content-type"].startswith("application/problem+json")
    status, _, answer = request(console.port, "GET", "/v1/queues/q/dlq?limit=5&error_type=Some+Error", console.auth)
    assert status == 200 and json.loads(answer)["tasks"] == []


@pytest.mark.parametrize(("headers", "status"), [
    ({"Host": "attacker.example"}, 421),
    ({"Host": "attacker.example:8788"}, 421),
    ({"Origin": "http://attacker.example"}, 403),
    ({"Origin": "http://127.0.0.1:1"}, 403),  # another local page, another port
    ({"Origin": "null"}, 403),
    ({"Sec-Fetch-Site": "cross-site"}, 403),
    ({"Sec-Fetch-Site": "same-site"}, 403),
])
def test_rdq_console_refuses_other_hosts_and_origins(console: ConsoleProcess, recorder: Proxy,
                                                    headers: dict[str, str], status: int) -> None:
    before = len(recorder.seen)
    answer = request(console.port, "POST", "/v1/queues/refused/tasks",
                     {"Content-Type": "application/json", **console.auth, **headers}, b'{"handler": "greet"}')
    assert answer[0] == status
    assert answer[1]["content-type"] == "application/problem+json"
    assert len(recorder.seen) == before  # nothing was forwarded
    if "Sec-Fetch-Site" in headers:  # a link from another site may open the page itself, which holds no data
        assert request(console.port, "GET", "/", headers)[0] == 200


def test_rdq_console_bounds_bodies_and_paths(console: ConsoleProcess, recorder: Proxy) -> None:
    before = len(recorder.seen)
    with socket.create_connection(("127.0.0.1", console.port), timeout=10) as sock:  # declared, never sent
        sock.sendall(b"POST /v1/queues/big/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {console.token}\r\n".encode()
                     + b"Content-Length: 50000000\r\n\r\n" + b"x" * 1024)
        assert sock.makefile("rb").readline().split()[1] == b"413"
    try:
        status: int | None = request(console.port, "POST", "/v1/queues/big/tasks",
                                     {"Content-Type": "application/json", **console.auth}, b"x" * (3 * 1024 * 1024))[0]
    except (BrokenPipeError, ConnectionResetError):
        status = None  # it answered 413 and closed while the client was still sending: also a refusal
    assert status in (413, None)
    assert request(console.port, "GET", "/v2/queues", console.auth)[0] == 404
    assert request(console.port, "GET", "/openapi.json", console.auth)[0] == 404
    assert request(console.port, "GET", "/v1/../v1/queues", console.auth)[0] == 404
    assert request(console.port, "POST", "/v1/queues/x/tasks", {"Transfer-Encoding": "chunked", **console.auth})[0] == 411
    assert len(recorder.seen) == before


def test_an_unreachable_api_is_a_502_problem(tmp_path: Path) -> None:
    with socket.socket() as placeholder:  # bound, never listening: nothing answers there
        placeholder.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{placeholder.getsockname()[1]}/prod"
        process = ConsoleProcess(tmp_path, url, "--api-key", "key-not-shown-7")
        try:
            status, headers, body = request(process.port, "GET", "/v1/queues", process.auth)
        finally:
            process.stop()
    problem: dict[str, Any] = json.loads(body)
    assert status == 502 and headers["content-type"] == "application/problem+json"
    assert problem["status"] == 502 and "could not be reached" in problem["detail"]
    assert "key-not-shown-7" not in body.decode() and "key-not-shown-7" not in process.out.read_text()


def test_the_query_string_is_signed_in_its_canonical_form() -> None:
    assert canonical_query("error_type=Some+Error&limit=5") == "error_type=Some%20Error&limit=5"
    assert canonical_query("cursor=a%2Fb%3D&handler=") == "cursor=a%2Fb%3D&handler="
    assert canonical_query("") == ""


def test_rdq_console_without_credentials_stops_at_start_with_the_reason(tmp_path: Path) -> None:
    environ = {name: value for name, value in without_rdq_settings(os.environ).items() if not name.startswith("AWS_")}
    environ.update({"PYTHONPATH": str(REPO), "AWS_CONFIG_FILE": str(tmp_path / "none"),
                    "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_EC2_METADATA_DISABLED": "true"})
    for extra, reason in ((), "no AWS credentials"), (("--profile", "no-such-profile"), "no-such-profile"):
        finished = subprocess.run(
            [sys.executable, "-m", "rdq_core.hosts.cli", "console", "--api", "https://abc.execute-api.eu-west-1.amazonaws.com/prod",
             "--region", "eu-west-1", "--port", "0", *extra],
            cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=60)
        assert finished.returncode == 2 and reason in finished.stderr, finished.stderr
        assert "rdq console: http" not in finished.stdout


def test_every_served_file_is_package_data() -> None:
    """What the console serves must ship in the wheel: each file in ``ASSETS`` matches one of the
    package-data patterns pyproject.toml gives ``rdq_core.hosts.console``."""
    import fnmatch
    import tomllib

    from tests.rdq_servers import REPO

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["rdq_core.hosts.console"]
    for path, (name, _) in ASSETS.items():
        file = f"static/{name}"
        assert (REPO / "rdq_core" / "hosts" / "console" / file).is_file(), file
        assert any(fnmatch.fnmatchcase(file, pattern) and "/" not in file[len(pattern.rsplit("/", 1)[0]) + 1:]
                   for pattern in patterns), f"{path}: {file} is not package data"
    assert (REPO / "rdq_core" / "hosts" / "console" / "static" / "vendor" / "uplot" / "LICENSE").is_file()
