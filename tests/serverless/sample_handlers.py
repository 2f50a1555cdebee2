"""Handlers the serverless tests enqueue (loaded through RDQ_HANDLERS like user code)."""

from __future__ import annotations

import time

from rdq_core import PermanentError, handler

import rdq_core.examples  # noqa: F401 - the shipped sample events use the example handlers


@handler("quick", timeout_seconds=2)
def quick(payload, ctx):
    return {"echo": payload, "attempt": ctx.attempt}


@handler("needs-twenty-seconds", timeout_seconds=20)
def needs_twenty_seconds(payload, ctx):
    time.sleep(0.01)
    return {"done": True}


@handler("always-permanent", timeout_seconds=2)
def always_permanent(payload, ctx):
    raise PermanentError("refused for good")


@handler("report-lease", timeout_seconds=2)
def report_lease(payload, ctx):
    """Returns the lease this task is held under, read back from the store mid-run."""
    from rdq_core.hosts.aws_lambda.connection import shared_storage

    task = shared_storage().get(ctx.task_id)
    return {"lease_expires_at": task.lease_expires_at.isoformat(), "remaining_seconds": ctx.remaining_seconds()}


@handler("report-claimer", timeout_seconds=2)
def report_claimer(payload, ctx):
    """Returns who the store says holds this task's claim, read back mid-run."""
    from rdq_core.hosts.aws_lambda.connection import shared_storage

    return {"claimed_by": shared_storage().get(ctx.task_id).claimed_by}


#: Set by a test to let ``overruns-the-invocation`` return.
OVERRUN_RELEASE = __import__("threading").Event()


@handler("overruns-the-invocation", timeout_seconds=1)
def overruns_the_invocation(payload, ctx):
    """Runs past its own timeout and past the invocation's end (until the test lets it go)."""
    OVERRUN_RELEASE.wait(30)
    return {"late": True}
