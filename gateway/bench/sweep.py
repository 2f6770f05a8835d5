"""The sweep: every workload series at every load, against one or two targets.

With two targets the points interleave (A then B at each load) so drift on a
shared machine lands on both alike. Each (target, series) curve gets its knee.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from gateway.bench.knee import CurvePoint, Knee, find_knee
from gateway.bench.phase import Arrival, LoadPoint
from gateway.bench.slo import Slo
from gateway.bench.stats import LoadKind, PointSummary, summarize
from gateway.bench.target import PointProgress, Target
from gateway.bench.workload import Workload

MIN_REQUESTS = 32
POINT_INDEX_STRIDE = 1_000_000
# Closed loop: seconds between successive clients' first requests (the target's time).
# Twice a 1K-token prefill on the simulated L40S (51 ms): each client's prompt is
# prefilled before the next client's arrives, so no two clients end a step apart.
DEFAULT_STAGGER_S = 0.1


@dataclass(frozen=True, slots=True)
class SweepPlan:
    kind: LoadKind
    loads: tuple[float, ...]
    requests: int | None = None  # per point; None with no duration: automatic
    duration_s: float | None = None
    warmup: int | None = None  # None: one wave (closed) or ~5 s of arrivals (open)
    arrival: Arrival = "poisson"
    seed: int = 0
    fraction: float = 0.10
    slo: Slo | None = None
    stagger: float = DEFAULT_STAGGER_S  # closed loop only

    def point(self, load: float, number: int) -> LoadPoint:
        requests = self.requests
        if requests is None and self.duration_s is None:
            requests = max(
                MIN_REQUESTS, math.ceil(4 * load if self.kind == "concurrency" else 10 * load)
            )
        warmup = self.warmup
        if warmup is None:
            warmup = int(load) if self.kind == "concurrency" else max(4, math.ceil(5 * load))
        return LoadPoint(
            kind=self.kind,
            load=load,
            requests=requests,
            duration=self.duration_s,
            warmup=warmup,
            arrival=self.arrival,
            seed=self.seed + number,
            index_base=number * POINT_INDEX_STRIDE,
            stagger=self.stagger if self.kind == "concurrency" else 0.0,
        )


@dataclass(frozen=True, slots=True)
class Series:
    target: str
    workload: str
    kind: LoadKind
    points: tuple[PointSummary, ...]
    knee: Knee


@dataclass(frozen=True, slots=True)
class SweepResult:
    plan: SweepPlan
    series: tuple[Series, ...]
    notes: dict[str, list[str]] = field(default_factory=dict)  # per target label

    def of_target(self, label: str) -> list[Series]:
        return [s for s in self.series if s.target == label]

    def recommended(self, label: str) -> float | None:
        """The most conservative knee over the target's series."""
        loads = [s.knee.load for s in self.of_target(label) if s.knee.load is not None]
        return min(loads) if loads else None


def curve_of(points: Sequence[PointSummary], slo: Slo | None) -> list[CurvePoint]:
    curve = []
    for p in points:
        detail = ""
        if slo is not None and p.slo_ok is False:
            worst = [
                f"{t.name} {v * 1e3:.0f} ms > {t.limit_s * 1e3:g} ms"
                for t in slo.terms
                if (v := p.slo_values.get(t.name)) is not None and v > t.limit_s
            ]
            if p.errors:
                worst.append(f"{p.errors} of {p.requests + p.errors} requests failed")
            detail = "; ".join(worst) or "no successful requests"
        curve.append(CurvePoint(p.load, p.output_tok_s, p.slo_ok, detail))
    return curve


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while a point is measured; one full pass after it.

    A full pass over a sweep's accumulated records stopped the load generator for
    4-14 ms now and then: every request of those clients then went out late, and at
    ``kneecap sim --speed 20`` (a decode step ~6 ms of wall time) a closed loop at 48
    in flight fell a step behind the virtual clock for the rest of the point.
    Reference counting still frees everything that is not a cycle meanwhile.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.collect()


async def run_sweep(
    plan: SweepPlan,
    workloads: Sequence[Workload],
    targets: Sequence[Target],
    progress: PointProgress,
) -> SweepResult:
    notes = {t.label: await t.prepare(workloads) for t in targets}
    collected: dict[tuple[str, str], list[PointSummary]] = {}
    total = len(workloads) * len(plan.loads) * len(targets)
    number = 0
    for workload in workloads:
        for load in plan.loads:
            point = plan.point(load, number // len(targets))
            for target in targets:
                number += 1
                progress.begin(number, total, target.label, workload.label, point)
                with collector_paused():
                    phase = await target.run_point(point, workload, progress)
                summary = summarize(
                    phase.records,
                    workload=workload.label,
                    load_kind=plan.kind,
                    load=load,
                    window_s=phase.window_s,
                    window_output_tokens=phase.window_tokens,
                    slo=plan.slo,
                    in_flight_mean=phase.in_flight_mean,
                )
                progress.end(summary)
                collected.setdefault((target.label, workload.label), []).append(summary)
    series = tuple(
        Series(
            label,
            name,
            plan.kind,
            tuple(points),
            find_knee(curve_of(points, plan.slo), plan.kind, fraction=plan.fraction),
        )
        for (label, name), points in collected.items()
    )
    return SweepResult(plan, series, notes)
