"""``rdq dev`` as a process: ``run_dev`` (the CLI's command) and ``main`` (``python -m rdq_core.hosts.dev``)."""

from __future__ import annotations

import argparse

from ..localhttp import serve_until_stopped
from .host import DEFAULT_PORT, DevHost


def run_dev(storage_url: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
            handler_modules: list[str] | None = None) -> None:
    """Run the dev host until Ctrl-C or SIGTERM (the ``rdq dev`` command)."""
    from ...engine.logs import configure_logging, configured_format, default_log_format, default_log_level

    if configured_format() is None:  # ``rdq dev`` configured it already; ``python -m`` did not
        configure_logging(default_log_format(), default_log_level())
    dev = DevHost(storage_url, host, port, handler_modules)
    serve_until_stopped("rdq dev", dev.start, dev.stop, dev.banner())


def main(argv: list[str] | None = None) -> None:
    from ...storage import default_storage_url

    parser = argparse.ArgumentParser(prog="python -m rdq_core.hosts.dev", description="rdq dev: the local serverless host")
    parser.add_argument("--storage", default=default_storage_url())
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--handlers", default="", help="handler modules, comma-separated (default: rdq_core.examples)")
    args = parser.parse_args(argv)
    modules = [m.strip() for m in args.handlers.split(",") if m.strip()] or None
    run_dev(args.storage, args.host, args.port, modules)
