"""``rdq dev``: the whole serverless system on one machine, driving the real Lambda handlers.

* the API handler (``rdq_core.hosts.aws_lambda.api``) served over HTTP on 127.0.0.1: each request is
  translated into the API Gateway REST proxy event Lambda would receive, and the proxy result
  back into an HTTP response, so the routes are the deployed API's (``aws_lambda/routes.py``);
  the server's own refusals are problem+json from the same builder (``rdq_core.problems``);
* the worker and reaper handlers invoked on their schedules with EventBridge's scheduled-event
  shape and a Lambda context whose remaining time really counts down;
* the API's worker wake-up and the worker's fan-out run as local asynchronous invocations,
  bounded like the deployed reserved concurrency;
* the embedded SQLite store by default, migrated on start; the example handlers
  (``rdq_core.examples``) loaded unless others are named;
* the operator console (``rdq_core.hosts.console``) at ``/``: its static files (GET/HEAD of ``/``,
  ``/index.html`` and the asset names in ``console.assets.ASSETS``, nothing else) with a strict
  Content-Security-Policy; the page calls the API at ``v1/...`` on the same origin.

Optional bearer token: set ``RDQ_API_TOKEN`` and every API request needs ``Authorization: Bearer …``
(checked before the body is read); the console's static files are served without it, and the
page asks for it. Without one, only ``Host: 127.0.0.1``, ``localhost`` or ``[::1]``
is served (DNS rebinding). Slow clients are bounded: see ``localhttp.BoundedHTTPServer``.

Logs: the Lambda handlers log through this process's own logging (``rdq_core.engine.logs``): one
readable line per task outcome on a terminal, JSON lines otherwise or with ``--log-format json``
(``RDQ_LOG_FORMAT``). None of the Lambda context fields, and no EMF metrics: Powertools metrics
are off here (the deployed functions keep both).

The rooms: ``environment`` (what is set before the Lambda modules load, where it may listen),
``functions`` (the three functions run locally), ``front`` (the HTTP front), ``host`` (``DevHost``,
the assembly) and ``command`` (the process).
"""

from .command import main, run_dev
from .front import EVENTS_PATH
from .host import DEFAULT_PORT, DevHost

__all__ = ["DEFAULT_PORT", "EVENTS_PATH", "DevHost", "main", "run_dev"]
