"""``rdq dev``'s HTTP front: the API handler and the console on one loopback port.

Each API request is translated into the API Gateway REST proxy event Lambda would receive, and
the proxy result back into an HTTP response, so the routes are the deployed API's
(``aws_lambda/routes.py``). The console's static files are served without a token (the page asks
for it, then sends it); ``GET /v1/events`` is this host's own route. Connections, bodies and
refusals are ``localhttp``'s, as for ``rdq console``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from ..localhttp import GuardedRequestHandler, cross_origin_refusal, loopback_refusal

if TYPE_CHECKING:
    from .functions import LocalFunctions
    from ...engine.outbox import LogPublisher

#: Requests above this are refused by the local server before the handler sees them
#: (API Gateway's own hard limit is 10 MB; the API handler's body limit is lower still).
MAX_REQUEST_BYTES = 6 * 1024 * 1024
#: The dev host's own route: the lifecycle events its reaper delivered (not on a deployed API).
EVENTS_PATH = "/v1/events"

http_log = logging.getLogger("rdq.dev.http")


def host_refusal(headers: Any) -> tuple[int, str] | None:
    """Without a token, the status and reason this request's ``Host`` (or ``Origin``) is
    refused with, else ``None``: a foreign ``Host`` (DNS rebinding, see ``loopback_refusal``),
    and a page on another loopback port, which is another origin too -- without a token nothing
    else tells its requests from the console's own."""
    return (loopback_refusal(headers, "without RDQ_API_TOKEN the dev API")
            or cross_origin_refusal(headers, "without RDQ_API_TOKEN the dev API"))


def events_query(path: str) -> tuple[int, int]:
    """``after`` (a number, default 0) and ``limit`` (1..1000, default 100) of an events request."""
    query = parse_qs(urlsplit(path).query, keep_blank_values=True)
    unknown = set(query) - {"after", "limit"}
    if unknown:
        raise ValueError(f"unknown query parameter {sorted(unknown)[0]!r}; use after and limit")
    values: dict[str, int] = {}
    for name, default, low, high in (("after", 0, 0, 2**63 - 1), ("limit", 100, 1, 1000)):
        given = query.get(name, [str(default)])
        if len(given) != 1 or not given[0].isascii() or not given[0].isdigit() or not low <= int(given[0]) <= high:
            raise ValueError(f"{name} must be a whole number in [{low}, {high}]")
        values[name] = int(given[0])
    return values["after"], values["limit"]


def request_handler_class(functions: LocalFunctions, events: LogPublisher) -> type[GuardedRequestHandler]:
    """The request handler of one ``rdq dev``: its API functions and the events its reaper delivered."""
    from ..aws_lambda.local_invoke import api_proxy_event, proxy_result_body, proxy_result_headers

    class ProxyRequestHandler(GuardedRequestHandler):
        server_version = "rdq-dev"
        request_log = http_log

        def _handle(self) -> None:
            # Everything that can be decided from the headers is, before a byte of body is read.
            refusal = self._framing_refusal()
            if refusal:
                return self._refuse(*refusal)
            if not functions.settings.api_token:
                refusal = host_refusal(self.headers)
                if refusal:
                    return self._refuse(*refusal)
            path = self.path.split("?", 1)[0]
            if self._send_asset_of(path):  # the console's static files need no token
                return None
            headers: dict[str, str] = {}
            for name, value in self.headers.items():
                headers[name] = f"{headers[name]},{value}" if name in headers else value
            denied = functions.api_unauthorized({"headers": headers, "path": path})
            if denied is not None:
                return self._send_result(denied, close=True)
            if self.command in ("GET", "HEAD") and path == EVENTS_PATH:
                return self._send_events()

            def answer(body: bytes) -> None:
                event = api_proxy_event(self.command, self.path, headers, body, source_ip=self.client_address[0])
                del body  # the event holds its own copy
                self._send_result(functions.call_api(event))

            return self._with_body(MAX_REQUEST_BYTES, answer)

        def _send_result(self, result: dict[str, Any], close: bool = False) -> None:
            self._send(int(result.get("statusCode", 500)), list(proxy_result_headers(result)), proxy_result_body(result),
                       unread=close)

        def _send_events(self) -> None:
            """``GET /v1/events?after=&limit=``: the events this host delivered, oldest first, each
            numbered (``seq``); ``next_after`` is the number to ask after next time."""
            try:
                after, limit = events_query(self.path)
            except ValueError as exc:
                return self._refuse(400, str(exc))
            found, last = events.page(after, limit)
            return self._send_json(200, {"events": found, "next_after": last})

    return ProxyRequestHandler
