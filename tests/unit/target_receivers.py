"""Receivers for the target tests: a TLS server on 127.0.0.1 with a certificate authority of its
own, made at test time, answering each path with what the test scripted.

``Receiver.route(path, *answers)`` queues answers for a path; each request takes the next one
(the last one repeats). An answer is ``Answer(status, body, headers, delay)``, or ``TRICKLE``:
a status line, then one header byte every 0.2 s, never finishing. Every request is recorded
(``requests``) with its headers and raw body, so a test can verify what arrived.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Answer:
    status: int
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    #: Seconds to wait before answering (a slow receiver).
    delay: float = 0.0


TRICKLE = Answer(0)


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    #: When it arrived (monotonic clock).
    at: float = 0.0

    def envelope(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Authority:
    """A CA and a server certificate it signed for localhost and 127.0.0.1, as PEM files."""

    ca_file: Path
    cert_file: Path
    key_file: Path


def make_authority(directory: Path) -> Authority:
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rdq test CA")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    authority = Authority(directory / "ca.pem", directory / "server.pem", directory / "server-key.pem")
    authority.ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    authority.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    authority.key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    return authority


class Receiver:
    """The TLS server, on a thread; ``close`` stops it and releases every waiting answer."""

    def __init__(self, authority: Authority) -> None:
        self.requests: list[Received] = []
        #: Requests being answered now, and the most there ever were at once.
        self.active = 0
        self.peak = 0
        self._routes: dict[str, list[Answer]] = {}
        self._lock = threading.Lock()
        self.closing = threading.Event()
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(authority.cert_file, authority.key_file)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_class(self))
        self._server.daemon_threads = True
        self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(target=self._server.serve_forever, name="target-receiver", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"https://{host}:{self.port}{path}"

    def route(self, path: str, *answers: Answer) -> None:
        with self._lock:
            self._routes[path] = list(answers)

    def received(self, path: str) -> list[Received]:
        with self._lock:
            return [r for r in self.requests if r.path == path]

    def _next_answer(self, path: str) -> Answer:
        with self._lock:
            answers = self._routes.get(path) or [Answer(404, {"error": "no route"})]
            return answers.pop(0) if len(answers) > 1 else answers[0]

    def _record(self, received: Received) -> None:
        with self._lock:
            self.requests.append(received)

    def _enter(self) -> None:
        with self._lock:
            self.active += 1
            self.peak = max(self.peak, self.active)

    def _leave(self) -> None:
        with self._lock:
            self.active -= 1

    def close(self) -> None:
        self.closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def _handler_class(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 10

        def log_message(self, format: str, *args: Any) -> None:
            return None

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            path = self.path.split("?")[0]
            receiver._record(Received(path, dict(self.headers.items()), body, time.monotonic()))
            answer = receiver._next_answer(path)
            if answer is TRICKLE:
                self._trickle()
                return
            receiver._enter()
            try:
                if answer.delay and receiver.closing.wait(answer.delay):
                    return
                self._answer(answer)
            except OSError:
                pass  # the caller is gone (given up, or killed): nobody to answer
            finally:
                receiver._leave()

        def _answer(self, answer: Answer) -> None:
            data = b"" if answer.body is None else (
                answer.body if isinstance(answer.body, bytes) else json.dumps(answer.body).encode())
            self.send_response(answer.status)
            self.send_header("Content-Type", answer.headers.get("Content-Type", "application/json"))
            self.send_header("Content-Length", str(len(data)))
            for key, value in answer.headers.items():
                if key != "Content-Type":
                    self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def _trickle(self) -> None:
            try:
                self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                self.wfile.flush()
                while not receiver.closing.wait(0.2):
                    self.wfile.write(b"a")
                    self.wfile.flush()
            except (OSError, socket.timeout):
                pass  # the caller gave up and closed: what this answer is for

    return Handler
