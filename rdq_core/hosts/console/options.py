"""``rdq console``'s command-line options, apart from its server: every other ``rdq`` command
builds the same parser and should not pay for importing the server and its HTTP client."""

from __future__ import annotations

import argparse
from typing import Any

DEFAULT_PORT = 8788


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``rdq console``'s parser, added to ``subparsers`` (the CLI's ``add_subparsers()``).

    Its options have their own destinations (``console_*``), so they do not collide with the
    CLI's global ``--api``/``--profile``/… ; ``run`` reads either."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "console", help="the web console on 127.0.0.1, in front of a deployed API (signs with your credentials)",
        description="Serve the rdq web console on 127.0.0.1 and forward its API calls to --api, signed with "
                    "SigV4 (default), an API key or a bearer token.")
    parser.add_argument("--api", dest="console_api", metavar="URL",
                        help="the API's base URL, e.g. https://ID.execute-api.REGION.amazonaws.com/prod ($RDQ_API_URL)")
    parser.add_argument("--port", dest="console_port", type=int, default=DEFAULT_PORT,
                        help=f"port on 127.0.0.1 (default {DEFAULT_PORT}; 0 picks a free one)")
    parser.add_argument("--profile", dest="console_profile", metavar="NAME", help="AWS profile for SigV4")
    parser.add_argument("--region", dest="console_region", metavar="REGION", help="AWS region for SigV4")
    parser.add_argument("--api-key", dest="console_api_key", metavar="KEY",
                        help="send this API key instead of signing ($RDQ_API_KEY)")
    parser.add_argument("--token", dest="console_token", metavar="TOKEN",
                        help="send this bearer token instead of signing ($RDQ_API_TOKEN)")
    return parser
