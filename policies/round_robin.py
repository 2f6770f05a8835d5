"""Round-robin over the backends that fit: the baseline a load balancer gives you.

The cursor advances past the chosen backend, so with every backend free the
requests cycle through them in order whatever their prompt lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.routing import Load, RouteRequest


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, loads: Sequence[Load], request: RouteRequest) -> Load | None:
        count = len(loads)
        for step in range(count):
            index = (self._next + step) % count
            if loads[index].fits(request.cost):
                self._next = index + 1
                return loads[index]
        return None
