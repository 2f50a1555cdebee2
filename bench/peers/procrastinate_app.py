"""The procrastinate App used by the benchmark (DSN from ``RDQ_BENCH_PROCRASTINATE_DSN``)."""

from __future__ import annotations

import os

from procrastinate import App, PsycopgConnector

from .jobs import noop as _noop

app = App(connector=PsycopgConnector(conninfo=os.environ.get("RDQ_BENCH_PROCRASTINATE_DSN", "")))


@app.task(name="noop", queue=os.environ.get("RDQ_BENCH_QUEUE", "bench"))
def noop() -> None:
    _noop()
