"""Render results.json as the Markdown tables BENCHMARKS.md quotes."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .common import median


def _f(value: Any, digits: int = 0) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _group(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        out[tuple(row.get(k) for k in keys)].append(row)
    return out


def head_to_head_summary(data: dict) -> dict[str, Any]:
    """Median tasks/s per (system, backend, W), rdq's ratio to the best peer, ceiling fraction."""
    med = {
        key: median([r["process_tasks_per_s"] for r in rows])
        for key, rows in _group(data.get("head_to_head", []), "system", "backend", "workers").items()
    }
    ceiling = _ceiling_medians(data.get("ceiling", []))
    # The bare floor on each rdq backend that has one: SKIP LOCKED on PostgreSQL, Lua on Redis.
    ceilings = {"postgres": ceiling, "redis": _ceiling_medians(data.get("redis_ceiling", []))}
    ratios = []
    for (system, backend, w), value in sorted(med.items()):
        if system != "rdq":
            continue
        peers = {s: v for (s, b, ww), v in med.items() if s != "rdq" and b == backend and ww == w and v}
        best = max(peers.items(), key=lambda kv: kv[1]) if peers else (None, None)
        ratios.append({
            "backend": backend, "workers": w, "rdq": value, "best_peer": best[0], "best_peer_tasks_per_s": best[1],
            "ratio": value / best[1] if best[1] else None,
            "ceiling": ceilings.get(backend, {}).get(w),
            "ceiling_fraction": value / ceilings[backend][w] if ceilings.get(backend, {}).get(w) else None,
        })
    return {"medians": med, "ratios": ratios, "ceiling": ceiling, "redis_ceiling": ceilings["redis"]}


def _ceiling_medians(rows: list[dict]) -> dict[int, float | None]:
    """Median rows/s per client count."""
    return {k[0]: median([r["rows_per_s"] for r in group]) for k, group in _group(rows, "clients").items()}


