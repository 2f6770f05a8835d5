"""The whole system in virtual time: short versions of issue 6's acceptance runs.

The full runs and every figure: ``python -m backends.sim.system.acceptance``.
"""

from __future__ import annotations

import pytest

from backends.sim.system import (
    Admits,
    BackendSpec,
    ClosedLoop,
    Poisson,
    RoundRobin,
    Shape,
    SimBackend,
    SimRequest,
    SystemSim,
    always,
    within_limit,
    within_token_budget,
)
from backends.sim.system.acceptance import (
    BAND,
    CLIENTS,
    PROFILE,
    SHAPE,
    SLO_S,
    SWING,
    Comparison,
    knee,
    sweep,
)
from backends.sim.system.report import Outcome, limit_trace, outcome, settling
from policies.static import StaticLimitConfig


def closed(
    initial: int,
    seconds: float,
    *,
    seed: int = 0,
    profile: str = PROFILE,
    admits: Admits = within_limit,
) -> SystemSim:
    sim = SystemSim([BackendSpec("b0", profile)], limit=knee(initial), admits=admits, seed=seed)
    ClosedLoop(sim, CLIENTS, SHAPE, start_spread_s=2.0, seed=seed)
    sim.run(seconds)
    return sim


@pytest.mark.parametrize("initial", [4, 128])
def test_the_knee_settles_within_120_s_in_the_band_from_either_side(initial: int) -> None:
    trace = limit_trace(closed(initial, 300))
    s = settling(trace, *BAND, SWING)
    assert s.at is not None and s.at <= 120
    assert BAND[0] <= s.low and s.high <= BAND[1]
    assert s.swing <= SWING


def test_overload_keeps_admitted_ttft_within_the_slo_and_sheds_at_the_deadline() -> None:
    def run(admitted_by_knee: bool) -> SystemSim:
        limit = knee(4) if admitted_by_knee else StaticLimitConfig(initial=10_000, max=10_000)
        admits = None if admitted_by_knee else always
        sim = SystemSim(
            [BackendSpec("b0", PROFILE)],
            limit=limit,
            **({} if admits is None else {"admits": admits}),
        )
        Poisson(sim, 0.8, SHAPE, seed=3)  # ~2x what the knee serves (~1,150 tok/s)
        sim.run(480)
        return sim

    with_knee = outcome(run(True), 240, 480)
    assert with_knee.ttft_p95 is not None and with_knee.ttft_p95 <= SLO_S
    assert with_knee.shed > 0.25 * with_knee.arrived  # overload: a good part is shed ...
    assert with_knee.shed_overshoot_max is not None
    assert with_knee.shed_overshoot_max <= 0.050  # ... each at its queue deadline
    assert with_knee.wait_p95 is not None and with_knee.wait_p95 <= 30.0
    straight = outcome(run(False), 240, 480)
    assert straight.shed == 0
    assert straight.ttft_p95 is not None and straight.ttft_p95 > 20 * SLO_S  # today
    assert with_knee.goodput > 2 * straight.goodput


