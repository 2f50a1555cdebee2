"""The hosts: what drives the engine, each in its own room.

* ``cli`` -- the ``rdq`` command;
* ``process`` -- ``rdq worker``, a long-running worker, and the supervisor that restarts it;
* ``dev`` -- ``rdq dev``, the whole system on one machine;
* ``console`` -- the operator console, served by ``rdq dev`` and ``rdq console``;
* ``localhttp`` -- the loopback HTTP serving those two share;
* ``aws_lambda`` -- the API, worker and reaper functions (entry points in ``functions/``).

Hosts depend on the engine, the clients and the storage; nothing below imports a host.
"""
