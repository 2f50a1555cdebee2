"""The backlog curve as an SVG line chart (no plotting library): tasks/s against the backlog on
a log scale, one solid line per system without start-up and a dashed one with it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

WIDTH, HEIGHT = 720, 420
LEFT, RIGHT, TOP, BOTTOM = 70, 190, 40, 50
COLOURS = {"rdq-postgres": "#1f6feb", "rdq-redis": "#8250df", "pgqueuer": "#d1242f", "celery": "#bf8700"}


def _series(summary: dict[str, Any]) -> dict[str, list[tuple[int, float, float]]]:
    series: dict[str, list[tuple[int, float, float]]] = {}
    for key, value in summary.items():
        system, size = key.rsplit("/", 1)
        series.setdefault(system, []).append((int(size), value["without"], value["with"]))
    return {system: sorted(points) for system, points in series.items()}


def write_svg(summary: dict[str, Any], path: Path, workers: int) -> None:
    series = _series(summary)
    sizes = sorted({n for points in series.values() for n, _, _ in points})
    top = max(v for points in series.values() for _, a, b in points for v in (a, b))
    top = math.ceil(top / 5000) * 5000
    lo, hi = math.log10(sizes[0]), math.log10(sizes[-1])

    def x(n: int) -> float:
        span = (hi - lo) or 1.0
        return LEFT + (math.log10(n) - lo) / span * (WIDTH - LEFT - RIGHT)

    def y(v: float) -> float:
        return TOP + (1 - v / top) * (HEIGHT - TOP - BOTTOM)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{LEFT}" y="22" font-size="14">Drain throughput against backlog (W={workers}; '
           'solid: without start-up, dashed: with)</text>']
    for tick in range(0, top + 1, 5000):
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#ddd"/>'
                   f'<text x="{LEFT - 8}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:,}</text>')
    for n in sizes:
        label = f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}k"
        out.append(f'<line x1="{x(n):.1f}" x2="{x(n):.1f}" y1="{TOP}" y2="{HEIGHT - BOTTOM}" stroke="#eee"/>'
                   f'<text x="{x(n):.1f}" y="{HEIGHT - BOTTOM + 18}" text-anchor="middle">{label}</text>')
    out.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2:.0f}" y="{HEIGHT - 10}" text-anchor="middle">'
               'tasks pending when the drain starts (log scale)</text>'
               f'<text x="16" y="{(TOP + HEIGHT - BOTTOM) / 2:.0f}" transform="rotate(-90 16 '
               f'{(TOP + HEIGHT - BOTTOM) / 2:.0f})" text-anchor="middle">tasks/s</text>')
    for row, (system, points) in enumerate(sorted(series.items())):
        colour = COLOURS.get(system, "#57606a")
        for index, dash in ((1, ""), (2, ' stroke-dasharray="5 4"')):
            line = " ".join(f"{x(p[0]):.1f},{y(p[index]):.1f}" for p in points)
            out.append(f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        for n, without, _ in points:
            out.append(f'<circle cx="{x(n):.1f}" cy="{y(without):.1f}" r="3" fill="{colour}"/>')
        legend_y = TOP + 10 + row * 20
        out.append(f'<line x1="{WIDTH - RIGHT + 16}" x2="{WIDTH - RIGHT + 40}" y1="{legend_y}" y2="{legend_y}" '
                   f'stroke="{colour}" stroke-width="2"/><text x="{WIDTH - RIGHT + 46}" y="{legend_y + 4}">{system}</text>')
    out.append("</svg>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
