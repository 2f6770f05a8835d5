"""Where (b)'s goodput gap comes from, in time: the knee next to static limits, per slice.

    python -m backends.sim.system.overload_slices [--seed S] [--budget] [--static 80 ...]

The same run as the acceptance's overload (b) -- same arrivals, rate, duration and
goodput definition -- cut into slices (30 s by default), so a gap can be told apart:
warm-up (the knee ramps from its initial limit while a static limit fills from t=0),
a lower steady limit, swings of the limit, or requests admitted late whose first
token breaks the SLO. Per slice and run: goodput, throughput (tok/s), mean in flight,
median limit; then the acceptance's measured span and the requests admitted there
whose TTFT missed the SLO.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from backends.sim.system.acceptance import FULL, SHAPE, knee, open_loop
from backends.sim.system.model import within_limit, within_token_budget
from backends.sim.system.report import outcome
from backends.sim.system.sim import SystemSim
from policies.static import StaticLimitConfig

KNEE_RATE = 1135.0  # tok/s: (a)'s knee output rate, as the acceptance measures it (seed 0)


def _slice(sim: SystemSim, t0: float, t1: float) -> tuple[float, float, float, float]:
    spans = [i for i in sim.intervals if t0 < i.t <= t1]
    seconds = len(spans) * sim.control_interval_s
    return (
        sum(i.good_tokens for i in spans) / seconds,
        sum(i.tokens for i in spans) / seconds,
        statistics.mean(i.backends[0].in_flight for i in spans),
        statistics.median(i.backends[0].limit for i in spans),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", action="store_true", help="add the default token budget")
    parser.add_argument("--static", type=int, nargs="*", default=[80])
    parser.add_argument("--slice", type=float, default=30.0, help="seconds per slice")
    args = parser.parse_args(argv)
    admits = within_token_budget if args.budget else within_limit
    rate = 2 * KNEE_RATE / SHAPE.output_tokens
    runs = {"knee": open_loop(knee(4), rate, FULL, args.seed, admits=admits)}
    for n in args.static:
        runs[f"static {n}"] = open_loop(
            StaticLimitConfig(initial=n), rate, FULL, args.seed, admits=admits
        )
    print(f"{rate:.3f} req/s, seed {args.seed}, token budget {'on' if args.budget else 'off'}")
    print("| slice | " + " | ".join(f"{name}: good / tok/s / in flight / limit" for name in runs))
    print("|---|" + "---:|" * len(runs))
    t = 0.0
    while t < FULL.overload_s:
        cells = [_slice(sim, t, t + args.slice) for sim in runs.values()]
        row = " | ".join(f"{g:,.0f} / {k:,.0f} / {c:.1f} / {n:.0f}" for g, k, c, n in cells)
        print(f"| {t:.0f}-{t + args.slice:.0f} s | {row} |")
        t += args.slice
    for name, sim in runs.items():
        o = outcome(sim, FULL.warmup_s, FULL.overload_s)
        late = [
            r
            for r in sim.requests
            if r.admitted is not None
            and FULL.warmup_s <= r.arrived < FULL.overload_s
            and r.ttft is not None
            and not r.good
        ]
        print(
            f"- {name}: {FULL.warmup_s:.0f}-{FULL.overload_s:.0f} s goodput {o.goodput:,.0f} "
            f"tok/s, throughput {o.throughput:,.0f}, p95 TTFT {o.ttft_p95:.2f} s, "
            f"admitted {o.admitted} ({len(late)} past the SLO), shed {o.shed}; "
            f"0-{FULL.overload_s:.0f} s goodput {outcome(sim, 0, FULL.overload_s).goodput:,.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
