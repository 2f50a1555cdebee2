"""Handlers of the large-payload tests (loaded through RDQ_HANDLERS like user code)."""

from __future__ import annotations

import hashlib
import json

from rdq_core import PermanentError, handler


@handler("digest", timeout_seconds=5)
def digest(payload, ctx):
    """What the handler saw: the payload's size and hash once encoded, and its first key."""
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "keys": sorted(payload)}


@handler("big-result", timeout_seconds=5)
def big_result(payload, ctx):
    return {"rows": ["r" * 100 for _ in range(int(payload["rows"]))]}


@handler("reserved-result", timeout_seconds=5)
def reserved_result(payload, ctx):
    return {"$rdq_s3": {"bucket": "b", "key": "results/q/x/y", "size": 1, "sha256": "0" * 64}}


@handler("refuse", timeout_seconds=5)
def refuse(payload, ctx):
    raise PermanentError("refused for good")
