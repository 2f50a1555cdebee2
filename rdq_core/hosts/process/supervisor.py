"""Supervising a worker process (``rdq worker``): stop signals, the processes handlers leave
behind, and the restart that stops a handler which will not return.

* The first SIGINT/SIGTERM drains: running tasks finish, unstarted claims are released.
* The second stops at once: buffered outcomes are written and unstarted claims released (at most
  5 s), the processes the running handlers started are ended, and the process exits 130. Their
  tasks run again once their leases lapse.
* A handler past its timeout plus the overrun grace makes ``Worker.run_forever`` return with
  ``HANDLER_OVERRAN``: the processes it started are ended while its lease is still fresh, then
  this process image is replaced (same PID, same arguments), the one way to stop a Python thread
  that will not return. Stop signals are held across the exec, never lost.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Callable, ContextManager

from ...engine import process_tree
from ...engine.retry import PolicyBook
from ...storage.spi import Storage
from ..signals import STOP_SIGNALS, StopSignals
from .worker import HANDLER_OVERRAN, Worker, WorkerConfig

log = logging.getLogger("rdq.cli")

#: The exit status of a worker stopped at once by a second signal (as after Ctrl-C twice).
EXIT_STOPPED_AT_ONCE = 130


def end_leftovers_of_previous_image() -> frozenset[int]:
    """The processes this one inherited (not the handlers' to end), after ending those the
    previous image's handlers left running: after a restart, a process the old handlers started
    in the instant before the exec is under this one now, and is ended before anything is claimed."""
    restarted = process_tree.restarted()
    inherited = process_tree.inherited_pids()
    # On a first start everything under this process is inherited: one walk of the process
    # table is enough (it is a few milliseconds of every start).
    if restarted and process_tree.descendants(exclude=inherited):
        ended = process_tree.end_descendants(exclude=inherited)
        log.warning("ended %d process(es) the previous worker image's handlers left running: %s",
                    len(ended), ", ".join(map(str, ended)))
    return inherited


def run_worker_process(open_store: Callable[[], ContextManager[Storage]], config: WorkerConfig,
                       policies: PolicyBook, inherited: frozenset[int], describe: Callable[[], str]) -> None:
    """Run a ``Worker`` on the store ``open_store`` opens until it is stopped, supervised as the
    module says; ``describe`` gives the start-up line once handlers are installed."""
    signals = StopSignals()
    with open_store() as storage:
        worker = Worker(storage, config, policies=policies)
        signals.install(lambda count: _on_stop_signal(worker, count, inherited))
        # A stop signal that arrived while this process image was replaced (see below) has been
        # held pending; with the handlers installed it is delivered now and drains as usual.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        log.info("%s", describe())
        worker.run_forever()
        abandoned = worker.overruns()
        if abandoned:
            # Their outcomes, should the kill below make them return, must not be written.
            worker.drop_late_outcomes()
    if abandoned:
        # An overrunning handler's thread ends with this process image, but the processes it
        # started do not: killed now, while its lease is still fresh, so the task's next attempt
        # (once the lease lapses) never runs beside them.
        ended = process_tree.end_descendants(exclude=inherited)
        if ended:
            log.error("ended %d process(es) started by the overrunning handler(s): %s",
                      len(ended), ", ".join(map(str, ended)))
    if worker.exit_reason == HANDLER_OVERRAN:
        # Stop signals are held from here until the new image has its handlers: one sent in
        # between stays pending across exec (the blocked mask and pending signals survive it)
        # instead of being lost here or killing the new image before it can drain.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        if not signals.count:
            # The one way to stop a thread that will not return: replace the process (same PID,
            # same arguments). Its task's lease is no longer renewed from here on, so it lapses
            # and is retried; nothing can run it while the old handler still does.
            log.error("restarting this worker process to stop the overrunning handler")
            logging.shutdown()
            process_tree.carry_inherited(inherited)
            os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    log.info("worker stopped")


def _on_stop_signal(worker: Worker, count: int, inherited: frozenset[int]) -> None:
    if count == 1:
        overrunning = {o.task_id for o in worker.overruns()}
        running = {t: name for t, name in worker.running().items() if t not in overrunning}
        waits = (f"waiting for {len(running)} running task(s) to finish: "
                 + ", ".join(f"{task_id} ({name})" for task_id, name in running.items())
                 ) if running else "no task is running"
        if overrunning:
            waits += (f"; {len(overrunning)} handler(s) past their timeout are not waited for (their tasks "
                      f"are retried once their lease expires): {', '.join(sorted(overrunning))}")
        log.warning("stopping: %s; unstarted claims are released. Press Ctrl-C again to stop at once", waits)
        worker.stop()
        return
    # Bounded: a store that hangs must not keep the operator's second Ctrl-C waiting.
    result: list[int] = []
    settling = threading.Thread(target=lambda: result.append(worker.settle_and_release_now()), daemon=True)
    settling.start()
    settling.join(5.0)
    running = worker.running()
    # The running handlers' tasks will run again once their leases lapse: what those handlers
    # started must not outlive this process and run beside them.
    worker.drop_late_outcomes()
    ended = process_tree.end_descendants(exclude=inherited)
    log.warning("stopping at once: released %s unstarted claim(s); %d running task(s) will be retried "
                "when their lease expires%s", result[0] if result else "no", len(running),
                f"; ended {len(ended)} process(es) their handlers started" if ended else "")
    logging.shutdown()
    os._exit(EXIT_STOPPED_AT_ONCE)
