"""``--emit-policy FILE``: the concurrency limit the admission controller starts from.

``initial`` is the knee (the most conservative over the target's series);
``max`` is the smallest measured load that already reaches the throughput
plateau (within ``PLATEAU`` of the best), since admitting more buys nothing.
A rate sweep's points are turned into requests in flight by measuring them:
the mean number the target held (see :func:`_in_flight`).
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from gateway.bench.progress import prompts_of
from gateway.bench.stats import MAX_ERROR_FRACTION, PointSummary
from gateway.bench.sweep import SweepResult

PLATEAU = 0.97
# SLO terms the knee controller enforces, by the config key it reads them from.
CONTROLLER_SLO_KEYS = {"ttft_p95": "ttft_p95_slo", "itl_p95": "itl_p95_slo"}


class PolicyError(ValueError):
    """No limit can be derived from this sweep; the message says why."""


def _in_flight(p: PointSummary) -> int:
    """Requests in flight at a point: what a concurrency limit caps.

    A rate point's figure is measured, not derived: the requests the target held,
    time-averaged over the steady part of the measurement window (see
    :mod:`gateway.bench.phase`). Little's law (requests/s x mean E2E) would need
    the arrival rate of a system in equilibrium, and neither rate at hand is one:
    the measured requests/s divides by a window that includes the drain after the
    last counted arrival (with the default 32 requests, 0.15 for a steady 0.2
    req/s: a limit a quarter too low), and the offered rate overstates what an
    overloaded point, whose queue grows all along, actually held. The measured
    mean needs neither assumption. Little's law on the offered rate is only the
    fallback for a point without that measurement (a window too short to have a
    steady part).
    """
    if p.load_kind == "concurrency":
        return max(1, round(p.load))
    if p.in_flight_mean is not None:
        held = p.in_flight_mean
    else:
        held = p.load * (p.e2e.mean if p.e2e else 0.0)
    return max(1, math.ceil(round(held, 6)))  # round: 10.000000001 requests is 10


def _failing(p: PointSummary) -> bool:
    return p.errors > MAX_ERROR_FRACTION * (p.requests + p.errors)


def policy_fragment(result: SweepResult, target: str) -> dict[str, Any]:
    series = result.of_target(target)
    knee = result.recommended(target)
    if knee is None:
        reasons = "; ".join(
            (s.knee.slo.reason if s.knee.slo else s.knee.marginal.reason) for s in series
        )
        raise PolicyError(f"no knee to start from: {reasons}")
    points = [p for s in series for p in s.points]
    failing = [p for p in points if p.load <= knee and _failing(p)]
    if failing:
        worst = max(failing, key=lambda p: p.errors)
        raise PolicyError(
            f"{worst.errors} of {worst.requests + worst.errors} requests failed at load "
            f"{worst.load:g} ({', '.join(worst.error_samples)}): no limit from a failing target"
        )
    initial = min(_in_flight(p) for p in points if p.load == knee)
    best = max(p.output_tok_s for p in points)
    plateau = [p for p in points if p.output_tok_s >= PLATEAU * best]
    maximum = max(initial, min(_in_flight(p) for p in plateau))
    limit: dict[str, Any] = {"kind": "knee", "initial": initial, "min": 1, "max": maximum}
    for term in result.plan.slo.terms if result.plan.slo is not None else ():
        key = CONTROLLER_SLO_KEYS.get(term.name)
        if key is not None:
            limit[key] = round(term.limit_s, 6)
    # The fragment is a kneecap config: merge it into yours (or pass it to check-config).
    return {"admission": {"limit": limit}}


def policy_yaml(result: SweepResult, target: str) -> str:
    fragment = policy_fragment(result, target)
    lines = [f"# kneecap bench against {target}"]
    for s in result.of_target(target):
        k = s.knee
        why = k.slo.reason if k.basis == "slo" and k.slo else k.marginal.reason
        knee = "none" if k.load is None else f"{k.load:g}"
        lines.append(f"# {prompts_of(s.workload)}: knee {knee} ({k.basis}): {why}")
    if result.plan.slo is not None:
        unenforced = [t.name for t in result.plan.slo.terms if t.name not in CONTROLLER_SLO_KEYS]
        if unenforced:
            names = ", ".join(unenforced)
            lines.append(f"# not enforced by the controller (it reads ttft_p95, itl_p95): {names}")
    body: str = yaml.safe_dump(fragment, sort_keys=False)
    return "\n".join(lines) + "\n" + body
