"""The pure half of planning a waiter again: where it may take a backend once its own
pool lost every replica (see tests/test_pool_loss.py for the gateway's half)."""

from __future__ import annotations

from policies.least_loaded import LeastLoaded
from policies.long_context import PoolPlan, choose_across_pools
from policies.routing import Load, RouteRequest

REQ = RouteRequest(cost=1_000)


def load(name: str, in_flight: int = 0, limit: int = 10) -> Load:
    return Load(name=name, in_flight=in_flight, limit=limit)


def choose(
    plan: PoolPlan, pools: dict[str, list[Load]], queued: dict[str, int], waits_in: str
) -> str | None:
    chosen = choose_across_pools(
        plan,
        REQ,
        loads=lambda pool: pools.get(pool, []),
        router=lambda pool: LeastLoaded(),
        queued=lambda pool: queued.get(pool, 0),
        max_load=0.5,
        waits_in=waits_in,
    )
    return chosen and chosen[1].name


def test_planned_onto_another_pool_it_takes_any_room_there_as_home() -> None:
    # l0 at 9/10 after it: no lender would lend that, a home gives it.
    plan = PoolPlan("long")
    assert choose(plan, {"long": [load("l0", 8, 10)]}, {}, waits_in="short") == "l0"


def test_planned_onto_another_pool_it_waits_behind_that_pools_own_queue() -> None:
    plan = PoolPlan("long")
    pools = {"long": [load("l0", 0, 10)]}
    assert choose(plan, pools, {"long": 1}, waits_in="short") is None
    # Its own queue's waiters are the ones it is among: they do not hold it back.
    assert choose(plan, pools, {"short": 3}, waits_in="short") == "l0"
