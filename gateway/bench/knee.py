"""Where to stop adding load: the SLO knee and the marginal-throughput knee.

Both detectors read one measured curve (load -> output tokens/s, SLO verdict)
and say in words why they chose a point, because a bare number invites
arguments. A sweep that brackets a knee between two far-apart loads cannot
place it; the detectors then say so and propose the loads to add.

The marginal knee is a Kneedle-style reading of the throughput curve: the
slope from the origin to the first point is the initial marginal gain per unit
of load (throughput is zero at zero load); the knee is the last load before
the first segment whose slope falls below ``fraction`` of it.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.bench.stats import LoadKind

COARSE_RATIO = 1.5  # a bracket wider than this (hi / lo) cannot place the knee
PROPOSE_STEP = 1.25  # proposed loads split a coarse bracket into steps this small


@dataclass(frozen=True, slots=True)
class CurvePoint:
    load: float
    throughput: float  # output tokens/s
    slo_ok: bool | None = None
    slo_detail: str = ""  # e.g. "ttft_p95 720 ms > 500 ms", for the reason text


@dataclass(frozen=True, slots=True)
class Finding:
    load: float | None
    reason: str
    coarse: bool = False
    proposed: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class Knee:
    load: float | None  # the recommended operating point
    basis: Literal["slo", "marginal", "none"]
    slo: Finding | None
    marginal: Finding

    @property
    def too_coarse(self) -> bool:
        return self.marginal.coarse or (self.slo is not None and self.slo.coarse)

    @property
    def proposed(self) -> tuple[float, ...]:
        found = self.marginal.proposed + (self.slo.proposed if self.slo else ())
        return tuple(sorted(set(found)))


def find_knee(points: Sequence[CurvePoint], kind: LoadKind, *, fraction: float = 0.10) -> Knee:
    curve = sorted(points, key=lambda p: p.load)
    marginal = marginal_knee(curve, kind, fraction=fraction)
    slo = slo_knee(curve, kind) if any(p.slo_ok is not None for p in curve) else None
    candidates: list[tuple[float, Literal["slo", "marginal"]]] = []
    if slo is not None:
        if slo.load is None:  # nothing meets the SLO: no safe operating point
            return Knee(None, "none", slo, marginal)
        candidates.append((slo.load, "slo"))
    if marginal.load is not None:
        candidates.append((marginal.load, "marginal"))
    if not candidates:
        return Knee(None, "none", slo, marginal)
    load, basis = min(candidates, key=lambda c: c[0])  # a tie goes to the SLO
    return Knee(load, basis, slo, marginal)


def marginal_knee(curve: Sequence[CurvePoint], kind: LoadKind, *, fraction: float) -> Finding:
    unit = _unit(kind)
    curve = _one_per_load(curve)
    if len(curve) < 2:
        return Finding(None, "too few points: a knee needs at least two loads", True)
    first = curve[0]
    initial = first.throughput / first.load if first.load > 0 else 0.0
    if initial <= 0:
        return Finding(None, f"no throughput at the smallest load {_fmt(first.load)} {unit}")
    for lo, hi in itertools.pairwise(curve):
        gain = (hi.throughput - lo.throughput) / (hi.load - lo.load)
        if gain < fraction * initial:
            coarse = hi.load / lo.load > COARSE_RATIO if lo.load > 0 else True
            reason = (
                f"from {_fmt(lo.load)} to {_fmt(hi.load)} {unit} each added unit of load "
                f"adds {gain:.1f} tok/s, {gain / initial:.0%} of the initial {initial:.1f} "
                f"(threshold {fraction:.0%})"
            )
            if lo is first:
                coarse = coarse or lo.load > _smallest(kind)
                proposed = _between(0.0, lo.load, kind) + _between(lo.load, hi.load, kind)
            else:
                proposed = _between(lo.load, hi.load, kind) if coarse else ()
            return Finding(lo.load, reason, coarse, proposed if coarse else ())
    lo, hi = curve[-2], curve[-1]
    last_gain = (hi.throughput - lo.throughput) / (hi.load - lo.load)
    return Finding(
        None,
        f"no knee up to {_fmt(hi.load)} {unit}: the last step still adds {last_gain:.1f} tok/s "
        f"per unit of load, {last_gain / initial:.0%} of the initial {initial:.1f}; "
        "extend the sweep",
        True,
        _beyond(hi.load, kind),
    )


def _one_per_load(curve: Sequence[CurvePoint]) -> list[CurvePoint]:
    """Points measured at one load merged into their mean: a slope needs two loads."""
    return [
        CurvePoint(load, statistics.fmean(p.throughput for p in same))
        for load, same in itertools.groupby(curve, key=lambda p: p.load)
    ]


def slo_knee(curve: Sequence[CurvePoint], kind: LoadKind) -> Finding:
    """The largest load at which the SLO holds there and at every smaller load."""
    unit = _unit(kind)
    last_ok: CurvePoint | None = None
    for point in curve:
        if point.slo_ok:
            last_ok = point
            continue
        detail = f" ({point.slo_detail})" if point.slo_detail else ""
        if last_ok is None:
            below = _between(0.0, point.load, kind)
            return Finding(
                None,
                f"the SLO fails already at the smallest load {_fmt(point.load)} {unit}{detail}",
                bool(below),
                below,
            )
        coarse = point.load / last_ok.load > COARSE_RATIO
        return Finding(
            last_ok.load,
            f"the SLO holds up to {_fmt(last_ok.load)} {unit} and fails at "
            f"{_fmt(point.load)}{detail}",
            coarse,
            _between(last_ok.load, point.load, kind) if coarse else (),
        )
    top = curve[-1].load
    return Finding(
        top,
        f"the SLO holds at every load up to {_fmt(top)} {unit}; extend the sweep",
        True,
        _beyond(top, kind),
    )


def _between(lo: float, hi: float, kind: LoadKind) -> tuple[float, ...]:
    """Loads strictly inside (lo, hi) in geometric steps of at most PROPOSE_STEP."""
    start = max(lo, _smallest(kind))
    if start <= 0:  # open loop from zero: start a few steps below hi
        start = hi / PROPOSE_STEP**4
    if hi <= start:
        return ()
    steps = max(1, math.ceil(math.log(hi / start) / math.log(PROPOSE_STEP)))
    steps = min(steps, 4)  # a handful of points is enough to bracket again
    raw = [start * (hi / start) ** (k / steps) for k in range(steps + 1)]
    if lo < start:  # lo = 0: the smallest possible load is itself a candidate
        raw.insert(0, start)
    found = {_round(x, kind) for x in raw}
    return tuple(sorted(x for x in found if lo < x < hi))


def _beyond(top: float, kind: LoadKind) -> tuple[float, ...]:
    return tuple(sorted({_round(top * 1.5, kind), _round(top * 2, kind)}))


def _round(x: float, kind: LoadKind) -> float:
    if kind == "concurrency":
        return float(round(x))
    return float(f"{x:.2g}")


def _smallest(kind: LoadKind) -> float:
    return 1.0 if kind == "concurrency" else 0.0


def _unit(kind: LoadKind) -> str:
    return "concurrent" if kind == "concurrency" else "req/s"


def _fmt(x: float) -> str:
    return f"{x:g}"
