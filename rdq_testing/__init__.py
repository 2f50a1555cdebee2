"""Test support for rdq: the servers the tests and the benchmarks start, own and stop
(``rdq_testing.servers``), the process drivers of the chaos tests -- the worker and Lambda
processes they start, journal, kill and freeze, and the history checker that audits a run
(``rdq_testing.chaos``) -- and a watch of how many of a worker fleet's slots are held
(``rdq_testing.slot_watch``).

None of it is the storage contract (that is the compliance kit, ``rdq_core.compliance``, which
drives this package), and none of it is runtime code: it lives outside ``rdq_core``, so the
Lambda artifact, a copy of ``rdq_core``, never carries it.

This module imports nothing: a chaos process started as ``python -m rdq_testing.chaos.worker``
pays for its own imports only, and starts are on the kill path.
"""
