"""The process drivers of the chaos tests (the tests themselves are the kit's ``ChaosCompliance``
and ``ExactlyOnceChaosCompliance``, in ``rdq_core.compliance``).

* ``worker``, ``lambda_container``, ``exactly_once_worker`` -- the chaos processes: the real
  engine behind a storage wrapper that journals every call, run as
  ``python -m rdq_testing.chaos.<module>``;
* ``fleet`` -- starts them (with ready spares), kills them by PID, and runs a reaper and a
  queue watcher beside them;
* ``killer`` -- arms processes for a kill aim and SIGKILLs the one that holds there;
* ``journal`` -- reads the journals; ``history`` -- the audit every run ends with, holding
  every claim, execution and kill against the store;
* ``runs`` -- the worker, runner-path and Lambda runs; ``exactly_once`` -- kills and freezes
  around ``ctx.transaction()``'s COMMIT.

Nothing is imported here: a chaos process pays for its own module's imports only.
"""
