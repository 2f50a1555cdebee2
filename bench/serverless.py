"""Serverless figures: cold import time per Lambda entry point, artifact size per function."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .common import ROOT, child_env, median

# The module each function's handler lives in, as template.yaml will name it; while a function
# does not exist yet, the engine modules it will import are measured instead (and said so).
FUNCTIONS = {
    "worker": {"modules": ["functions/worker/app.py"], "fallback": ["rdq_core.hosts.process.worker", "rdq_core.engine.runner"]},
    "reaper": {"modules": ["functions/reaper/app.py"], "fallback": ["rdq_core.engine.reaper"]},
    "api": {"modules": ["functions/api/app.py"], "fallback": ["rdq_core.client", "rdq_core.validation"]},
}
BACKEND_MODULES = {"postgres": "rdq_core.storage.postgres", "redis": "rdq_core.storage.redis", "mongo": "rdq_core.storage.mongo"}


def _top_level_imports(statement: str, env: dict[str, str], cwd: str) -> dict[str, int]:
    """Run ``python -X importtime -c statement`` in a fresh interpreter; top-level cumulative µs."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=120,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    out: dict[str, int] = {}
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        parts = line.split("|")
        raw_name = parts[2].rstrip()
        if len(raw_name) - len(raw_name.lstrip()) != 1:  # nested import: counted by its parent
            continue
        name = raw_name.strip()
        out[name] = out.get(name, 0) + int(parts[1].strip())
    return out


def import_time_ms(modules: list[str], env: dict[str, str], cwd: str, runs: int = 5) -> dict[str, Any]:
    """Median over ``runs`` fresh interpreters of the import cost of ``modules`` beyond what the
    bare interpreter already imports at startup."""
    baseline = set(_top_level_imports("pass", env, cwd))
    statement = "; ".join(f"import {m}" for m in modules)
    totals = []
    for _ in range(runs):
        tops = _top_level_imports(statement, env, cwd)
        totals.append(sum(us for name, us in tops.items() if name not in baseline) / 1000)
    return {"modules": modules, "median_ms": median(totals), "runs_ms": totals}


def cold_imports(runs: int = 5) -> list[dict[str, Any]]:
    rows = []
    env = child_env(POWERTOOLS_TRACE_DISABLED="1", AWS_DEFAULT_REGION="us-east-1")
    for function, spec in FUNCTIONS.items():
        handler_files = [p for p in spec["modules"] if (ROOT / p).exists()]
        for backend, backend_module in BACKEND_MODULES.items():
            if handler_files:
                path = ROOT / handler_files[0]
                cwd = str(path.parent)
                modules = [path.stem, backend_module]
                measured = f"{handler_files[0]} + {backend_module}"
                run_env = dict(env, PYTHONPATH=os.pathsep.join([cwd, env["PYTHONPATH"]]))
            else:
                cwd = str(ROOT)
                modules = [*spec["fallback"], backend_module]
                measured = " + ".join(modules) + " (functions/ not written yet)"
                run_env = env
            try:
                result = import_time_ms(modules, run_env, cwd, runs)
                rows.append({"function": function, "backend": backend, "measured": measured, **result})
            except Exception as exc:  # noqa: BLE001 - a handler module that cannot import yet is reported, not fatal
                rows.append({"function": function, "backend": backend, "measured": measured, "error": str(exc)[-500:]})
    return rows


def _du_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            fp = os.path.join(root, name)
            if not os.path.islink(fp):
                total += os.path.getsize(fp)
    return total


def artifact_sizes() -> list[dict[str, Any]]:
    """What one deployed function carries: the layer recipe of its backend (the requirement files
    of ``functions/requirements/``, pruned like ``functions/layer/Makefile``) + rdq_core."""
    requirements = ROOT / "functions" / "requirements"
    combos = {  # name -> requirement files (the engine layers also carry rdq_core)
        "postgres": ["common", "postgresql"],
        "redis": ["common", "redis"],
        "mongo": ["common", "mongodb"],
        "all-backends": ["common", "postgresql", "redis", "mongodb"],  # for comparison: one shared layer
        "tracing layer (EnableTracing=true only)": ["tracing"],
    }
    rows = []
    with tempfile.TemporaryDirectory(prefix="rdq-artifact-") as tmp:
        for index, (name, files) in enumerate(combos.items()):
            target = Path(tmp) / f"artifact-{index}"
            drivers = [str(requirements / f"{f}.txt") for f in files]
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile",
                   "--target", str(target)]
            for file in drivers:
                cmd += ["-r", file]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                rows.append({"deps": name, "error": proc.stderr[-1000:]})
                continue
            if "common" in files:
                shutil.copytree(ROOT / "rdq_core", target / "rdq_core", ignore=shutil.ignore_patterns("__pycache__"))
            # The same pruning as the real layer build (functions/layer/prune.txt): boto3 and
            # botocore are in the Lambda runtime, the kit and the Swagger UI assets are not shipped.
            for line in (ROOT / "functions" / "layer" / "prune.txt").read_text().splitlines():
                pattern = line.strip()
                if not pattern or pattern.startswith("#"):
                    continue
                for dropped in target.glob(pattern):
                    if dropped.is_dir():
                        shutil.rmtree(dropped, ignore_errors=True)
                    else:
                        dropped.unlink()
            has_boto = any(p.name.startswith(("boto3", "botocore")) for p in target.iterdir())
            size = _du_bytes(target)
            rows.append({
                "deps": name, "packages": [Path(d).name for d in drivers] + (["rdq_core"] if "common" in files else []),
                "unzipped_mb": size / 1e6, "boto3_present": has_boto,
            })
    return rows
