"""Machine-readable results: ``--json`` (one object per point plus the knees) and ``--csv``.

Times are milliseconds in both, under keys ending in ``_ms``; rates are per
second. The schema is versioned by ``schema`` and documented in the README.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from gateway.bench.knee import Finding, Knee
from gateway.bench.stats import Latency, PointSummary
from gateway.bench.sweep import Series, SweepResult

SCHEMA = "kneecap-bench/1"
CSV_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


def latency_ms(lat: Latency | None) -> dict[str, float] | None:
    if lat is None:
        return None
    out = {"mean": round(lat.mean * 1e3, 3)}
    out.update({f"p{q:g}": round(v * 1e3, 3) for q, v in lat.pcts.items()})
    return out


def point_json(target: str, p: PointSummary) -> dict[str, Any]:
    return {
        "target": target,
        "workload": p.workload,
        "load_kind": p.load_kind,
        "load": p.load,
        "requests": p.requests,
        "errors": p.errors,
        "duration_s": round(p.duration_s, 3),
        "request_s": round(p.request_s, 4),
        "output_tok_s": round(p.output_tok_s, 2),
        "total_tok_s": round(p.total_tok_s, 2),
        "prompt_tokens_mean": round(p.prompt_tokens_mean, 1),
        "output_tokens_mean": round(p.output_tokens_mean, 1),
        "ttft_ms": latency_ms(p.ttft),
        "itl_ms": latency_ms(p.itl),
        "tpot_ms": latency_ms(p.tpot),
        "e2e_ms": latency_ms(p.e2e),
        "slo_ok": p.slo_ok,
        "slo_values_ms": {
            k: None if v is None else round(v * 1e3, 3) for k, v in p.slo_values.items()
        },
        "goodput_request_s": _round(p.goodput_req_s, 4),
        "goodput_tok_s": _round(p.goodput_tok_s, 2),
        "ttft_by_prompt_tokens_ms": {str(k): latency_ms(v) for k, v in p.ttft_by_prompt.items()},
        "error_samples": list(p.error_samples),
        "in_flight_mean": _round(p.in_flight_mean, 2),
    }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def finding_json(f: Finding | None) -> dict[str, Any] | None:
    if f is None:
        return None
    return {"load": f.load, "reason": f.reason, "too_coarse": f.coarse, "propose": list(f.proposed)}


def knee_json(s: Series) -> dict[str, Any]:
    k: Knee = s.knee
    return {
        "target": s.target,
        "workload": s.workload,
        "load_kind": s.kind,
        "load": k.load,
        "basis": k.basis,
        "slo": finding_json(k.slo),
        "marginal": finding_json(k.marginal),
        "too_coarse": k.too_coarse,
        "propose": list(k.proposed),
    }


def result_json(result: SweepResult, settings: dict[str, Any]) -> dict[str, Any]:
    plan = result.plan
    primary = result.series[0].target if result.series else None
    return {
        "schema": SCHEMA,
        "settings": settings,
        "slo": str(plan.slo) if plan.slo else None,
        "notes": result.notes,
        "points": [point_json(s.target, p) for s in result.series for p in s.points],
        "knees": [knee_json(s) for s in result.series],
        "knee": {
            "target": primary,
            "load_kind": plan.kind,
            "load": result.recommended(primary) if primary else None,
        },
    }


CSV_FIELDS = (
    "target workload load_kind load requests errors duration_s request_s output_tok_s "
    "total_tok_s prompt_tokens_mean output_tokens_mean slo_ok goodput_request_s goodput_tok_s"
).split()


def result_csv(result: SweepResult) -> str:
    rows = [point_json(s.target, p) for s in result.series for p in s.points]
    latency_cols = [
        f"{m}_{stat}_ms"
        for m in ("ttft", "itl", "tpot", "e2e")
        for stat in ("mean", *(f"p{q:g}" for q in CSV_PERCENTILES))
    ]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*CSV_FIELDS, *latency_cols])
    for row in rows:
        values = [row[f] for f in CSV_FIELDS]
        for col in latency_cols:
            metric, stat, _ = col.split("_")
            lat = row[f"{metric}_ms"]
            values.append("" if lat is None else lat.get(stat, ""))
        writer.writerow(["" if v is None else v for v in values])
    return out.getvalue()
