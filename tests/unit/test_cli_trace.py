"""``rdq enqueue`` carries a trace context: ``--traceparent``/``--tracestate``, else the
``TRACEPARENT``/``TRACESTATE`` environment variables; an invalid one is dropped with a note."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def rdq(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("RDQ_STORAGE_URL", "TRACEPARENT", "TRACESTATE")}
    done = subprocess.run([sys.executable, "-m", "rdq_core.hosts.cli", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={**environ, "PYTHONPATH": str(REPO), "RDQ_LOG_LEVEL": "WARNING", **env})
    assert done.returncode == 0, done.stderr
    return done


def headers_of(done: subprocess.CompletedProcess) -> dict[str, str]:
    return json.loads(done.stdout)["headers"]


def test_enqueue_takes_the_trace_context_from_its_options_then_the_environment(tmp_path):
    assert headers_of(rdq(tmp_path, "enqueue", "q", "h", "--json", "--traceparent", TRACEPARENT, "--tracestate", "a=1")) == {
        "rdq.traceparent": TRACEPARENT, "rdq.tracestate": "a=1"}
    assert headers_of(rdq(tmp_path, "enqueue", "q", "h", "--json", TRACEPARENT=TRACEPARENT)) == {"rdq.traceparent": TRACEPARENT}
    assert headers_of(rdq(tmp_path, "enqueue", "q", "h", "--json")) == {}


def test_an_invalid_traceparent_is_dropped_with_a_note_and_the_task_enqueued(tmp_path):
    done = rdq(tmp_path, "enqueue", "q", "h", "--json", "--traceparent", "00-bad")
    assert headers_of(done) == {}
    assert "not a valid W3C traceparent" in done.stderr
