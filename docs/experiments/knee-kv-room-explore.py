"""The knee with the given knobs: (a) 128 closed-loop clients, (b) 2x Poisson overload.

    python knee-kv-room-explore.py '{"marginal_fraction": 0.28}' ab

Run from (or with ``CHECKOUT`` pointing at) a checkout with knee-kv-room.patch applied.
(b)'s shares are against the best static limits of the acceptance run (seed 0): 1,448
tok/s with the request limit alone, 1,292 with the token budget.
"""

import json
import os
import sys

sys.path.insert(0, os.environ.get("CHECKOUT", "."))

from backends.sim.system import acceptance as A
from backends.sim.system.model import within_limit, within_token_budget
from backends.sim.system.report import limit_trace, outcome, settling
from policies.knee import KneeLimitConfig

BEST_STATIC = {"alone": 1448, "budget": 1292}
RATE = 2 * 1174 / 2816  # 2x the knee's steady rate in (a), as the acceptance run had it


def knee(knobs: dict, initial: int) -> KneeLimitConfig:
    return KneeLimitConfig(initial=initial, ttft_p95_slo=A.SLO_S, **knobs)


def main() -> None:
    knobs = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    parts = sys.argv[2] if len(sys.argv) > 2 else "ab"
    if "a" in parts:
        for initial in (4, 128):
            for seed in (0, 1, 2):
                sim = A.closed_loop(knee(knobs, initial), 600, seed)
                trace = limit_trace(sim)
                s = settling(trace, *A.BAND, A.SWING)
                rate = outcome(sim, 300, 600).throughput
                every_20 = " ".join(map(str, trace[9::20]))
                print(
                    f"a from {initial} seed {seed}: settled {s.at} median {s.median} "
                    f"{s.low}-{s.high} {rate:.0f} tok/s; limit every 20 s: {every_20}"
                )
    if "b" in parts:
        for admits, name in ((within_limit, "alone"), (within_token_budget, "budget")):
            o = outcome(A.open_loop(knee(knobs, 4), RATE, A.FULL, 0, admits=admits), 300, 900)
            share = o.goodput / BEST_STATIC[name]
            print(f"b {name}: limit {o.limit_median} goodput {o.goodput:.0f} = {share:.1%}")


if __name__ == "__main__":
    main()
