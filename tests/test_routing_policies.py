"""The pure routing policies: loads, routers, affinity, pool plans, context limits."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gateway.routing import session_of
from gateway.settings import AffinityConfig, PoolConfig, RoutingConfig
from policies.affinity import SessionTable, Sticky
from policies.headroom import Headroom
from policies.least_loaded import LeastLoaded
from policies.long_context import (
    PoolPlan,
    choose_across_pools,
    exceeds_every_context,
    fits_context,
    lender_fits,
    plan_pools,
)
from policies.round_robin import RoundRobin
from policies.routers import build_router, router_kinds
from policies.routing import Load, RouteRequest

POOLS = {
    "short": PoolConfig(max_prompt_tokens=8192),
    "long": PoolConfig(min_prompt_tokens=8192),
}
REQ = RouteRequest(cost=1_000)


def load(name: str, in_flight: int = 0, limit: int = 10, **kw: object) -> Load:
    return Load(name=name, in_flight=in_flight, limit=limit, **kw)  # type: ignore[arg-type]


# --- Load ---------------------------------------------------------------------------


def test_fits_needs_a_request_permit_and_the_tokens() -> None:
    assert load("a", 9, 10).fits(1)
    assert not load("a", 10, 10).fits(1)
    budget = load("a", 1, 10, tokens_in_flight=30_000, token_limit=40_000)
    assert budget.fits(10_000)
    assert not budget.fits(10_001)
    # No budget: tokens never refuse.
    assert load("a", 1, 10, tokens_in_flight=10**9).fits(10**9)


def test_an_idle_backend_takes_a_request_larger_than_its_budget() -> None:
    assert load("a", 0, 10, tokens_in_flight=0, token_limit=1_000).fits(50_000)


def test_pressure_is_the_fullest_resource_plus_the_engine_queue() -> None:
    assert load("a", 4, 10).pressure(0) == pytest.approx(0.5)
    tokens = load("a", 0, 10, tokens_in_flight=6_000, token_limit=10_000)
    assert tokens.pressure(2_000) == pytest.approx(0.8)
    assert load("a", 0, 10, kv_usage=0.7).pressure(0) == pytest.approx(0.7)
    assert load("a", 4, 10, waiting=5).pressure(0) == pytest.approx(1.0)


# --- routers ------------------------------------------------------------------------


def test_headroom_prefers_the_clearly_emptier_backend() -> None:
    router = Headroom(near_equal=0.1, rng=random.Random(1))
    loads = [load("a", 5), load("b", 1), load("c", 6)]
    assert {router.choose(loads, REQ).name for _ in range(50)} == {"b"}  # type: ignore[union-attr]


def test_headroom_weighs_tokens_kv_and_engine_queue() -> None:
    router = Headroom(near_equal=0.0, rng=random.Random(1))
    by_tokens = [
        load("a", 1, tokens_in_flight=30_000, token_limit=40_000),
        load("b", 2, tokens_in_flight=1_000, token_limit=40_000),
    ]
    assert router.choose(by_tokens, REQ).name == "b"  # type: ignore[union-attr]
    by_kv = [load("a", 1, kv_usage=0.9), load("b", 2, kv_usage=0.1)]
    assert router.choose(by_kv, REQ).name == "b"  # type: ignore[union-attr]
    by_queue = [load("a", 1, waiting=8), load("b", 2, waiting=0)]
    assert router.choose(by_queue, REQ).name == "b"  # type: ignore[union-attr]


def test_headroom_spreads_a_burst_over_near_equals() -> None:
    """Two random choices among near-equals: all but the worst of them get picked."""
    router = Headroom(near_equal=0.1, rng=random.Random(7))
    loads = [load("a", 0, 100), load("b", 1, 100), load("c", 1, 100), load("d", 2, 100)]
    loads.append(load("e", 60, 100))  # not a near-equal
    picks = Counter(router.choose(loads, REQ).name for _ in range(600))  # type: ignore[union-attr]
    assert set(picks) == {"a", "b", "c"}  # d loses every pair it is drawn in
    assert picks["a"] > picks["b"] > 60 and picks["c"] > 60


def test_headroom_among_equals_is_uniform() -> None:
    router = Headroom(near_equal=0.1, rng=random.Random(3))
    loads = [load(name, 2, 100) for name in "abc"]
    picks = Counter(router.choose(loads, REQ).name for _ in range(600))  # type: ignore[union-attr]
    assert min(picks.values()) > 150


def test_headroom_skips_backends_without_room() -> None:
    router = Headroom(rng=random.Random(0))
    full = [load("a", 10, 10), load("b", 1, 10, tokens_in_flight=9_500, token_limit=10_000)]
    assert router.choose(full, REQ) is None


@pytest.mark.parametrize(
    "only",
    [
        load("a"),
        load("a", 10, 10),
        load("a", 1, 10, tokens_in_flight=9_500, token_limit=10_000),
        load("a", 1, 10, tokens_in_flight=8_000, token_limit=10_000),
    ],
)
def test_headroom_with_one_backend_takes_it_exactly_when_it_fits(only: Load) -> None:
    router = Headroom(rng=random.Random(0))
    assert router.choose([only], REQ) is (only if only.fits(REQ.cost) else None)


def test_least_loaded_is_deterministic() -> None:
    loads = [load("a", 3, 10), load("b", 1, 4), load("c", 1, 10)]
    assert LeastLoaded().choose(loads, REQ).name == "c"  # type: ignore[union-attr]
    assert LeastLoaded().choose([load("a", 10, 10)], REQ) is None


def test_round_robin_cycles_and_skips_full_backends() -> None:
    router = RoundRobin()
    loads = [load("a"), load("b"), load("c")]
    assert [router.choose(loads, REQ).name for _ in range(4)] == ["a", "b", "c", "a"]  # type: ignore[union-attr]
    loads[1] = load("b", 10, 10)
    assert [router.choose(loads, REQ).name for _ in range(3)] == ["c", "a", "c"]  # type: ignore[union-attr]


def test_registry_builds_every_router_by_name() -> None:
    assert set(router_kinds()) == {"headroom", "least_loaded", "round_robin"}
    for kind in router_kinds():
        chosen = build_router(kind, rng=random.Random(0)).choose([load("x")], REQ)
        assert chosen is not None and chosen.name == "x"


# --- session affinity -------------------------------------------------------------


def test_a_session_returns_to_its_backend_until_it_is_saturated() -> None:
    table = SessionTable()
    router = Sticky(RoundRobin(), table, max_load=0.9)
    loads = [load("a"), load("b"), load("c")]
    first = router.choose(loads, RouteRequest(100, session="s1"))
    assert first is not None
    for _ in range(5):  # round robin alone would move on
        assert router.choose(loads, RouteRequest(100, session="s1")).name == first.name  # type: ignore[union-attr]
    busy = [load(x.name, 9 if x.name == first.name else 0) for x in loads]  # 10/10 with it
    moved = router.choose(busy, RouteRequest(100, session="s1"))
    assert moved is not None and moved.name != first.name
    assert table.get("s1") == moved.name  # the conversation follows its new replica


def test_requests_without_session_are_not_remembered() -> None:
    table = SessionTable()
    router = Sticky(RoundRobin(), table)
    router.choose([load("a")], REQ)
    assert len(table) == 0


def test_session_table_forgets_least_recently_used() -> None:
    table = SessionTable(max_sessions=2)
    table.remember("s1", "a")
    table.remember("s2", "b")
    assert table.get("s1") == "a"  # s1 is now the most recent
    table.remember("s3", "c")
    assert table.get("s2") is None
    assert (table.get("s1"), table.get("s3")) == ("a", "c")


# --- pools, spill, context ----------------------------------------------------------


def test_prompts_go_to_the_pool_whose_range_holds_them() -> None:
    both = {"short", "long"}
    assert plan_pools(POOLS, both, 1_000) == PoolPlan("short", ("long",))
    assert plan_pools(POOLS, both, 8_191).home == "short"  # type: ignore[union-attr]
    assert plan_pools(POOLS, both, 8_192) == PoolPlan("long", ())
    assert plan_pools(POOLS, both, 30_000) == PoolPlan("long", ())


def test_spill_directions_are_configurable() -> None:
    both = {"short", "long"}
    assert plan_pools(POOLS, both, 1_000, to_longer=False) == PoolPlan("short", ())
    assert plan_pools(POOLS, both, 20_000, to_shorter=True) == PoolPlan("long", ("short",))


def test_a_pool_without_healthy_backends_hands_over_to_the_nearest() -> None:
    assert plan_pools(POOLS, {"short"}, 20_000) == PoolPlan("short", ())
    assert plan_pools(POOLS, {"long"}, 100) == PoolPlan("long", ())
    assert plan_pools(POOLS, set(), 100) is None


def test_overlapping_ranges_send_a_prompt_to_the_first_pool_in_config_order() -> None:
    # As documented; the tie-break meant for gaps between ranges sent it to the longer one.
    pools = {
        "a": PoolConfig(max_prompt_tokens=16384),
        "b": PoolConfig(min_prompt_tokens=4096),
    }
    assert plan_pools(pools, set(pools), 6_000).home == "a"  # type: ignore[union-attr]
    assert plan_pools(pools, set(pools), 20_000).home == "b"  # type: ignore[union-attr]


def test_three_pools_lend_nearest_first() -> None:
    pools = {
        "chat": PoolConfig(max_prompt_tokens=2048),
        "mid": PoolConfig(min_prompt_tokens=2048, max_prompt_tokens=16384),
        "rag": PoolConfig(min_prompt_tokens=16384),
    }
    every = set(pools)
    assert plan_pools(pools, every, 100) == PoolPlan("chat", ("mid", "rag"))
    assert plan_pools(pools, every, 5_000, to_shorter=True) == PoolPlan("mid", ("rag", "chat"))


def test_context_limits() -> None:
    assert fits_context(None, 10**6, 10)  # unknown: the backend decides
    assert fits_context(40_960, 40_000, 960)
    assert not fits_context(40_960, 40_000, 961)
    # The prompt is judged at the fewest tokens it can be (an estimate's floor, counted
    # before): no margin here.
    assert fits_context(40_960, 40_959, 1)
    assert not fits_context(40_960, 40_960, 1)
    assert exceeds_every_context([8_192, 40_960], 50_000, 1)
    assert not exceeds_every_context([8_192, 40_960], 30_000, 1)
    assert not exceeds_every_context([8_192, None], 50_000, 1)
    assert not exceeds_every_context([], 50_000, 1)


def test_a_lender_lends_idle_headroom_only() -> None:
    idle = load("l", 1, 10, tokens_in_flight=1_000, token_limit=100_000)
    assert lender_fits(idle, 1_000, max_load=0.5)
    busy = load("l", 5, 10)  # 6/10 with the request
    assert not lender_fits(busy, 1_000, max_load=0.5)
    assert not lender_fits(load("l", 10, 10), 1, max_load=1.0)


def across(plan: PoolPlan, pools: dict[str, list[Load]], queued: dict[str, int] | None = None):
    asked: list[str] = []

    def loads(pool: str) -> list[Load]:
        asked.append(pool)
        return pools[pool]

    chosen = choose_across_pools(
        plan,
        REQ,
        loads=loads,
        router=lambda pool: LeastLoaded(),
        queued=lambda pool: (queued or {}).get(pool, 0),
        max_load=0.5,
    )
    return chosen and (chosen[0], chosen[1].name), asked


def test_home_first_lenders_only_when_home_is_full() -> None:
    plan = PoolPlan("short", ("long",))
    free = {"short": [load("s0", 3, 4)], "long": [load("l0", 0, 8)]}
    assert across(plan, free) == (("short", "s0"), ["short"])  # lenders not even looked at
    full = {"short": [load("s0", 4, 4)], "long": [load("l0", 0, 8)]}
    assert across(plan, full) == (("long", "l0"), ["short", "long"])


def test_a_lender_keeps_its_headroom_for_its_own_queue_and_load() -> None:
    plan = PoolPlan("short", ("long",))
    full_short = [load("s0", 4, 4)]
    assert across(plan, {"short": full_short, "long": [load("l0", 0, 8)]}, {"long": 1})[0] is None
    half_busy = {"short": full_short, "long": [load("l0", 4, 8)]}  # 5/8 with it > 0.5
    assert across(plan, half_busy)[0] is None
    assert across(PoolPlan("short"), {"short": full_short, "long": [load("l0", 0, 8)]})[0] is None


def test_the_session_header_is_found_however_the_config_spells_it() -> None:
    """The gateway reads request headers by their lower-case names (as HTTP/1.1 servers
    hand them over), while an operator may configure the name as HTTP documents spell it."""
    config = RoutingConfig(affinity=AffinityConfig(enabled=True, header="X-Session-Id"))
    assert session_of({"x-session-id": "abc"}, {}, config) == "abc"
    assert session_of({}, {"user": "alice"}, config) == "user:alice"