@pytest.mark.parametrize("admits", [within_limit, within_token_budget])
def test_the_limit_follows_a_backend_redeployed_on_a_slower_gpu(admits: Admits) -> None:
    # With the token budget (the gateway's default) the L4 admits 17 of these requests
    # where the L40S ran 41: the controller first sees it at another load. Judged
    # against the L40S's solo speed it looked far past its knee, and the limit sank to 1.
    new = "qwen3-4b/l4/bf16/vllm"
    fresh = limit_trace(closed(4, 200, profile=new, admits=admits))
    level = sorted(fresh[120:])[len(fresh[120:]) // 2]
    sim = SystemSim([BackendSpec("b0", PROFILE)], limit=knee(4), admits=admits)
    ClosedLoop(sim, CLIENTS, SHAPE, start_spread_s=2.0)
    sim.at(200, lambda: sim.replace_engine("b0", new))
    sim.run(520)
    trace = limit_trace(sim)
    assert trace[190] >= 2 * level  # the L40S carried far more
    # From 120 s after the change on, and on while the L40S's 40-odd streams, too many
    # for the L4's KV cache, take minutes to drain (preempted and recomputed meanwhile).
    within = trace[200 + 120 :]
    assert all((1 - SWING) * level <= x <= (1 + SWING) * level for x in within)


def test_a_run_is_deterministic_for_its_seed() -> None:
    a, b = closed(4, 120, seed=5), closed(4, 120, seed=5)
    assert limit_trace(a) == limit_trace(b)
    assert [r.first_token for r in a.requests] == [r.first_token for r in b.requests]
    # Another seed is another run (its limits may still coincide: the knee is robust)
    other = closed(4, 120, seed=6)
    assert [r.first_token for r in a.requests] != [r.first_token for r in other.requests]


def test_routing_and_admission_predicates_plug_in() -> None:
    budget = 4 * (1024 + 256)  # tokens in flight per backend, as token-budget admission

    def within_budget(backend: SimBackend, request: SimRequest) -> bool:
        return backend.tokens_in_flight + request.prompt_tokens + request.max_tokens <= budget

    seen: list[int] = []
    sim = SystemSim(
        [BackendSpec("a", PROFILE), BackendSpec("b", PROFILE)],
        limit=StaticLimitConfig(initial=64),
        router=RoundRobin(),
        admits=within_budget,
    )
    ClosedLoop(sim, 32, Shape(1024, 256))

    def check() -> None:
        seen.extend(b.tokens_in_flight for b in sim.backends)
        sim.at(sim.now + 0.5, check)

    sim.at(0.1, check)
    sim.run(60)
    assert max(seen) <= budget  # the predicate held every admission back
    served = {r.backend.name for r in sim.requests if r.backend is not None}
    assert served == {"a", "b"}
    assert sum(r.status == "ok" for r in sim.requests) > 100


def test_nothing_is_left_held_or_queued_after_cancellations_and_a_redeploy() -> None:
    sim = SystemSim([BackendSpec("b0", PROFILE)], limit=StaticLimitConfig(initial=8))
    requests = [sim.submit(1024, 64) for _ in range(20)]  # 8 admitted, 12 queued
    assert sim.queued() == 12
    sim.run(0.5)
    for request in requests[::3]:
        sim.cancel(request)  # in flight and queued alike
    sim.at(1.0, lambda: sim.replace_engine("b0", "qwen3-4b/l4/bf16/vllm"))
    sim.run(120)
    replica = sim.backends[0].replica
    assert replica.in_flight == 0 and sim.queued() == 0
    assert not sim.backends[0].running and sim.backends[0].tokens_in_flight == 0
    assert all(r.status is not None for r in requests)
    assert {r.status for r in requests} >= {"ok", "cancelled", "failed"}


def _goodput(value: float) -> Outcome:
    return Outcome(
        arrived=0,
        admitted=0,
        shed=0,
        ttft_p50=None,
        ttft_p95=None,
        wait_p50=None,
        wait_p95=None,
        shed_overshoot_max=None,
        throughput=value,
        goodput=value,
        limit_median=None,
    )


def test_the_static_sweep_finds_the_best_limit_between_its_grid_points() -> None:
    # Goodput climbs to a cliff at 86 (as under Poisson arrivals): the grid's best
    # point is 80, the real best 84 -- hindsight must not be flattered by the grid.
    measured: list[int] = []

    def measure(n: int) -> Outcome:
        measured.append(n)
        return _goodput(n if n <= 86 else 40.0)

    found = sweep(measure, (32, 48, 64, 80, 96))
    assert max(found, key=lambda n: found[n].goodput) == 84
    assert list(found) == sorted(found)
    assert len(measured) == len(set(measured)) == 9  # the grid, then 72/88, then 76/84
    compared = Comparison(_goodput(75.6), found)
    assert compared.best[0] == 84
    assert compared.share == pytest.approx(0.9)


def test_the_default_admission_also_holds_the_token_budget() -> None:
    sim = SystemSim([BackendSpec("b0", PROFILE)], limit=StaticLimitConfig(initial=100))
    backend = sim.backends[0]
    r = SimRequest(id=0, prompt_tokens=1024, max_tokens=2816, arrived=0.0, deadline=30.0)
    budget = int(0.95 * backend.profile.kv_tokens)  # routing.token_budget's default
    backend.replica.in_flight, backend.tokens_in_flight = 1, budget - 3840
    assert within_token_budget(backend, r) and within_limit(backend, r)
    backend.tokens_in_flight += 1  # one token short of room
    assert not within_token_budget(backend, r) and within_limit(backend, r)
    backend.replica.in_flight, backend.tokens_in_flight = 0, 0
    huge = SimRequest(id=1, prompt_tokens=10**6, max_tokens=1, arrived=0.0, deadline=30.0)
    assert within_token_budget(backend, huge)  # alone, anything runs
    backend.replica.in_flight = 100
    assert not within_token_budget(backend, r)  # and the request limit still holds


def test_a_stream_cancelled_before_its_first_token_is_a_censored_ttft_as_in_the_gateway() -> None:
    sim = SystemSim([BackendSpec("b0", PROFILE)], limit=StaticLimitConfig(initial=8))
    requests = [sim.submit(1024, 64) for _ in range(8)]
    sim.run(0.001)  # admitted, their prefills not done
    waiting = [r for r in requests if r.backend is not None and r.first_token is None]
    assert waiting
    sim.cancel(waiting[0])
    stats = sim.backends[0].window.stats(sim.now)
    assert stats.ttft_censored == 1 and stats.ttft_samples == 1
    assert stats.ttft_p95 == pytest.approx(sim.now - waiting[0].admitted)
