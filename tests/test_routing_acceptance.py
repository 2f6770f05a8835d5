"""Issue 7's acceptance in short: kneecap's routing policies on the whole-system simulation.

The full runs and every figure: ``python -m backends.sim.system.routing_acceptance``
(``docs/routing-acceptance.md``).
"""

from __future__ import annotations

import pytest

from backends.sim.system.routing_acceptance import (
    LOAD_SHARE,
    PROFILE,
    REQUEST_LIMIT,
    SEED,
    SHORT_P95_RATIO,
    THROUGHPUT_BAND,
    Plan,
    capacity,
    compare,
    open_loop,
)
from backends.sim.system.routing_seams import home_pool, kneecap
from backends.sim.system.sim import SystemSim

SHORT = Plan((192,), 600.0, 300.0, 60.0, 240.0, False)
LONG_PROMPT, OUTPUT = 32_768, 256


@pytest.mark.parametrize(
    ("prompt", "pool"), [(1024, "short"), (8191, "short"), (8192, "long"), (32_768, "long")]
)
def test_requests_go_home_by_prompt_length(prompt: int, pool: str) -> None:
    sim = kneecap(PROFILE)
    request = sim.submit(prompt, OUTPUT)
    assert home_pool(request) == pool == request.pool
    assert request.backend is not None and request.backend.pool == pool


def _burst(budgeted: bool) -> SystemSim:
    sim = kneecap(PROFILE, request_limit=REQUEST_LIMIT, budgeted=budgeted)
    for _ in range(8):  # six 32K prompts take ~30 s: wait longer than the default deadline
        sim.submit(LONG_PROMPT, OUTPUT, max_queue_wait_s=120.0)
    return sim


def test_the_token_budget_admits_what_the_kv_cache_holds_and_queues_the_rest() -> None:
    # Budget 0.95 x 218,096 = 207,191 tokens: six requests of 33,024, not seven.
    budgeted = _burst(True)
    long = budgeted.backend("long-0")
    assert (long.replica.in_flight, budgeted.queued("long")) == (6, 2)
    assert long.tokens_in_flight == 6 * (LONG_PROMPT + OUTPUT)
    # Counting requests only, all eight go in (the limit is 32) ...
    count_only = _burst(False)
    assert (count_only.backend("long-0").replica.in_flight, count_only.queued("long")) == (8, 0)
    # ... and the engine preempts; with the budget it never does, and everyone is served.
    for sim in (budgeted, count_only):
        sim.run(300)
        assert all(r.status == "ok" for r in sim.requests)
    assert budgeted.backend("long-0").engine.stats().preemptions_total == 0
    assert count_only.backend("long-0").engine.stats().preemptions_total > 0


def test_short_requests_stay_fast_throughput_holds_and_the_budget_prevents_preemption() -> None:
    (cap,) = capacity(SHORT)
    assert 2.5 < cap.req_per_s < 4.0  # three replicas' mix capacity (measured ~3.1 req/s)
    rate = LOAD_SHARE * cap.req_per_s
    head = compare(rate, SHORT)
    k, rr = head.kneecap, head.round_robin
    assert k.short.arrived > 400 and k.long.arrived > 50
    assert k.short.shed == 0 and rr.short.shed == rr.long.shed == 0
    assert k.short.unfinished == k.long.unfinished == rr.short.unfinished == 0
    assert k.short.ttft_p95 is not None and rr.short.ttft_p95 is not None
    assert k.short.ttft_p95 * SHORT_P95_RATIO <= rr.short.ttft_p95
    assert abs(k.throughput / rr.throughput - 1) <= THROUGHPUT_BAND
    assert k.long.ttft_p95 is not None and rr.long.ttft_p95 is not None  # reported, may rise
    assert k.long_pool_preemptions == 0
    count_only = kneecap(PROFILE, request_limit=REQUEST_LIMIT, budgeted=False, seed=SEED)
    assert open_loop(count_only, rate, SHORT).long_pool_preemptions > 0
