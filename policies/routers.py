"""Routers by name (``routing.policy``): one module per policy, one row here each."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from types import MappingProxyType

from policies.headroom import Headroom
from policies.least_loaded import LeastLoaded
from policies.round_robin import RoundRobin
from policies.routing import Router

# Each builder takes the near-equal margin and a random generator (for determinism).
_BUILDERS: Mapping[str, Callable[[float, random.Random], Router]] = MappingProxyType(
    {
        "headroom": lambda near_equal, rng: Headroom(near_equal, rng),
        "least_loaded": lambda near_equal, rng: LeastLoaded(),
        "round_robin": lambda near_equal, rng: RoundRobin(),
    }
)


def router_kinds() -> tuple[str, ...]:
    return tuple(_BUILDERS)


def build_router(kind: str, *, near_equal: float = 0.1, rng: random.Random | None = None) -> Router:
    return _BUILDERS[kind](near_equal, rng or random.Random())
