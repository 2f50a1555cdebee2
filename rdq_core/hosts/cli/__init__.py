"""The ``rdq`` command line, one module per command group.

* ``main``: the global options, the dispatch and the exit codes;
* ``hosts``: ``migrate``, ``dev``, ``worker``, ``reaper``, ``invoke`` (worker supervision lives
  beside the worker, in ``rdq_core.hosts.process.supervisor``);
* ``tasks``: ``enqueue``, ``stats``, ``queues``, ``tasks``, ``task``;
* ``operator``: ``cancel``, ``pause``/``resume``, ``dlq``, ``operations``, ``audit``;
* ``schedules``: ``schedules``; the console's own command is ``rdq_core.hosts.console.server``'s;
* ``common``: the client or store a command acts on, argument readers, policies and targets;
* ``output``: printing, tables, ``--json``, errors and the confirmation prompt.

``main(argv)`` runs a command in this process and returns its exit code, so most command tests
need no subprocess.
"""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
