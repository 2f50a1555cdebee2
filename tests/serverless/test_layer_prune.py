"""What functions/layer/prune.txt removes from a layer is nothing a function reaches: with
rdq_core and Powertools copied and pruned the same way as the only copies on the path, the three
functions' entry points (functions/*/app.py) run their sample events and load both from there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

powertools = pytest.importorskip("aws_lambda_powertools")

# One invocation of functions/<function>/app.py, as the Lambda runtime makes it.
RUN = """
import json, runpy, sys
layer, function, event_file = sys.argv[1:4]
app = runpy.run_path(f"{sys.argv[4]}/functions/{function}/app.py")
import aws_lambda_powertools, rdq_core
for module in (aws_lambda_powertools, rdq_core):
    assert module.__file__.startswith(layer), module.__file__
from rdq_core.hosts.aws_lambda.local_invoke import LocalLambdaContext
event = json.loads(open(event_file).read())
print(json.dumps(app["lambda_handler"](event, LocalLambdaContext(f"rdq-{function}", 10)), default=str))
"""


def _pruned_layer(into: Path) -> Path:
    """rdq_core and the installed Powertools under ``into``, with prune.txt's globs applied."""
    shutil.copytree(ROOT / "rdq_core", into / "rdq_core", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(Path(powertools.__file__).parent, into / "aws_lambda_powertools",
                    ignore=shutil.ignore_patterns("__pycache__"))
    removed = set()
    for line in (ROOT / "functions" / "layer" / "prune.txt").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        for path in into.glob(pattern):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed.add(pattern.split("/")[0])
    assert removed >= {"rdq_core", "aws_lambda_powertools"}, f"prune.txt removed nothing from {removed}"
    return into


@pytest.mark.parametrize("function, event", [
    ("api", "api-enqueue.json"), ("api", "api-openapi.json"), ("api", "api-queue-stats.json"),
    ("worker", None), ("reaper", None),
])
def test_each_function_runs_on_a_pruned_layer(tmp_path, function, event):
    layer = _pruned_layer(tmp_path / "layer")
    event_file = ROOT / "events" / event if event else tmp_path / "scheduled.json"
    if event is None:
        event_file.write_text(json.dumps({"source": "aws.events", "detail-type": "Scheduled Event", "detail": {}}))
    env = dict(os.environ, PYTHONPATH=str(layer), RDQ_STORAGE_URL=f"sqlite:///{tmp_path}/rdq.db",
               RDQ_AUTO_MIGRATE="true", RDQ_HANDLERS="rdq_core.examples", POWERTOOLS_TRACE_DISABLED="true",
               POWERTOOLS_SERVICE_NAME="rdq")
    proc = subprocess.run([sys.executable, "-c", RUN, str(layer), function, str(event_file), str(ROOT)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if function == "api":
        assert result["statusCode"] < 500, result
