"""Poison handlers for the fault suite, loaded by ``rdq worker --handlers tests.faults.poison_handlers``."""

from __future__ import annotations

import os
import time

from rdq_core import handler


@handler("fault.ok")
def ok(payload, ctx):
    return {"ok": payload["n"]}


@handler("poison.exit")
def exit_the_process(payload, ctx):
    os._exit(17)  # no cleanup, no settle, no release: only the lease and the reaper remain


@handler("poison.memory")
def exhaust_memory(payload, ctx):
    hoard = []
    while True:  # the worker runs under RLIMIT_AS, so this ends in MemoryError, not the OOM killer
        hoard.append(bytearray(16 * 1024 * 1024))


@handler("poison.recursion")
def recurse_without_bound(payload, ctx):
    def deeper(n):
        return deeper(n + 1) + 1

    return deeper(0)


@handler("poison.hang", timeout_seconds=0.5)
def hang_past_the_deadline(payload, ctx):
    time.sleep(30)  # the worker abandons it after 0.5 s; the process exits before it wakes


@handler("poison.unserialisable")
def return_unserialisable(payload, ctx):
    kind = payload["kind"]
    if kind == "object":
        return {"value": object()}
    if kind == "circular":
        loop = {}
        loop["self"] = loop
        return loop
    if kind == "nan":
        return {"value": float("nan")}
    if kind == "deep":
        nested: list = []
        for _ in range(100_000):
            nested = [nested]
        return nested
    raise ValueError(kind)


class _Undescribable(Exception):
    def __str__(self):
        raise RuntimeError("even describing this error fails")


@handler("poison.undescribable")
def raise_undescribable(payload, ctx):
    raise _Undescribable()
