"""``rdq console --api URL``: the operator console on 127.0.0.1, in front of a deployed rdq API.

It serves the console's static files and forwards the page's ``/v1/...`` calls to ``URL``,
signing each one with the operator's own credentials: SigV4 from the standard AWS credential
chain by default (``--profile``, ``--region``), or an API key (``--api-key``, ``$RDQ_API_KEY``),
or a bearer token (``--token``, ``$RDQ_API_TOKEN``). The browser never holds a credential.

Each run makes a secret, the session token, and prints the page's address with it
(``http://127.0.0.1:8788/?token=…``). The page keeps it in the tab's session storage and sends it
as ``Authorization: Bearer …``; a ``/v1/`` request without it is refused (401) and nothing is
forwarded. Any local account can reach a loopback port, so this token -- not the port -- is what
tells the operator's page from another process. (Not a cookie: cookies are shared by every port of
127.0.0.1, session storage is not.)

What it refuses, before anything is forwarded:

* a ``Host`` that is not a loopback name (DNS rebinding, as ``rdq dev`` without a token);
* a request target that is not ASCII (400);
* a method the API does not have: only GET, POST and DELETE travel (405);
* an API call from another origin: an ``Origin`` that is not this server's own, or a
  ``Sec-Fetch-Site`` of ``cross-site``/``same-site`` (another local page must not borrow the
  operator's signature); the static page itself may be opened from a link anywhere;
* an API call without the session token (401);
* bodies over ``MAX_BODY_BYTES`` (413) and any ``Transfer-Encoding`` (411);
* paths outside ``/v1/`` that are not static files, and paths with a segment that decodes to
  ``.`` or ``..`` or holds ``/`` or a backslash (``%2e%2e``, ``%2f``, ``%5c``): 404, since a server
  upstream may resolve them into another resource than the one signed for.

Only ``Accept`` and ``Content-Type`` travel upstream from the browser: never its
``Authorization``, cookies or anything else. The API's answers come back as they are (status,
body, ``Content-Type``); an API that cannot be reached is a 502 problem+json, one that does not
answer in time a 504.
"""

from __future__ import annotations

import argparse
import hmac
import http.client
import logging
import os
import re
import secrets
import ssl
import sys
import urllib.parse
from typing import Any, Mapping

from ...errors import ConfigurationError, RdqError
from ...http_client import ApiKey, Auth, BearerToken, SigV4, plaintext_credential_warning
from ...http_client.transport import ApiEndpoint, NotSent
from ...problems import PROBLEM_JSON, problem_json
from ...text import printable
from .options import DEFAULT_PORT, add_parser
from ..localhttp import BoundedHTTPServer, GuardedRequestHandler, cross_origin_refusal, loopback_refusal, serve_until_stopped

#: The API refuses bodies over 1 MiB itself; anything far beyond is refused here unread.
MAX_BODY_BYTES = 2 * 1024 * 1024
CONNECT_TIMEOUT_SECONDS = 5.0
#: API Gateway's own integration limit is 29 s.
READ_TIMEOUT_SECONDS = 35.0
#: Response headers passed back from the API besides Content-Type.
_PASSED_BACK = ("Location", "Retry-After", "Allow", "Accept-Post")
#: The methods of the API's routes (lambda_host/routes.py): nothing else is signed.
FORWARDED_METHODS = ("GET", "POST", "DELETE")
#: The session token in a logged request line.
_TOKEN_IN_QUERY = re.compile(r"(?i)([?&]token=)[^&\s\"]*")

log = logging.getLogger("rdq.console")


