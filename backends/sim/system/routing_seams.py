"""kneecap's routing policies plugged into the whole-system simulation's seams.

The harness (:class:`~backends.sim.system.sim.SystemSim`) asks three questions;
each is answered by the same pure policy the gateway runs:

* ``pool_of(request)``: :func:`policies.long_context.plan_pools`'s home pool;
* ``admits(backend, request)``: :meth:`policies.routing.Load.fits` -- a request
  permit *and*, with a token budget, room for the request's prompt + max
  output tokens (:func:`policies.token_budget.token_budget` of the engine's
  KV capacity);
* ``router(request, candidates)``: the pool's router from
  :func:`policies.routers.build_router`.

Each backend becomes a :class:`~policies.routing.Load` as
:func:`gateway.routing.load_of` builds it: counts and limit from the replica,
the token budget, and the engine's waiting queue and KV usage as last scraped
(the harness reads them at its 1 s control ticks; the gateway scrapes every
second too).

Not played: spill between pools. The harness offers a router only its home
pool's backends, and only when one of them admits, so a short prompt cannot
borrow the long pool's idle headroom here. The seam it would need is a router
that sees every pool (``choose_across_pools``) and a queue that wakes on any
release. Callers can check that it would not have acted: spill only acts while
the short pool has requests waiting.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence

from backends.sim.system.model import SimBackend, SimRequest, always
from backends.sim.system.sim import BackendSpec, SystemSim
from gateway.settings import PoolConfig
from policies.long_context import plan_pools
from policies.routers import build_router
from policies.routing import Load, Router, RouteRequest
from policies.static import StaticLimitConfig
from policies.token_budget import token_budget

LONG_FROM = 8192  # the pools' boundary: short < 8192 <= long
POOLS: Mapping[str, PoolConfig] = {
    "short": PoolConfig(max_prompt_tokens=LONG_FROM),
    "long": PoolConfig(min_prompt_tokens=LONG_FROM),
}
KV_FRACTION = 0.95  # token_budget.kv_fraction's default
NEAR_EQUAL = 0.1  # routing.near_equal's default
UNLIMITED = StaticLimitConfig(initial=100_000, max=100_000)  # with admits=always: no limit


def cost_of(request: SimRequest) -> int:
    """Its share of a token budget: prompt + max output tokens."""
    return request.prompt_tokens + request.max_tokens


def home_pool(request: SimRequest) -> str:
    plan = plan_pools(POOLS, set(POOLS), request.prompt_tokens, to_longer=True, to_shorter=False)
    assert plan is not None  # every pool serves
    return plan.home


class Policies:
    """A router per pool and the admission test, over the harness's backends."""

    def __init__(self, make_router: Callable[[], Router], *, budgeted: bool) -> None:
        self._make_router = make_router
        self._routers: dict[str, Router] = {}
        self._budgeted = budgeted
        self.sim: SystemSim | None = None  # bound once the simulation is built

    def token_limit(self, backend: SimBackend) -> int | None:
        if not self._budgeted:
            return None
        return token_budget(
            configured=None,
            kv_capacity=backend.profile.kv_tokens,
            kv_fraction=KV_FRACTION,
            default=None,
        )

    def load(self, backend: SimBackend) -> Load:
        waiting = kv_usage = None
        if self.sim is not None and self.sim.intervals:
            for point in self.sim.intervals[-1].backends:
                if point.name == backend.name:
                    waiting, kv_usage = point.waiting, point.kv_usage
        replica = backend.replica
        return Load(
            name=backend.name,
            in_flight=replica.in_flight,
            limit=replica.limit,
            tokens_in_flight=backend.tokens_in_flight,
            token_limit=self.token_limit(backend),
            waiting=waiting,
            kv_usage=kv_usage,
        )

    def admits(self, backend: SimBackend, request: SimRequest) -> bool:
        return self.load(backend).fits(cost_of(request))

    def route(self, request: SimRequest, candidates: Sequence[SimBackend]) -> SimBackend | None:
        router = self._routers.get(request.pool)
        if router is None:
            router = self._routers[request.pool] = self._make_router()
        loads = [self.load(b) for b in candidates]
        chosen = router.choose(loads, RouteRequest(cost=cost_of(request)))
        if chosen is None:
            return None
        return next(b for b in candidates if b.name == chosen.name)


def kneecap(
    profile: str,
    *,
    shorts: int = 2,
    longs: int = 1,
    request_limit: int = 32,
    long_request_limit: int | None = None,
    budgeted: bool = True,
    seed: int = 0,
) -> SystemSim:
    """Pools by prompt length, headroom routers, static request limits, token budgets.

    ``long_request_limit`` overrides the long pool's request limit; ``budgeted``
    False counts requests only (every backend).
    """
    rng = random.Random(seed)
    policies = Policies(
        lambda: build_router("headroom", near_equal=NEAR_EQUAL, rng=rng), budgeted=budgeted
    )
    long_limit = None
    if long_request_limit is not None:
        long_limit = StaticLimitConfig(initial=long_request_limit)
    backends = [BackendSpec(f"short-{i}", profile, pool="short") for i in range(shorts)]
    backends += [
        BackendSpec(f"long-{i}", profile, pool="long", limit=long_limit) for i in range(longs)
    ]
    sim = SystemSim(
        backends,
        limit=StaticLimitConfig(initial=request_limit),
        router=policies.route,
        admits=policies.admits,
        pool_of=home_pool,
        seed=seed,
    )
    policies.sim = sim
    return sim


def round_robin(profile: str, replicas: int = 3, *, seed: int = 0) -> SystemSim:
    """The replicas behind plain round-robin, with no admission limits (as users run today)."""
    policies = Policies(lambda: build_router("round_robin"), budgeted=False)
    backends = [BackendSpec(f"rr-{i}", profile) for i in range(replicas)]
    sim = SystemSim(backends, limit=UNLIMITED, router=policies.route, admits=always, seed=seed)
    policies.sim = sim
    return sim
