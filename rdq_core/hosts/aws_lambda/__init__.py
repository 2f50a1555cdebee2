"""The Lambda host: the wiring shared by the three functions in ``functions/``.

``functions/api``, ``functions/worker`` and ``functions/reaper`` are one-line entry points; all of
their logic lives here, once, so ``rdq dev`` (``rdq_core.hosts.dev``) can drive the very same code
with the same event shapes Lambda sends.

| module | what it is |
| --- | --- |
| ``settings`` | configuration read from the function's environment |
| ``connection`` | the storage URL (env, Secrets Manager or SSM, cached) and the one warm connection |
| ``observability`` | Powertools Logger / Metrics (EMF) / Tracer and the engine-telemetry bridge |
| ``api`` | the REST API handler (``APIGatewayRestResolver``) |
| ``openapi`` | the OpenAPI 3 document served at ``GET /v1/openapi.json`` |
| ``worker`` | the scheduled worker: claim with an invocation-sized lease, run, settle, fan out |
| ``invoker`` | asynchronous worker invocations (fan-out, API wake-up), bounded and debounced |
| ``reaper`` | the scheduled reaper and the queue-depth metrics |
| ``local_invoke`` | Lambda-shaped events and a context with a real deadline, for local hosts and tests |
"""
