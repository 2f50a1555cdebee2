"""Attacks on ``rdq dev``'s own HTTP server, over real sockets against a real ``rdq dev``:
DNS rebinding (a foreign ``Host``), slow bodies (held connections, before and after
authentication), and request smuggling through ``Transfer-Encoding``."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from rdq_core.compliance.support import wait_until
from rdq_core.hosts.localhttp import IDLE_TIMEOUT_SECONDS, MAX_CONNECTIONS

from .conftest import PROBLEM_JSON


# -- raw HTTP ----------------------------------------------------------------------------------
def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes, bytes]:
    """One response from ``sock``: (status, headers, body, whatever followed it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if ": " in line)}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:length], rest[length:]


def _exchange(server, data: bytes, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(data)
        status, headers, body, _ = _read_response(sock)
    return status, headers, body


def _get(path: str, host: str | None, extra: str = "", token: str | None = None) -> bytes:
    lines = [f"GET {path} HTTP/1.1"]
    if host is not None:
        lines.append(f"Host: {host}")
    if token:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(lines) + "\r\n" + extra + "Connection: close\r\n\r\n").encode()


def _post(path: str, host: str, body: dict, token: str | None = None, extra: str = "") -> bytes:
    raw = json.dumps(body).encode()
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{auth}{extra}Content-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n").encode() + raw


def _stats(server, queue: str) -> dict:
    status, _, body = server.request("GET", f"/v1/queues/{queue}/stats")
    assert status == 200, body
    return json.loads(body)


def _proc(pid: int) -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {"threads": int(fields["Threads"]), "rss_kib": int(fields["VmRSS"].split()[0])}


# -- 1. DNS rebinding --------------------------------------------------------------------------
def test_a_rebound_host_name_is_refused_without_a_token(dev_server_factory):
    server = dev_server_factory(token=None)
    port = server.port
    # What a page on rebind.attacker.example sends once the name points at 127.0.0.1.
    for foreign in (f"rebind.attacker.example:{port}", "rebind.attacker.example", f"127.0.0.1.attacker.example:{port}",
                    f"localhost.attacker.example:{port}", "127.0.0.2", f"localhost:{port}@attacker.example",
                    "[::1].attacker.example", "", "localhost.", "0.0.0.0"):
        for request in (_post("/v1/queues/rebind/tasks", foreign, {"handler": "greet"}),
                        _post("/v1/queues/rebind/dlq:purge", foreign, {"all": True}),
                        _get("/v1/queues/rebind/stats", foreign), _get("/v1/tasks/some-id", foreign)):
            status, headers, body = _exchange(server, request)
            assert status == 421, (foreign, request[:60], status, body)
            assert headers["content-type"] == PROBLEM_JSON and json.loads(body)["status"] == 421
    # No Host at all (HTTP/1.0), two Host headers: refused too.
    assert _exchange(server, b"GET /v1/queues/rebind/stats HTTP/1.0\r\n\r\n")[0] == 400
    assert _exchange(server, _get("/v1/queues/rebind/stats", "127.0.0.1", "Host: attacker.example\r\n"))[0] == 400
    # A cross-site page's request names its origin: refused whatever its Host.
    for origin in ("http://attacker.example", "null", f"http://rebind.attacker.example:{port}"):
        request = _post("/v1/queues/rebind/tasks", f"127.0.0.1:{port}", {"handler": "greet"}, extra=f"Origin: {origin}\r\n")
        assert _exchange(server, request)[0] == 403, origin
    # Nothing was done.
    assert _stats(server, "rebind")["pending"] == 0
    assert sum(v for v in _stats(server, "rebind").values() if isinstance(v, int)) == 0
    # The names of this machine are served, with or without the port, in any case.
    for local in ("127.0.0.1", f"127.0.0.1:{port}", "localhost", f"localhost:{port}", f"LocalHost:{port}",
                  "[::1]", f"[::1]:{port}"):
        assert _exchange(server, _get("/v1/queues/rebind/stats", local))[0] == 200, local
    request = _post("/v1/queues/rebind/tasks", f"localhost:{port}", {"handler": "greet"}, extra=f"Origin: http://localhost:{port}\r\n")
    assert _exchange(server, request)[0] == 201
    assert "Traceback" not in server.output()


