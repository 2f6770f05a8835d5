"""The ``pick()`` admission calls for a request, each time capacity may have appeared:
live replicas turned into :class:`~policies.routing.Load` values, the pool's router's
choice, and a :class:`~policies.token_budget.Claim` (a permit plus the request's tokens,
at most what its sequences can hold in that replica's context) on the chosen replica."""

from __future__ import annotations

import time
from collections.abc import Callable

from backends.replica import Replica
from gateway.errors import ModelNotFound
from gateway.placement import Route, awaiting_probe, candidates, live_route, may_serve
from gateway.routing import load_of
from gateway.runtime import Runtime
from policies.admission import NoHealthyBackend
from policies.long_context import choose_across_pools
from policies.routing import RouteRequest
from policies.token_budget import Claim


class Planned:
    """A waiter's route as its last ``pick()`` planned it, shared with its ``could_use``:
    a waiter planned onto another pool (its home lost its replicas) could use that pool's
    replicas, and a release there must ask it."""

    __slots__ = ("route",)

    def __init__(self, route: Route) -> None:
        self.route = route


class CouldUse:
    """Whether this request could be served on a claim's replica: admission lets a request
    go ahead of waiters only onto replicas none of them could use.

    ``kind()`` is the replicas it could use now, by name: two waiters of one kind want
    the same, so a pass past a blocked head asks one of each kind, not every waiter (a
    request's own ``could_use`` never equals another's)."""

    __slots__ = ("_planned", "_runtime", "_tried")

    def __init__(self, runtime: Runtime, planned: Planned, tried: set[str]) -> None:
        self._runtime = runtime
        self._planned = planned
        self._tried = tried

    def __call__(self, claim: Claim[Replica]) -> bool:
        route = self._planned.route
        return claim.backend.pool in route.pools and route.could_serve(claim.backend, self._tried)

    def kind(self) -> frozenset[str]:
        route, tried = self._planned.route, self._tried
        backends = self._runtime.current.backends
        return frozenset(
            r.name
            for pool in route.pools
            for r in backends.in_pool(pool)
            if route.could_serve(r, tried)
        )


def make_pick(
    runtime: Runtime, planned: Planned, tried: set[str]
) -> Callable[[], Claim[Replica] | None]:
    """The router for admission: home pool first, then lenders' idle headroom.

    The request waits in its home pool's queue. Should that pool lose every replica that
    could serve it while it waits, it is planned again (:func:`live_route`): served where
    a request arriving now would be, behind that pool's own waiters, or refused at once
    (NoHealthyBackend) when nothing serves it any more."""
    route = planned.route  # as it arrived: each pick() plans from it again
    config = runtime.current.settings.routing
    request = RouteRequest(cost=route.cost, session=route.session)
    sequences = route.shape.sequences
    waits_in = route.plan.home

    def queued(pool: str) -> int:
        admission = runtime.admissions.get(pool)  # a pool a reload removed has no queue
        return admission.depth() if admission is not None else 0

    def pick() -> Claim[Replica] | None:
        # Read the live snapshot each time: a waiter must see replicas readmitted
        # or added while it queued, and fail fast when none is left.
        settings = runtime.current.settings
        mono = time.monotonic()
        live = route
        replicas = {pool: candidates(runtime, pool, route, tried) for pool in route.pools}
        if not replicas[route.plan.home]:  # the common case has some: no more to check
            live = _still_servable(runtime, route, tried)
            if live is not route:
                replicas = {pool: candidates(runtime, pool, live, tried) for pool in live.pools}
            if not any(replicas.values()) and not awaiting_probe(runtime, live, tried):
                pools = "`, `".join(live.pools)
                message = f"no healthy backend in pool `{pools}` serves `{live.model}`"
                raise NoHealthyBackend(message)
            # With no candidate at all, it waits for a new replica's first verdict (a probe
            # round starts at once).
        planned.route = live  # what its could_use answers by, until the next pick()
        chosen = choose_across_pools(
            live.plan,
            request,
            loads=lambda pool: [load_of(r, settings, mono, sequences) for r in replicas[pool]],
            router=lambda pool: runtime.routing.router(pool, config),
            queued=queued,
            max_load=config.spill.max_load,
            waits_in=waits_in,
        )
        if chosen is None:
            return None
        pool, load = chosen
        replica = next(r for r in replicas[pool] if r.name == load.name)
        return Claim(replica, load.cost_of(route.cost))  # at most its sequences' contexts

    return pick


def _still_servable(runtime: Runtime, route: Route, tried: set[str]) -> Route:
    """The route, planned again if its home lost its replicas; refused when nothing can
    serve it any more."""
    live = live_route(runtime, route, tried)
    if live is not None:
        return live
    if not route.listed and not any(
        may_serve(r, route.model) for r in runtime.current.backends.replicas
    ):  # it waited for new replicas' first verdicts, and none serves the model
        raise ModelNotFound(f"The model `{route.model}` does not exist.", param="model")
    raise NoHealthyBackend(f"no healthy backend serves `{route.model}` for this request")
