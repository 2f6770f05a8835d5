"""The final table on stdout, laid out like the field report's."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.bench.knee import Finding
from gateway.bench.progress import prompts_of
from gateway.bench.stats import Latency, PointSummary
from gateway.bench.sweep import Series, SweepResult

COLUMNS = (
    ("load", 6),
    ("req/s", 7),
    ("out tok/s", 9),
    ("TTFT p50", 8),
    ("p95", 7),
    ("p99", 7),
    ("ITL p50", 7),
    ("p95", 6),
    ("TPOT p50", 8),
    ("E2E p50", 8),
    ("p95", 8),
    ("errors", 6),
    ("goodput", 8),
    ("SLO", 4),
)


def _ms(lat: Latency | None, q: float) -> str:
    return "-" if lat is None else f"{lat.at(q) * 1e3:.0f}"


def _s(lat: Latency | None, q: float) -> str:
    return "-" if lat is None else f"{lat.at(q):.2f}"


def _row(p: PointSummary) -> list[str]:
    goodput = "-" if p.goodput_req_s is None else f"{p.goodput_req_s:.2f}"
    slo = {True: "ok", False: "miss", None: "-"}[p.slo_ok]
    return [
        f"{p.load:g}",
        f"{p.request_s:.2f}",
        f"{p.output_tok_s:,.0f}",
        _ms(p.ttft, 50.0),
        _ms(p.ttft, 95.0),
        _ms(p.ttft, 99.0),
        f"{p.itl.at(50.0) * 1e3:.1f}" if p.itl else "-",
        f"{p.itl.at(95.0) * 1e3:.1f}" if p.itl else "-",
        f"{p.tpot.at(50.0) * 1e3:.1f}" if p.tpot else "-",
        _s(p.e2e, 50.0),
        _s(p.e2e, 95.0),
        str(p.errors),
        goodput,
        slo,
    ]


def _finding(name: str, f: Finding | None) -> str:
    if f is None:
        return ""
    text = f"  {name}: {f.reason}"
    if f.coarse and f.proposed:
        text += f"; too coarse to place it, add loads {', '.join(f'{x:g}' for x in f.proposed)}"
    return text + "\n"


def series_table(s: Series) -> str:
    unit = "concurrency" if s.kind == "concurrency" else "req/s"
    header = [name for name, _ in COLUMNS]
    header[0] = "conc" if s.kind == "concurrency" else "rate"
    widths = [w for _, w in COLUMNS]
    lines = [
        f"{s.target} · {prompts_of(s.workload)} · load = {unit} · times in ms (E2E in s)",
        "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)),
    ]
    for p in s.points:
        lines.append("  ".join(c.rjust(w) for c, w in zip(_row(p), widths, strict=True)))
    text = "\n".join(lines) + "\n"
    knee = s.knee
    where = "no knee found" if knee.load is None else f"knee at {knee.load:g} ({knee.basis})"
    text += f"{where}\n" + _finding("SLO", knee.slo) + _finding("marginal", knee.marginal)
    for p in s.points:
        if p.error_samples:
            text += f"  errors at {p.load:g}: {' | '.join(p.error_samples)}\n"
    return text


def render(result: SweepResult, notes: Sequence[str] = ()) -> str:
    parts = [f"note: {n}" for n in notes]
    if result.plan.slo is not None:
        parts.append(f"SLO: {result.plan.slo}")
    body = "\n".join(parts) + ("\n\n" if parts else "")
    return body + "\n".join(series_table(s) for s in result.series)