def test_with_a_token_any_host_is_served_and_the_token_decides(dev_server):
    foreign = f"rebind.attacker.example:{dev_server.port}"
    assert _exchange(dev_server, _get("/v1/queues/q/stats", foreign))[0] == 401
    assert _exchange(dev_server, _get("/v1/queues/q/stats", foreign, token=dev_server.token))[0] == 200


# -- 2. slow bodies ----------------------------------------------------------------------------
SIX_MIB = 6 * 1024 * 1024


def _slow_body_head(server, length: int, token: str | None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"POST /v1/queues/slow/tasks HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n{auth}"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def test_a_request_without_the_token_is_refused_before_its_body_is_read(dev_server):
    before = _proc(dev_server.process.pid)
    sockets = []
    try:
        for _ in range(40):
            sock = socket.create_connection(("127.0.0.1", dev_server.port), timeout=5)
            sockets.append(sock)
            sock.sendall(_slow_body_head(dev_server, SIX_MIB, token=None) + b"{" * 1024)
        for sock in sockets:
            # The 401 comes while the body is still owed, and the server closes the connection.
            status, headers, body, _ = _read_response(sock)
            assert status == 401 and headers["content-type"] == PROBLEM_JSON, body
            assert headers.get("connection") == "close"
        during = _proc(dev_server.process.pid)
    finally:
        for sock in sockets:
            sock.close()
    # No body buffer was held; each refused connection's thread lingers at most a second (to
    # let the 401 arrive before the close), within the connection bound.
    assert during["rss_kib"] <= before["rss_kib"] + 20 * 1024, (before, during)
    assert during["threads"] <= before["threads"] + MAX_CONNECTIONS + 2, (before, during)
    wait_until(lambda: _proc(dev_server.process.pid)["threads"] <= before["threads"] + 2, timeout=15,
               what="the refused connections' threads to end")
    assert dev_server.request("GET", "/v1/queues/slow/stats", timeout=5)[0] == 200


def _hold(server, length: int, sent: int, token: str | None, sockets: list, errors: list) -> None:
    try:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sockets.append(sock)
        sock.sendall(_slow_body_head(server, length, token) + b" " * sent)
    except OSError as exc:  # refused with 503 and closed while still sending: fine
        errors.append(exc)


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return True
    except ConnectionResetError:
        return True
    except OSError:
        return False


def test_large_bodies_one_byte_short_hold_bounded_memory_and_time_out(dev_server):
    pid = dev_server.process.pid
    before = _proc(pid)
    sockets: list[socket.socket] = []
    errors: list[Exception] = []
    senders = [threading.Thread(target=_hold, args=(dev_server, SIX_MIB, SIX_MIB - 1, dev_server.token, sockets, errors))
               for _ in range(40)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join(60)
    try:
        time.sleep(1)
        during = _proc(pid)
        # Bodies buffered at once are bounded (32 MiB by declared length): the rest were refused.
        assert during["rss_kib"] <= before["rss_kib"] + 80 * 1024, (before, during)
        assert during["threads"] <= before["threads"] + MAX_CONNECTIONS + 2, (before, during)
        # A normal request is answered meanwhile.
        started = time.monotonic()
        assert dev_server.request("GET", "/v1/queues/slow/stats", timeout=IDLE_TIMEOUT_SECONDS + 10)[0] == 200
        assert time.monotonic() - started < 5
        # The server gives up on every one of them after the idle timeout.
        for sock in sockets:
            sock.settimeout(IDLE_TIMEOUT_SECONDS + 10)
        assert all(_closed_by_server(sock) for sock in sockets)
    finally:
        for sock in sockets:
            sock.close()
    wait_until(lambda: _proc(pid)["threads"] <= before["threads"] + 2, timeout=15,
               what="the held connections' threads to end")
    assert "Traceback" not in dev_server.output()


def test_more_held_connections_than_slots_hold_no_more_threads_and_delay_a_request_only_briefly(dev_server_factory):
    server = dev_server_factory(token=None)
    pid = server.process.pid
    before = _proc(pid)
    sockets: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS + 8):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sockets.append(sock)
            sock.sendall(_slow_body_head(server, 1000, None) + b" " * 999)
        time.sleep(1)
        during = _proc(pid)
        assert during["threads"] <= before["threads"] + MAX_CONNECTIONS + 2, (before, during)
        # The next request waits for a slot, at most about one idle timeout.
        started = time.monotonic()
        assert server.request("GET", "/v1/queues/slow/stats", token=None, timeout=IDLE_TIMEOUT_SECONDS + 15)[0] == 200
        assert time.monotonic() - started < IDLE_TIMEOUT_SECONDS + 5
    finally:
        for sock in sockets:
            sock.close()
    assert "Traceback" not in server.output()


# -- 5. Transfer-Encoding ----------------------------------------------------------------------
SMUGGLED_BODY = {"handler": "greet", "id": "smuggled-1"}


@pytest.mark.parametrize("te_headers", [
    "Transfer-Encoding: chunked\r\n",
    "Transfer-Encoding: gzip, chunked\r\n",
    "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",
    "Transfer-Encoding: identity\r\n",
    "Transfer-Encoding: CHUNKED\r\n",
    "transfer-encoding: chunked\r\nContent-Length: 5\r\n",
])
def test_any_transfer_encoding_is_refused_and_a_smuggled_request_never_served(dev_server, te_headers):
    token = dev_server.token
    smuggled_raw = json.dumps(SMUGGLED_BODY).encode()
    smuggled = (f"POST /v1/queues/smuggled/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(smuggled_raw)}\r\n\r\n").encode() + smuggled_raw
    body = b"0\r\n\r\n" + smuggled
    outer = (f"POST /v1/queues/outer/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
             f"Content-Type: application/json\r\n{te_headers}\r\n").encode() + body
    with socket.create_connection(("127.0.0.1", dev_server.port), timeout=15) as sock:
        sock.sendall(outer)
        status, headers, problem, after = _read_response(sock)
        assert status == 411 and headers["content-type"] == PROBLEM_JSON, (status, problem)
        assert json.loads(problem)["status"] == 411
        assert headers.get("connection") == "close"
        # Nothing more comes back: no second response, the connection is closed.
        rest = after
        try:
            while chunk := sock.recv(65536):
                rest += chunk
        except ConnectionResetError:
            pass
        assert b"HTTP/1." not in rest, rest
    time.sleep(0.5)
    assert dev_server.request("GET", "/v1/tasks/smuggled-1")[0] == 404
    for queue in ("smuggled", "outer"):
        stats = _stats(dev_server, queue)
        assert not any(v for k, v in stats.items() if isinstance(v, int) and k != "oldest_pending_age_seconds"), stats


# -- 6. batch enqueue conflicts ----------------------------------------------------------------
def test_a_batch_conflict_does_not_reveal_the_other_queues_name_or_the_tasks_status(dev_server):
    assert dev_server.request("POST", "/v1/queues/secret-payroll/tasks", {"handler": "reject", "id": "their-task"})[0] == 201
    wait_until_dead = time.monotonic() + 30
    while json.loads(dev_server.request("GET", "/v1/tasks/their-task")[2])["status"] != "DEAD":
        assert time.monotonic() < wait_until_dead, "the task was never dead-lettered"
        time.sleep(0.2)
    body = {"tasks": [{"handler": "greet", "id": "mine-1"}, {"handler": "greet", "id": "their-task"}]}
    raw = json.dumps(body).encode()
    request = (f"POST /v1/queues/mine/tasks:batch HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {dev_server.token}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\nConnection: close\r\n\r\n").encode() + raw
    status, _, answer = _exchange(dev_server, request)
    assert status == 200, answer
    text = answer.decode()
    assert "secret-payroll" not in text and "DEAD" not in text, text
    results = json.loads(answer)["results"]
    assert results[1] == {"id": "their-task", "result": "conflict"}
    assert results[0]["queue"] == "mine" and results[0]["result"] == "created"
    assert json.loads(answer)["conflict"] == 1
    # The document served says the same.
    document = json.loads(dev_server.request("GET", "/v1/openapi.json")[2])
    items = document["components"]["schemas"]["BatchResult"]["properties"]["results"]["items"]
    conflict_shape = next(shape for shape in items["oneOf"] if shape["properties"]["result"].get("const") == "conflict")
    assert set(conflict_shape["properties"]) == {"id", "result"} and conflict_shape["additionalProperties"] is False