class ConsoleServer:
    """The console's HTTP server on ``127.0.0.1:port`` (0: a free port), forwarding to ``api_url``."""

    def __init__(self, api_url: str, auth: Auth | None, port: int = DEFAULT_PORT, *,
                 ssl_context: ssl.SSLContext | None = None, session_token: str | None = None) -> None:
        self.endpoint = ApiEndpoint(api_url)
        #: What messages name: scheme, host and port, never a path, key or token.
        self.api = self.endpoint.api
        self.auth = auth
        self.ssl_context = ssl_context or ssl.create_default_context()
        #: This run's secret: what the page proves it is the operator's with (see the module's text).
        self.session_token = session_token or secrets.token_urlsafe(32)
        self.server = BoundedHTTPServer(("127.0.0.1", port), _handler_class(self))

    @property
    def url(self) -> str:
        return f"{self.server.base_url}/"

    @property
    def login_url(self) -> str:
        """The address to open: the page, with this run's session token."""
        return f"{self.url}?token={self.session_token}"

    def authorized(self, headers: Any) -> bool:
        """Whether the request carries this run's session token (``Authorization: Bearer …``)."""
        values = headers.get_all("Authorization") or []
        if len(values) != 1:
            return False
        scheme, _, token = values[0].strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.session_token.encode())

    def start(self) -> None:
        self.server.start("rdq-console-http")

    def stop(self) -> None:
        self.server.close()

    # -- forwarding --------------------------------------------------------------------------
    def forward(self, method: str, path: str, query: str, body: bytes,
                browser_headers: Mapping[str, str]) -> tuple[int, dict[str, str], bytes]:
        """One request to the API, signed; (status, headers to pass back, body)."""
        path_and_query = path + (f"?{query}" if query else "")
        headers = {"Accept": browser_headers.get("Accept") or "application/json"}
        if body or method in ("POST", "PUT", "PATCH"):
            headers["Content-Type"] = browser_headers.get("Content-Type") or "application/json"
        if self.auth is not None:
            try:
                headers.update(self.auth.headers(method, self.endpoint.url(path_and_query), headers, body))
            except Exception as exc:  # noqa: BLE001 - expired or missing credentials, an unknown profile: this request's 502
                return _problem(502, f"the console could not sign the request: {type(exc).__name__}: {exc}")
        try:
            connection = self.endpoint.connect(CONNECT_TIMEOUT_SECONDS, READ_TIMEOUT_SECONDS, self.ssl_context)
        except NotSent as exc:
            return _problem(502, f"the rdq API at {self.api} could not be reached ({type(exc.__cause__).__name__})")
        try:
            try:
                connection.request(method, self.endpoint.target(path_and_query),
                                   body=body if body or "Content-Type" in headers else None, headers=headers)
                response = connection.getresponse()
                payload = response.read()
            except TimeoutError:
                return _problem(504, f"the rdq API at {self.api} did not answer within {READ_TIMEOUT_SECONDS:g} s")
            except (OSError, http.client.HTTPException) as exc:
                return _problem(502, f"the connection to the rdq API at {self.api} failed ({type(exc).__name__})")
            passed = {"Content-Type": response.getheader("Content-Type") or "application/octet-stream"}
            for name in _PASSED_BACK:
                value = response.getheader(name)
                if value is not None:
                    passed[name] = value
            return response.status, passed, payload
        finally:
            connection.close()


def _problem(status: int, detail: str) -> tuple[int, dict[str, str], bytes]:
    return status, {"Content-Type": PROBLEM_JSON}, problem_json(status, detail).encode()


def canonical_query(query: str) -> str:
    """The query string re-encoded the one way SigV4 canonicalizes it (RFC 3986, ``%20`` for a
    space), so the signature the console computes is the one API Gateway recomputes."""
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    return urllib.parse.urlencode(pairs, quote_via=urllib.parse.quote, safe="-_.~")


def path_refusal(path: str) -> str | None:
    """Why ``path`` (as received, percent-encoded) is not forwarded, or None.

    Only ``/v1/...`` travels, and no segment may decode to ``.`` or ``..`` or hold ``/`` or a
    backslash: a proxy, gateway or server upstream may decode and resolve them, and the signed
    request would then reach another resource than the one it names."""
    if not path.startswith("/v1/"):
        return "the console serves its own files and forwards /v1/ only"
    for segment in path.split("/"):
        decoded = urllib.parse.unquote(segment, errors="strict") if "%" in segment else segment
        if decoded in (".", "..") or "/" in decoded or "\\" in decoded:
            return "the console does not forward paths with dot segments or encoded slashes"
    return None


