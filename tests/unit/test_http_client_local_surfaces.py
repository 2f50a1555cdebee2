"""``HttpClient`` and ``rdq --api`` against a server that is not what it claims (issue 27, item 11):
``file:`` URLs that would write the caller's files, 404s that are not rdq's, and credentials sent
in clear text. Each test performs the attack; on the code before the fix each one fails."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Callable, Iterator

import pytest

from rdq_core.engine import payloads
from rdq_core.errors import ConfigurationError, TaskNotFound
from rdq_core.http_client import ApiKey, BearerToken, HttpClient, SigV4, plaintext_credential_warning
from tests.loopback import Answer, ScriptedHttpServer

@pytest.fixture
def fake_api() -> Iterator[Callable[[Callable[[str, str, bytes], Answer]], ScriptedHttpServer]]:
    """A loopback API whose answers the test chooses: ``answer(method, path, body)``."""
    started: list[ScriptedHttpServer] = []

    def start(answer: Callable[[str, str, bytes], Answer]) -> ScriptedHttpServer:
        server = ScriptedHttpServer(lambda method, path, headers, body: answer(method, path, body))
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(autouse=True)
def _no_payload_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RDQ_PAYLOAD_DIR", "RDQ_PAYLOAD_BUCKET", "RDQ_PAYLOAD_THRESHOLD_BYTES"):
        monkeypatch.delenv(name, raising=False)


JSON = {"Content-Type": "application/json"}
BIG = {"t": "x" * 300_000}


def _offering(url_for: Callable[[str], str]) -> Callable[[str, str, bytes], Answer]:
    """An API that offers uploads at ``url_for(key)`` and accepts the enqueue afterwards."""

    def answer(method: str, path: str, body: bytes) -> Answer:
        request = json.loads(body or b"{}")
        if path.endswith("/payloads"):
            key = f"payloads/q/{request['task_id']}/{'0' * 32}"
            offer = {"upload": {"url": url_for(key), "method": "PUT", "headers": {}, "expires_in_seconds": 900},
                     "payload_ref": {"bucket": "local", "key": key, "size": request["size"], "sha256": request["sha256"]}}
            return 201, JSON, json.dumps(offer).encode()
        task = {"id": request["id"], "queue": "q", "handler": request["handler"], "payload": None, "status": "PENDING",
                "attempts": [], "headers": {}, "max_attempts": 3, "created": True}
        return 201, JSON, json.dumps(task).encode()

    return answer


# -- (b) file: URLs ------------------------------------------------------------------------------
def test_a_loopback_api_cannot_make_the_client_write_outside_a_payload_directory(fake_api, tmp_path: Path) -> None:
    victim = tmp_path / "home" / ".ssh" / "authorized_keys"
    api = fake_api(_offering(lambda key: victim.as_uri()))
    with pytest.raises(ConfigurationError, match="file: URL"):
        HttpClient(api.url, retry_seconds=0).enqueue("q", "h", BIG, id="t1")
    assert not victim.exists() and not victim.parent.exists()


def test_a_file_url_must_name_the_offered_object_under_rdq_payloads_with_no_way_out(fake_api, tmp_path: Path) -> None:
    root = tmp_path / "rdq-payloads"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    # ``..`` in the URL, a directory that is not rdq dev's, and a symbolic link out of rdq-payloads.
    (tmp_path / "linked" / "rdq-payloads").mkdir(parents=True)
    (tmp_path / "linked" / "rdq-payloads" / "payloads").symlink_to(outside, target_is_directory=True)
    for url_for in (lambda key: f"{root.as_uri()}/{key}/../../../../../elsewhere/x",
                    lambda key: f"{root.as_uri()}/payloads/q/other-task/{'0' * 32}",
                    lambda key: f"{(tmp_path / 'not-rdq').as_uri()}/{key}",
                    lambda key: f"{(tmp_path / 'linked' / 'rdq-payloads').as_uri()}/{key}",
                    lambda key: f"file://attacker.example{root}/{key}"):
        api = fake_api(_offering(url_for))
        with pytest.raises(ConfigurationError, match="file: URL"):
            HttpClient(api.url, retry_seconds=0).enqueue("q", "h", BIG, id="t1")
        api.stop()
    assert list(outside.iterdir()) == [] and not (tmp_path / "not-rdq").exists()

    # What rdq dev really answers still works: the offered object, inside its directory.
    api = fake_api(_offering(lambda key: f"{root.as_uri()}/{key}"))
    HttpClient(api.url, retry_seconds=0).enqueue("q", "h", BIG, id="t1")
    written = root / "payloads" / "q" / "t1" / ("0" * 32)
    assert json.loads(written.read_bytes()) == BIG


def test_with_payload_dir_set_only_that_directory_is_accepted(fake_api, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    real, other = tmp_path / "dev" / "rdq-payloads", tmp_path / "other" / "rdq-payloads"
    api = fake_api(_offering(lambda key: f"{other.as_uri()}/{key}"))
    with pytest.raises(ConfigurationError, match="outside the payload directory"):
        HttpClient(api.url, retry_seconds=0, payload_dir=real).enqueue("q", "h", BIG, id="t1")
    monkeypatch.setenv("RDQ_PAYLOAD_DIR", str(real))
    with pytest.raises(ConfigurationError, match="outside the payload directory"):
        HttpClient(api.url, retry_seconds=0).enqueue("q", "h", BIG, id="t1")
    assert not other.exists()


def test_an_api_that_is_not_local_never_gets_a_file_url_honoured(tmp_path: Path) -> None:
    root = tmp_path / "rdq-payloads"
    data = b"{}"
    ref = payloads.PayloadRef("local", f"payloads/q/t1/{'0' * 32}", len(data), hashlib.sha256(data).hexdigest())
    url = f"{root.as_uri()}/{ref.key}"
    assert HttpClient("http://127.0.0.1:8787").local_object_path(url, ref) == str(root / ref.key)
    for api in ("https://abc.execute-api.eu-west-1.amazonaws.com/prod", "http://10.0.0.5:8787", "https://127.0.0.1:8787",
                "http://rdq.example"):
        with pytest.raises(ConfigurationError, match="only rdq dev on a loopback address"):
            HttpClient(api).local_object_path(url, ref)


def test_a_download_url_is_held_to_the_same_rules(fake_api, tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text('{"private": 1}')
    ref = {"bucket": "local", "key": f"payloads/q/t1/{'0' * 32}", "size": secret.stat().st_size,
           "sha256": hashlib.sha256(secret.read_bytes()).hexdigest()}

    def answer(method: str, path: str, body: bytes) -> Answer:
        if path.endswith("/objects"):
            return 200, JSON, json.dumps({"payload": {"payload_ref": ref, "url": secret.as_uri()}, "result": None}).encode()
        task = {"id": "t1", "queue": "q", "handler": "h", "payload": None, "status": "PENDING", "attempts": [],
                "headers": {payloads.REF_HEADER: json.dumps(ref)}, "max_attempts": 3}
        return 200, JSON, json.dumps(task).encode()

    api = fake_api(answer)
    with pytest.raises(ConfigurationError, match="file: URL"):
        HttpClient(api.url, retry_seconds=0).get("t1", resolve=True)


# -- (g) a 404 that is not rdq's is not a missing task ----------------------------------------------
@pytest.mark.parametrize(("headers", "body"), [
    ({"Content-Type": "text/html"}, b"<html><body><h1>404 Not Found</h1></body></html>"),
    ({"Content-Type": "application/json"}, b'{"message": "Not Found"}'),  # a gateway's
    ({"Content-Type": "application/problem+json"}, b'{"type": "about:blank", "title": "Not Found", "status": 404}'),
    # rdq's own "no route" (a base URL without its stage): not a missing task either
    ({"Content-Type": "application/problem+json"},
     b'{"type": "urn:rdq:problem:not-found", "title": "Not Found", "status": 404, "detail": "no route for GET /v1/x"}'),
])
def test_a_wrong_base_url_is_a_configuration_error_not_task_not_found(fake_api, headers: dict[str, str],
                                                                       body: bytes) -> None:
    api = fake_api(lambda method, path, _: (404, headers, body))
    client = HttpClient(api.url, retry_seconds=0)
    for call in (lambda: client.get("t1"), lambda: client.cancel("t1"), lambda: client.get_operation("op1"),
                 lambda: client.cancel_operation("op1")):
        with pytest.raises(ConfigurationError, match="check the API URL"):
            call()


def test_rdqs_own_not_found_is_still_task_not_found(fake_api) -> None:
    body = json.dumps({"type": "urn:rdq:problem:not-found", "title": "Not Found", "status": 404,
                       "detail": "task 't1' not found", "field": "id"}).encode()
    api = fake_api(lambda method, path, _: (404, {"Content-Type": "application/problem+json"}, body))
    with pytest.raises(TaskNotFound):
        HttpClient(api.url, retry_seconds=0).get("t1")


# -- (g) credentials in clear text ---------------------------------------------------------------
def test_an_api_key_or_token_over_plain_http_to_another_host_is_warned_about() -> None:
    assert "API key" in (plaintext_credential_warning("http://api.example.com/prod", ApiKey("k")) or "")
    assert "bearer token" in (plaintext_credential_warning("http://10.1.2.3:8787", BearerToken("t")) or "")
    for url in ("https://api.example.com/prod", "http://127.0.0.1:8787", "http://localhost:8787", "http://[::1]:8787"):
        assert plaintext_credential_warning(url, ApiKey("k")) is None, url
    assert plaintext_credential_warning("http://api.example.com", None) is None


def test_rdq_api_warns_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    from rdq_core.hosts.cli.common import client_for

    args = argparse.Namespace(api="http://api.example.com/prod", api_key="key-7", token=None, profile=None, region=None)
    assert isinstance(client_for(args, ""), HttpClient)
    err = capsys.readouterr().err
    assert "warning" in err and "unencrypted" in err and "key-7" not in err
    args.api = "https://api.example.com/prod"
    client_for(args, "")
    assert capsys.readouterr().err == ""


def test_rdq_console_warns_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    from rdq_core.hosts.console import server

    args = argparse.Namespace(console_api="http://api.example.com/prod", console_api_key="key-8", console_token=None,
                              console_port=0, console_profile=None, console_region=None)
    console, _ = server.build(args)
    console.server.server_close()
    err = capsys.readouterr().err
    assert "warning" in err and "unencrypted" in err and "key-8" not in err


def test_sigv4_is_not_warned_about() -> None:
    signer = SigV4(region="eu-west-1", session=_NoSession())
    assert plaintext_credential_warning("http://api.example.com", signer) is None


class _NoSession:
    def get_config_variable(self, name: str) -> None:
        return None

