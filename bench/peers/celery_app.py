"""The Celery app used by the benchmark: Redis broker, keys under our own prefix, no results."""

from __future__ import annotations

from celery import Celery

from .jobs import noop as _noop


def make_app(url: str, queue: str) -> Celery:
    app = Celery("rdqbench", broker=url)
    app.conf.update(
        task_default_queue=queue,
        task_ignore_result=True,  # no result backend: the documented setting for fire-and-forget jobs
        broker_transport_options={"global_keyprefix": f"{queue}:"},
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )

    @app.task(name="noop")
    def noop() -> None:
        _noop()

    return app
