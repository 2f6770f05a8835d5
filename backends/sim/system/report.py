"""What a run of the whole-system simulation amounts to: traces, settling, latency, goodput."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from backends.sim.system.model import SHED
from backends.sim.system.sim import SystemSim


def limit_trace(sim: SystemSim, backend: int = 0) -> list[int]:
    """The backend's limit after each control tick (one a second)."""
    return [interval.backends[backend].limit for interval in sim.intervals]


@dataclass(frozen=True, slots=True)
class Settling:
    at: float | None  # seconds until the limit stayed in the band; None: it never did
    median: float  # of the limit from `at` (or over the whole tail when None)
    low: int
    high: int

    @property
    def swing(self) -> float:
        """Widest deviation from the median, relative to it."""
        return max(self.median - self.low, self.high - self.median) / self.median


def settling(trace: Sequence[int], lo: float, hi: float, swing: float = 0.25) -> Settling:
    """The earliest tick from which every limit lies in [lo, hi] and within +-swing
    of the median of what follows (the acceptance's "settles ... and stays there")."""
    for start in range(len(trace)):
        tail = trace[start:]
        mid = statistics.median(tail)
        if min(tail) >= lo and max(tail) <= hi and max(abs(x - mid) for x in tail) <= swing * mid:
            return Settling(float(start + 1), mid, min(tail), max(tail))
    tail = trace[len(trace) // 2 :]
    return Settling(None, statistics.median(tail), min(tail), max(tail))


def pct(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (as the gateway's windows compute it)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


@dataclass(frozen=True, slots=True)
class Outcome:
    """Requests arriving in [t0, t1) and the tokens streamed in that span."""

    arrived: int
    admitted: int
    shed: int
    ttft_p50: float | None  # from admission: the backend's share
    ttft_p95: float | None
    wait_p50: float | None  # in the gateway's queue, admitted requests
    wait_p95: float | None
    shed_overshoot_max: float | None  # answered - (arrival + its queue deadline), timeouts
    throughput: float  # output tokens/s
    goodput: float  # output tokens/s of requests whose first token came within the SLO
    limit_median: float | None


def outcome(sim: SystemSim, t0: float, t1: float, backend: int = 0) -> Outcome:
    requests = [r for r in sim.requests if t0 <= r.arrived < t1]
    admitted = [r for r in requests if r.admitted is not None]
    ttfts = [r.ttft for r in admitted if r.ttft is not None]
    waits = [r.queue_wait for r in admitted if r.queue_wait is not None]
    shed = [r for r in requests if r.status in SHED]
    overshoot = [
        r.finished - r.deadline
        for r in shed
        if r.status == "queue_timeout" and r.finished is not None
    ]
    spans = [i for i in sim.intervals if t0 < i.t <= t1]
    seconds = max(1e-9, len(spans) * sim.control_interval_s)
    limits = [i.backends[backend].limit for i in spans]
    return Outcome(
        arrived=len(requests),
        admitted=len(admitted),
        shed=len(shed),
        ttft_p50=pct(ttfts, 50),
        ttft_p95=pct(ttfts, 95),
        wait_p50=pct(waits, 50),
        wait_p95=pct(waits, 95),
        shed_overshoot_max=max(overshoot) if overshoot else None,
        throughput=sum(i.tokens for i in spans) / seconds,
        goodput=sum(i.good_tokens for i in spans) / seconds,
        limit_median=statistics.median(limits) if limits else None,
    )


def fmt(value: float | None, unit: str = "", digits: int = 2) -> str:
    if value is None:
        return "--"
    return f"{value:,.{digits}f}{unit}"