def render(data: dict) -> str:
    out = ["# rdq benchmark results", ""]
    m = data.get("machine", {})
    out.append(f"- command: `{data.get('command')}`")
    out.append(f"- started: {data.get('started')}; elapsed: {_f(data.get('elapsed_seconds'), 0)} s")
    out.append(f"- machine: {m.get('cpu_model')} × {m.get('cpus')} CPUs, {m.get('mem_total_gib')} GiB, "
               f"{m.get('platform')}, Python {m.get('python')}")
    loads = ", ".join(f"{x['at']}: {x['loadavg'][0]:.2f}" for x in data.get("load", []))
    out.append(f"- 1-min load average during the run: {loads}")
    if data.get("peer_versions"):
        out.append("- peer versions: " + ", ".join(f"{k} {v}" for k, v in data["peer_versions"].items()))
    out.append("")

    if data.get("round_trips"):
        out += ["## Round trips per task", ""]
        rows = [
            [r["backend"], str(r["batch"]), _f(r["enqueue"], 3), _f(r["claim"], 3), _f(r["settle"], 3),
             _f(r["claim_settle"], 3), _f(r["total"], 3),
             ("yes" if r["claim_settle"] <= 0.05 else "**no**") if r["batch"] == 100 else ""]
            for r in data["round_trips"]
        ]
        out += [_table(["backend", "batch", "enqueue", "claim", "settle", "claim+settle", "total", "≤ 0.05 at batch 100"], rows),
                ""]

    if data.get("e2e"):
        out += ["## End-to-end throughput (median of runs)", ""]
        rows = []
        for (backend, w, batch), group in sorted(_group(data["e2e"], "backend", "workers", "batch").items()):
            rows.append([
                backend, str(w), str(batch), str(group[0]["n"]), str(len(group)),
                _f(median([g["enqueue_tasks_per_s"] for g in group])),
                _f(median([g["process_tasks_per_s"] for g in group])),
                _f(median([g["claim_settle_round_trips_per_task"] for g in group]), 3),
                _f(max(g["worker_peak_rss_mb"] for g in group), 1),
            ])
        out += [_table(["backend", "W", "batch", "N", "runs", "enqueue tasks/s", "process tasks/s",
                        "claim+settle RT/task", "worker peak RSS MiB"], rows), ""]

    if data.get("head_to_head") or data.get("ceiling") or data.get("redis_ceiling"):
        summary = head_to_head_summary(data)
        out += ["## Head to head, same servers, same run (median tasks/s)", ""]
        rows = []
        for (system, backend, w), group in sorted(_group(data.get("head_to_head", []), "system", "backend", "workers").items(),
                                                  key=lambda kv: (kv[0][1], kv[0][2], kv[0][0] != "rdq", kv[0][0])):
            rows.append([system, backend, str(w), str(group[0]["n"]), str(len(group)),
                         _f(median([g["enqueue_tasks_per_s"] for g in group])),
                         _f(median([g["process_tasks_per_s"] for g in group])),
                         _f(max(g["worker_peak_rss_mb"] for g in group), 1)])
        out += [_table(["system", "backend", "W", "N", "runs", "enqueue tasks/s", "process tasks/s", "peak RSS MiB"], rows), ""]
        rows = [[r["backend"], str(r["workers"]), _f(r["rdq"]), f"{r['best_peer']} {_f(r['best_peer_tasks_per_s'])}",
                 _f(r["ratio"], 2) + "×" if r["ratio"] else "–",
                 _f(r["ceiling"]),
                 _f(r["ceiling_fraction"] * 100 if r["ceiling_fraction"] else None, 0) + ("%" if r["ceiling_fraction"] else "")]
                for r in summary["ratios"]]
        out += ["### rdq against the best peer and the bare ceiling (PostgreSQL: SKIP LOCKED; Redis: Lua)", "",
                _table(["backend", "W", "rdq tasks/s", "best peer tasks/s", "rdq / best peer", "ceiling rows/s", "rdq / ceiling"],
                       rows), ""]
        rows = [[store, str(clients), str(group[0]["n"]), str(group[0]["batch"]), str(len(group)),
                 _f(median([g["rows_per_s"] for g in group]))]
                for store, section in (("postgres", "ceiling"), ("redis", "redis_ceiling"))
                for (clients,), group in sorted(_group(data.get(section, []), "clients").items())]
        if rows:
            out += ["### The bare ceilings (PostgreSQL: SKIP LOCKED claim + one bulk update; "
                    "Redis: one Lua claim + one Lua ack; median rows/s)", "",
                    _table(["store", "clients", "N", "batch", "runs", "rows/s"], rows), ""]

    if data.get("idle_latency"):
        out += ["## enqueue→start into an idle worker (median over runs of each run's percentile)", ""]
        rows = []
        for (system, backend), group in sorted(_group(data["idle_latency"], "system", "backend").items()):
            rows.append([system, backend, str(group[0]["n"]), str(len(group)),
                         _f(median([g["p50_ms"] for g in group]), 1), _f(median([g["p99_ms"] for g in group]), 1),
                         _f(max(g["max_ms"] for g in group), 1)])
        out += [_table(["system", "backend", "tasks per run", "runs", "p50 ms", "p99 ms", "max ms"], rows), ""]

    if data.get("wake_overhead"):
        out += ["## What the wake-up costs an enqueue (median ms, wake-up on / off, alternating blocks)", ""]
        rows = [[r["backend"], f"{_f(r['single_on_ms'], 2)} / {_f(r['single_off_ms'], 2)}",
                 _f((r["single_on_ms"] / r["single_off_ms"] - 1) * 100, 1) + " %",
                 f"{_f(r['batch500_on_ms'], 1)} / {_f(r['batch500_off_ms'], 1)}",
                 _f((r["batch500_on_ms"] / r["batch500_off_ms"] - 1) * 100, 1) + " %",
                 f"{r['single_n']} / {r['batch_n']}"]
                for r in data["wake_overhead"]]
        out += [_table(["backend", "1 task: on / off", "difference", "500 tasks: on / off", "difference",
                        "samples per side (1 / 500)"], rows), ""]

    if data.get("wake_trigger"):
        out += ["### The PostgreSQL trigger's own server time (EXPLAIN ANALYZE, median ms: trigger of statement)", ""]
        rows = [[f"{_f(r['one_due_trigger_ms'], 3)} of {_f(r['one_due_statement_ms'], 3)}",
                 f"{_f(r['batch500_due_trigger_ms'], 3)} of {_f(r['batch500_due_statement_ms'], 3)}",
                 f"{_f(r['one_notify_trigger_ms'], 3)} of {_f(r['one_notify_statement_ms'], 3)}", str(r["samples"])]
                for r in data["wake_trigger"]]
        out += [_table(["1 row, queue has due tasks (no NOTIFY)", "500 rows, queue has due tasks",
                        "1 row into an empty queue (NOTIFY)", "samples (1-row)"], rows), ""]

    if data.get("wake_overhead_concurrent"):
        out += ["### Concurrent producers (enqueues/s, median of rounds, wake-up on / off)", ""]
        rows = [[r["backend"], str(r["producers"]), str(r["rounds"]), f"{_f(r['on_per_s'])} / {_f(r['off_per_s'])}",
                 _f((r["on_per_s"] / r["off_per_s"] - 1) * 100, 1) + " %"]
                for r in data["wake_overhead_concurrent"]]
        out += [_table(["backend", "producer threads", "rounds per side", "on / off", "difference"], rows), ""]

    if data.get("steady"):
        out += ["## Steady mixed load: a fixed enqueue rate while one `rdq worker` drains, 1 % failures retried "
                "(median over runs)", ""]
        rows = []
        for (backend, rate), group in sorted(_group(data["steady"], "backend", "rate_per_s").items()):
            def mid(part: str, key: str, group: list[dict] = group) -> str:
                return _f(median([g[part][key] for g in group]), 1)
            rows.append([backend, _f(rate), str(group[0]["n"]), str(len(group)),
                         _f(median([g["offered_per_s"] for g in group])),
                         _f(median([g["throughput_per_s"] for g in group])), str(group[0]["retried"]),
                         mid("enqueue_call", "p50_ms"), f"{mid('start', 'p50_ms')} / {mid('start', 'p99_ms')}",
                         f"{mid('done', 'p50_ms')} / {mid('done', 'p99_ms')}",
                         f"{mid('done_first_try', 'p50_ms')} / {mid('done_first_try', 'p99_ms')}"])
        out += [_table(["backend", "rate /s", "tasks", "runs", "offered /s", "throughput /s", "retried", "enqueue call p50 ms",
                        "enqueue→start p50 / p99 ms", "enqueue→done p50 / p99 ms",
                        "enqueue→done, not retried, p50 / p99 ms"], rows), ""]

    if data.get("backlog"):
        out += ["## Cost against backlog (claim batch 100; reaper over the expired leases)", ""]
        base = {}
        rows = []
        for r in data["backlog"]:
            base.setdefault(r["backend"], r["claim_p50_ms"])
            rows.append([r["backend"], f"{r['pending']:,}", f"{r['expired']:,}", _f(r["load_seconds"], 1),
                         _f(r["claim_p50_ms"], 2), _f(r["claim_p99_ms"], 2),
                         _f(r["claim_p50_ms"] / base[r["backend"]], 2) + "×",
                         _f(r.get("reap_tasks_per_s")), f"{r.get('reaped', 0):,}"])
        out += [_table(["backend", "pending", "expired leases", "load s", "claim p50 ms", "claim p99 ms",
                        "p50 vs smallest", "reaper tasks/s", "reaped"], rows), ""]

    if data.get("imports"):
        out += ["## Cold import time per Lambda entry point (median of fresh interpreters)", ""]
        rows = [[r["function"], r["backend"], r["measured"],
                 _f(r.get("median_ms"), 0) if "error" not in r else "error: " + r["error"][-120:]]
                for r in data["imports"]]
        out += [_table(["function", "backend", "measured", "import ms"], rows), ""]

    if data.get("artifacts"):
        out += ["## Artifact size (pip install --target, boto3 excluded)", ""]
        rows = [[r["deps"], ", ".join(r.get("packages", [])), _f(r.get("unzipped_mb"), 1), str(r.get("boto3_present", "–"))]
                for r in data["artifacts"]]
        out += [_table(["function deps", "packages", "unzipped MB", "boto3 present"], rows), ""]

    if data.get("errors"):
        out += ["## Errors", ""] + [f"- {e['where']}: {e['error']}" for e in data["errors"]] + [""]
    return "\n".join(out)
