"""AWS X-Ray's trace header, read as W3C Trace Context.

API Gateway and Lambda carry a trace as ``X-Amzn-Trace-Id`` (``Root=1-…;Parent=…;Sampled=1``);
Lambda also sets ``_X_AMZN_TRACE_ID`` for each invocation. rdq stores W3C ``traceparent`` values
(``rdq_core/engine/tracecontext.py``): this module turns the one spelling into the other, and a
W3C trace id back into X-Ray's (``1-<8 hex>-<24 hex>``) for annotations.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping

_ROOT = re.compile(r"1-([0-9a-fA-F]{8})-([0-9a-fA-F]{24})")
_HEX16 = re.compile(r"[0-9a-f]{16}")
#: The variable Lambda sets to the invocation's own trace header.
LAMBDA_TRACE_ENV = "_X_AMZN_TRACE_ID"


def header_fields(value: Any) -> dict[str, str]:
    """The ``key=value`` fields of a trace header (the first of a repeated key); ``{}`` for
    anything that is not a string of at most 1024 characters."""
    fields: dict[str, str] = {}
    if isinstance(value, str) and len(value) <= 1024:
        for part in value.split(";"):
            key, sep, item = part.strip(" \t").partition("=")
            if sep:
                fields.setdefault(key, item)
    return fields


def root_trace_id(fields: Mapping[str, str]) -> str | None:
    """The 32-digit W3C trace id of a header's ``Root``, or None."""
    root = _ROOT.fullmatch(fields.get("Root", ""))
    return None if root is None else (root.group(1) + root.group(2)).lower()


def traceparent_text(value: Any) -> str | None:
    """An ``X-Amzn-Trace-Id`` header as a version-00 ``traceparent``: the root's 8 + 24 hex digits
    are the 32-digit trace id, ``Parent`` the parent id, ``Sampled=1`` the sampled flag (anything
    else: not sampled). Without both ``Root`` and ``Parent``, None. The W3C rules (an all-zero id
    is no id) are the caller's to apply."""
    fields = header_fields(value)
    trace_id = root_trace_id(fields)
    parent = fields.get("Parent", "").lower()
    if trace_id is None or not _HEX16.fullmatch(parent):
        return None
    flags = "01" if fields.get("Sampled") == "1" else "00"
    return f"00-{trace_id}-{parent}-{flags}"


def lambda_trace_header() -> str | None:
    """The running Lambda invocation's own trace header (``_X_AMZN_TRACE_ID``), None elsewhere."""
    return os.environ.get(LAMBDA_TRACE_ENV)


def xray_trace_id(trace_id: str) -> str:
    """A 32-hex-digit W3C trace id spelt as X-Ray spells it."""
    return f"1-{trace_id[:8]}-{trace_id[8:]}"
