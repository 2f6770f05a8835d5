"""Per-request records and the per-point summary computed from them.

Definitions follow vLLM's ``bench serve`` so figures can be compared: TTFT and
E2E over successful requests, TPOT = (E2E - TTFT) / (output tokens - 1) over
requests with more than one token, ITL pooled over every gap between output
events of every request. Percentiles interpolate linearly between order
statistics (numpy's default).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gateway.bench.slo import Metric, Slo, SloTerm

LoadKind = Literal["concurrency", "rate"]
STANDARD_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    prompt_tokens: int
    output_tokens: int
    ttft: float | None = None  # seconds from send to first output event
    e2e: float | None = None
    itls: Sequence[float] = ()  # gaps between successive output events
    error: str | None = None
    prompt_class: int | None = None  # target prompt length of synthetic prompts

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        assert self.ttft is not None and self.e2e is not None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of ``values`` (need not be sorted)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside [0, 100]")
    return _at_sorted(sorted(values), q)


def _at_sorted(ordered: Sequence[float], q: float) -> float:
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass(frozen=True, slots=True)
class Latency:
    """Mean and percentiles of one latency, in seconds."""

    mean: float
    pcts: dict[float, float]

    @classmethod
    def of(cls, values: Sequence[float], percentiles: Iterable[float]) -> Latency | None:
        if not values:
            return None
        ordered = sorted(values)
        return cls(
            mean=math.fsum(ordered) / len(ordered),
            pcts={q: _at_sorted(ordered, q) for q in sorted(set(percentiles))},
        )

    def at(self, q: float) -> float:
        return self.pcts[q]


@dataclass(frozen=True, slots=True)
class PointSummary:
    workload: str
    load_kind: LoadKind
    load: float
    requests: int  # successful, counted
    errors: int
    duration_s: float
    request_s: float
    output_tok_s: float
    total_tok_s: float
    prompt_tokens_mean: float
    output_tokens_mean: float
    ttft: Latency | None
    itl: Latency | None
    tpot: Latency | None
    e2e: Latency | None
    slo_values: dict[str, float | None] = field(default_factory=dict)
    slo_ok: bool | None = None
    goodput_req_s: float | None = None
    goodput_tok_s: float | None = None
    ttft_by_prompt: dict[int, Latency] = field(default_factory=dict)
    error_samples: tuple[str, ...] = ()
    in_flight_mean: float | None = None  # requests at the target, time-averaged (steady window)

    def latency(self, metric: Metric) -> Latency | None:
        return {"ttft": self.ttft, "itl": self.itl, "tpot": self.tpot, "e2e": self.e2e}[metric]


# Failed requests a point may have and still count as meeting its SLO (or be a knee).
MAX_ERROR_FRACTION = 0.01


def request_meets(slo: Slo, record: RequestRecord) -> bool:
    """Whether one request alone satisfies every SLO term (for goodput)."""
    if not record.ok:
        return False
    return all(_request_value(term, record) <= term.limit_s for term in slo.terms)


def _request_value(term: SloTerm, record: RequestRecord) -> float:
    if term.metric == "itl":
        return percentile(record.itls, term.percentile) if record.itls else 0.0
    if term.metric == "tpot":
        return record.tpot or 0.0
    value = record.ttft if term.metric == "ttft" else record.e2e
    assert value is not None
    return value


def summarize(
    records: Sequence[RequestRecord],
    *,
    workload: str,
    load_kind: LoadKind,
    load: float,
    window_s: float,
    window_output_tokens: float,
    slo: Slo | None = None,
    in_flight_mean: float | None = None,
) -> PointSummary:
    """Summarize one load point.

    Throughput is what the target delivered inside the measurement window,
    warm-up and filler requests included, because they share the GPU with the
    counted ones; latency figures come from the counted requests only.
    """
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    window = max(window_s, 1e-9)

    def pcts(metric: Metric) -> tuple[float, ...]:
        return STANDARD_PERCENTILES + (slo.percentiles(metric) if slo else ())

    ttft = Latency.of([r.ttft for r in ok if r.ttft is not None], pcts("ttft"))
    e2e = Latency.of([r.e2e for r in ok if r.e2e is not None], pcts("e2e"))
    tpot = Latency.of([t for r in ok if (t := r.tpot) is not None], pcts("tpot"))
    itl = Latency.of([g for r in ok for g in r.itls], pcts("itl"))
    output_tok_s = window_output_tokens / window
    prompt_tok_s = sum(r.prompt_tokens for r in ok) / window

    slo_values: dict[str, float | None] = {}
    slo_ok: bool | None = None
    goodput_req_s = goodput_tok_s = None
    if slo is not None:
        latencies = {"ttft": ttft, "itl": itl, "tpot": tpot, "e2e": e2e}
        for term in slo.terms:
            lat = latencies[term.metric]
            slo_values[term.name] = lat.at(term.percentile) if lat else None
        # A point whose requests fail meets no latency target, however fast the rest were.
        slo_ok = (
            bool(ok)
            and len(failed) <= MAX_ERROR_FRACTION * len(records)
            and all((v := slo_values[t.name]) is None or v <= t.limit_s for t in slo.terms)
        )
        good = [r for r in ok if request_meets(slo, r)]
        goodput_req_s = len(good) / window
        goodput_tok_s = sum(r.output_tokens for r in good) / window

    by_class: dict[int, list[float]] = {}
    for r in ok:
        if r.prompt_class is not None and r.ttft is not None:
            by_class.setdefault(r.prompt_class, []).append(r.ttft)
    ttft_by_prompt = {
        k: lat for k, v in sorted(by_class.items()) if (lat := Latency.of(v, (50.0, 95.0)))
    }
    samples = tuple(dict.fromkeys(r.error or "no output" for r in failed))[:3]
    return PointSummary(
        workload=workload,
        load_kind=load_kind,
        load=load,
        requests=len(ok),
        errors=len(failed),
        duration_s=window_s,
        request_s=len(ok) / window,
        output_tok_s=output_tok_s,
        total_tok_s=output_tok_s + prompt_tok_s,
        prompt_tokens_mean=sum(r.prompt_tokens for r in ok) / len(ok) if ok else 0.0,
        output_tokens_mean=sum(r.output_tokens for r in ok) / len(ok) if ok else 0.0,
        ttft=ttft,
        itl=itl,
        tpot=tpot,
        e2e=e2e,
        slo_values=slo_values,
        slo_ok=slo_ok,
        goodput_req_s=goodput_req_s,
        goodput_tok_s=goodput_tok_s,
        ttft_by_prompt=ttft_by_prompt,
        error_samples=samples,
        in_flight_mean=in_flight_mean,
    )
