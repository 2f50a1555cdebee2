"""A local Lambda emulator that runs rdq's real worker function as a fleet, and its bench.

``python -m bench.lambda_fleet run …`` (one scenario), ``… compare …`` (rdq at H=1 and H=8
against the SQS + Lambda model, the table in BENCHMARKS.md). Parts:

* ``template.py``: the worker function as ``template.yaml`` declares it (environment, timeout,
  memory, reserved concurrency, event-invoke config), with a scenario's parameters;
* ``emulator.py``: the Invoke API over HTTP on 127.0.0.1 (boto3 reaches it through
  ``AWS_ENDPOINT_URL_LAMBDA``), concurrency limit, async event queue, execution environments
  frozen between invocations, SIGKILL at the timeout;
* ``runtime.py``: one execution environment (imports ``functions/worker/app.py`` once);
* ``handlers.py``: the bench's handlers (no-op, I/O-bound sleep), which log every run;
* ``scenario.py``: a backlog, schedule ticks and API wake-ups; drain, fleet, cost, safety checks;
* ``sqs_model.py``: the same backlog on SQS + Lambda as a stated model, and list prices.

What of real Lambda it does not model:

* cold starts take what importing the function takes on this machine, on a shared CPU: no
  sandbox creation, code download, layer extraction or runtime bootstrap, and not Lambda's
  latency distribution; a cold environment is started on demand, never ahead of time;
* CPU: an environment gets what the host's scheduler gives it, not a share proportional to its
  memory; memory is not limited and out-of-memory is not modelled;
* networking: the database and the Invoke API are on loopback (no VPC, no ENI, no TLS, no
  latency to RDS or ElastiCache); the async queue hands an event to the dispatcher at once
  (Lambda's internal queue adds its own delay), and ``Event`` invokes always succeed;
* limits: one concurrency number per function (reserved, else the account's, as given); no
  burst or scaling-rate limit (1,000 new environments per 10 s per function), no per-account
  request rate, no payload size limit, no provisioned concurrency, no SnapStart;
* environments are never reclaimed while idle, nor recycled after hours, nor spread over hosts;
  the most recently used is reused first;
* event age is measured on this host's monotonic clock (no skew between Lambda's queue and
  the function); throttle retries follow Lambda's documented backoff (1 s doubling to 5 min)
  but not its jitter; retries of failed events wait 1 and 2 minutes, as documented;
* no layers, no extensions, no ``/tmp`` limit, no log delivery (each environment's output goes to
  a file), no X-Ray; the IAM permissions in the template are not checked;
* billing: duration rounded up to 1 ms plus the init phase of cold starts; no free tier, no
  tiered prices, no ephemeral storage charge.
"""
