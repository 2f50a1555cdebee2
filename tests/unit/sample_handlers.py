"""Handlers used by the CLI and worker tests (imported by name, like RDQ_HANDLERS)."""

from rdq_core import PermanentError, handler


@handler("sample.ok")
def ok(payload, ctx):
    return {"echo": payload, "attempt": ctx.attempt}


@handler("sample.fatal")
def fatal(payload, ctx):
    raise PermanentError("refusing on purpose")
