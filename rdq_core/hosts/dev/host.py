"""``DevHost``: one ``rdq dev``, assembled -- its environment, the Lambda functions, the HTTP
front on a loopback port, and the threads that run the worker, the reaper and the schedules."""

from __future__ import annotations

import os
import threading

from ...storage import redact_url
from ..localhttp import BoundedHTTPServer
from .environment import check_host, configure_environment
from .front import EVENTS_PATH, request_handler_class
from .functions import LocalFunctions, run_every

DEFAULT_PORT = 8787


class DevHost:
    def __init__(self, storage_url: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 handler_modules: list[str] | None = None) -> None:
        check_host(host)
        configure_environment(storage_url, handler_modules)
        self.worker_every = float(os.environ.get("RDQ_DEV_WORKER_EVERY_SECONDS", "1"))
        self.reaper_every = float(os.environ.get("RDQ_DEV_REAPER_EVERY_SECONDS", "5"))
        self.worker_timeout = float(os.environ.get("RDQ_DEV_WORKER_TIMEOUT_SECONDS", "30"))
        self.functions = LocalFunctions(self.worker_timeout)  # after the environment
        self.settings = self.functions.settings
        self.storage = self.functions.storage
        self.storage.migrate()
        from ...engine.outbox import LogPublisher

        # Without a bus the reaper delivers the outbox here: a log line per event, kept for the route.
        self.events = LogPublisher()
        if not os.environ.get("RDQ_EVENT_BUS"):
            self.functions.use_publisher(self.events)
        # Schedules (rdq_core.engine.schedules): fired here from the local schedules file, with the ids a
        # deployed stack's EventBridge Scheduler trigger and `rdq worker` use.
        from ...client import Client
        from ...engine.schedules import LocalScheduleBook, ScheduleFirer

        self.schedules_every = float(os.environ.get("RDQ_DEV_SCHEDULES_EVERY_SECONDS", "1"))
        self.schedule_firer = ScheduleFirer(Client(self.storage), LocalScheduleBook())
        self.stopping = threading.Event()
        self.server = BoundedHTTPServer((host, port), request_handler_class(self.functions, self.events))
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        return self.server.base_url

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.server.start("rdq-dev-http")
        self._threads = [
            threading.Thread(target=run_every, args=(self.stopping, self.worker_every, self.functions.invoke_scheduled_worker),
                             name="rdq-dev-worker-schedule", daemon=True),
            threading.Thread(target=run_every, args=(self.stopping, self.reaper_every, self.functions.invoke_reaper),
                             name="rdq-dev-reaper-schedule", daemon=True),
            threading.Thread(target=self.schedule_firer.run, args=(self.stopping, self.schedules_every),
                             name="rdq-dev-schedules", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.server.close(timeout=self.worker_timeout)
        for thread in self._threads:
            thread.join(timeout=self.worker_timeout)
        self.functions.close()

    def banner(self) -> str:
        auth = ' -H "Authorization: Bearer $RDQ_API_TOKEN"' if self.settings.api_token else ""
        base = self.url
        return "\n".join([
            f"rdq dev: API on {base}  (store: {redact_url(os.environ['RDQ_STORAGE_URL'])},"
            f" handlers: {os.environ['RDQ_HANDLERS']})",
            f"  console: {base}/" + ("  (it asks for RDQ_API_TOKEN)" if self.settings.api_token else ""),
            f"  worker every {self.worker_every:g}s, reaper every {self.reaper_every:g}s,"
            f" schedules from {self.schedule_firer.book.path} every {self.schedules_every:g}s; Ctrl-C to stop",
            f"  lifecycle events: logged as the reaper delivers them, and at {base}{EVENTS_PATH}",
            "try:",
            f"  curl -s{auth} -X POST {base}/v1/queues/demo/tasks -H 'Content-Type: application/json'"
            " -d '{\"handler\": \"greet\", \"payload\": {\"name\": \"Ada\"}}'",
            f"  curl -s{auth} -X POST {base}/v1/queues/demo/tasks -H 'Content-Type: application/json'"
            " -d '{\"handler\": \"flaky\", \"payload\": {\"failures\": 2}}'",
            f"  curl -s{auth} -X POST {base}/v1/queues/demo/tasks -H 'Content-Type: application/json'"
            " -d '{\"handler\": \"fail_until_redrive\", \"max_attempts\": 3}'",
            f"  curl -s{auth} {base}/v1/queues/demo/stats",
            f"  curl -s{auth} {base}/v1/queues/demo/dlq",
            f"  curl -s{auth} -X POST {base}/v1/queues/demo/dlq:redrive -H 'Content-Type: application/json'"
            " -d '{\"all\": true}'",
            f"  curl -s{auth} {base}/v1/tasks/<id>",
        ])
