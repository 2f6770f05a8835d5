"""The fewest requests in flight relative to the limit, first in order on ties."""

from __future__ import annotations

from collections.abc import Sequence

from policies.routing import Load, RouteRequest


class LeastLoaded:
    def choose(self, loads: Sequence[Load], request: RouteRequest) -> Load | None:
        best: Load | None = None
        for load in loads:
            if not load.fits(request.cost):
                continue
            if best is None or load.in_flight / load.limit < best.in_flight / best.limit:
                best = load
        return best