def _handler_class(console: ConsoleServer) -> type[GuardedRequestHandler]:
    class ConsoleRequestHandler(GuardedRequestHandler):
        server_version = "rdq-console"
        request_log = log

        def _handle(self) -> None:
            refusal = self._framing_refusal() or loopback_refusal(self.headers, "the console")
            if refusal:
                return self._refuse(*refusal)
            path, _, query = self.path.partition("?")
            if self._send_asset_of(path):  # the page itself holds no data: a link from another site may open it
                return None
            if self.command not in FORWARDED_METHODS:
                allowed = ", ".join(FORWARDED_METHODS)
                return self._refuse(405, f"the rdq API has no {printable(self.command)[:20]} route; use {allowed}",
                                    {"Allow": allowed})
            refusal = cross_origin_refusal(self.headers, "the console")
            if refusal:
                return self._refuse(*refusal)
            if not console.authorized(self.headers):
                # Checked before the path: without the token nothing about the API is answered.
                return self._refuse(401, "send this run's session token (Authorization: Bearer …); open the address "
                                         "rdq console printed", {"WWW-Authenticate": 'Bearer realm="rdq console"'})
            try:
                reason = path_refusal(path)
            except UnicodeDecodeError:
                reason = "the path's percent-encoding is not UTF-8"
            if reason:
                return self._refuse(404, f"{reason}, not {printable(path)[:200]}")
            browser = {name: value for name in ("Accept", "Content-Type") if (value := self.headers.get(name))}

            def answer(body: bytes) -> None:
                # Sent no-store and nosniff (``_send``): the API's own caching headers are not passed back.
                self._send(*console.forward(self.command, path, canonical_query(query), body, browser))

            return self._with_body(MAX_BODY_BYTES, answer)

        def _loggable(self, line: str) -> str:
            # The page's first request carries the session token in its query: never log it.
            return _TOKEN_IN_QUERY.sub(r"\1***", line)

    return ConsoleRequestHandler


# -- the command -------------------------------------------------------------------------------
def _option(args: argparse.Namespace, name: str, env: str | None = None) -> Any:
    value = getattr(args, f"console_{name}", None) or getattr(args, name, None)
    if value is None and env:
        value = os.environ.get(env) or None
    return value


def auth_from(args: argparse.Namespace) -> tuple[Auth, str]:
    """The credentials ``rdq console`` signs with, and a description without any secret."""
    api_key = _option(args, "api_key", "RDQ_API_KEY")
    token = _option(args, "token", "RDQ_API_TOKEN")
    if api_key and token:
        raise ConfigurationError("give --api-key or --token, not both")
    if api_key:
        return ApiKey(api_key), "API key"
    if token:
        return BearerToken(token), "bearer token"
    profile, region = _option(args, "profile"), _option(args, "region")
    return SigV4(profile=profile, region=region), f"SigV4 ({'profile ' + profile if profile else 'default credential chain'})"


def build(args: argparse.Namespace) -> tuple[ConsoleServer, str]:
    api_url = _option(args, "api", "RDQ_API_URL")
    if not api_url:
        raise ConfigurationError("rdq console needs the API's URL: --api URL (or RDQ_API_URL)")
    auth, described = auth_from(args)
    warning = plaintext_credential_warning(api_url, auth)
    if warning:
        print(f"rdq console: {warning}", file=sys.stderr, flush=True)
    try:  # sign one request now, so missing credentials or an unknown profile stop the start
        auth.headers("GET", api_url.rstrip("/") + "/v1/queues", {"Accept": "application/json"}, b"")
    except ConfigurationError:
        raise
    except Exception as exc:  # noqa: BLE001 - no credentials, botocore's ProfileNotFound, ...: the configuration's fault
        raise ConfigurationError(f"cannot sign requests with {described}: {exc}") from None
    port = getattr(args, "console_port", DEFAULT_PORT)
    try:
        console = ConsoleServer(api_url, auth, port)
    except OSError as exc:
        if exc.errno in (98, 48):  # EADDRINUSE (Linux, macOS)
            raise ConfigurationError(f"port {port} on 127.0.0.1 is already in use; pass --port (0 picks a free one)") from None
        raise
    return console, f"{console.api}, {described}"


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C or SIGTERM (the ``rdq console`` command); 0 when stopped."""
    from ...engine.logs import configure_logging, configured_format, default_log_format, default_log_level

    if configured_format() is None:
        configure_logging(default_log_format(), default_log_level())
    console, described = build(args)
    serve_until_stopped("rdq console", console.start, console.stop, "\n".join([
        f"rdq console: {console.login_url}",
        "  open this address: its token is this run's secret (keep it to yourself; it changes at each start)",
        f"  forwarding /v1/ to {described}; Ctrl-C to stop",
    ]))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m rdq_core.hosts.console.server``: the same command without the ``rdq`` CLI."""
    parser = argparse.ArgumentParser(prog="python -m rdq_core.hosts.console.server")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["console", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except RdqError as exc:
        print(f"rdq console: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["DEFAULT_PORT", "FORWARDED_METHODS", "ConsoleServer", "add_parser", "auth_from", "build", "canonical_query",
           "path_refusal", "run"]
