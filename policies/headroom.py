"""Most headroom, with power-of-two-choices among near-equals (the default router).

Every backend that fits the request gets its pressure with the request on it
(:meth:`Load.pressure`: requests, tokens, KV usage, engine queue). Backends
within ``near_equal`` of the least pressed are near-equals; two of them are
drawn at random and the less pressed wins. A burst of requests arriving
between two load updates thus spreads over the near-equals instead of herding
onto the one that looked emptiest, while a clearly emptier backend still wins.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.routing import Load, RouteRequest


class Headroom:
    def __init__(self, near_equal: float = 0.1, rng: random.Random | None = None) -> None:
        self.near_equal = near_equal
        self._rng = rng or random.Random()

    def choose(self, loads: Sequence[Load], request: RouteRequest) -> Load | None:
        if len(loads) == 1:  # a pool of one replica: nothing to weigh it against
            only = loads[0]
            return only if only.fits(request.cost) else None
        scored = [(load.pressure(request.cost), load) for load in loads if load.fits(request.cost)]
        if not scored:
            return None
        best = min(score for score, _ in scored)
        near = [pair for pair in scored if pair[0] <= best + self.near_equal]
        if len(near) == 1:
            return near[0][1]
        (score_a, a), (score_b, b) = self._rng.sample(near, 2)
        return a if score_a <= score_b else b
