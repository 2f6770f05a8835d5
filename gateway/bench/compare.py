"""``--compare URL2``: both targets side by side with ratios (B / A).

The typical use is through-gateway (B) vs direct (A): the ratios show what the
gateway costs in throughput and latency at each load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.bench.stats import PointSummary
from gateway.bench.sweep import SweepResult

Figure = Callable[[PointSummary], float | None]

FIGURES: dict[str, Figure] = {
    "output_tok_s": lambda p: p.output_tok_s,
    "ttft_p50_ms": lambda p: p.ttft.at(50.0) * 1e3 if p.ttft else None,
    "ttft_p95_ms": lambda p: p.ttft.at(95.0) * 1e3 if p.ttft else None,
    "itl_p50_ms": lambda p: p.itl.at(50.0) * 1e3 if p.itl else None,
    "itl_p95_ms": lambda p: p.itl.at(95.0) * 1e3 if p.itl else None,
    "e2e_p50_ms": lambda p: p.e2e.at(50.0) * 1e3 if p.e2e else None,
}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return b / a


def pairs(result: SweepResult, a: str, b: str) -> list[tuple[str, PointSummary, PointSummary]]:
    found = []
    for sa in result.of_target(a):
        for sb in result.of_target(b):
            if sb.workload == sa.workload:
                found += [
                    (sa.workload, pa, pb) for pa, pb in zip(sa.points, sb.points, strict=True)
                ]
    return found


def comparison_json(result: SweepResult, a: str, b: str) -> list[dict[str, Any]]:
    rows = []
    for workload, pa, pb in pairs(result, a, b):
        row: dict[str, Any] = {"workload": workload, "load": pa.load}
        for name, figure in FIGURES.items():
            va, vb = figure(pa), figure(pb)
            r = _ratio(va, vb)
            row[name] = {
                "a": None if va is None else round(va, 3),
                "b": None if vb is None else round(vb, 3),
                "ratio": None if r is None else round(r, 4),
            }
        rows.append(row)
    return rows


def render_comparison(result: SweepResult, a: str, b: str) -> str:
    names = list(FIGURES)
    head = "  ".join(f"{n:>26}" for n in names)
    lines = [
        f"compare: A = {a}  B = {b}  (each cell: A / B / B÷A)",
        f"{'workload':>9} {'load':>5}  {head}",
    ]
    for workload, pa, pb in pairs(result, a, b):
        cells = []
        for figure in FIGURES.values():
            va, vb = figure(pa), figure(pb)
            r = _ratio(va, vb)
            cells.append(f"{_num(va):>9} /{_num(vb):>8} /{'-' if r is None else f'{r:.2f}x':>6}")
        lines.append(f"{workload:>9} {pa.load:>5g}  " + "  ".join(cells))
    return "\n".join(lines) + "\n"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"
