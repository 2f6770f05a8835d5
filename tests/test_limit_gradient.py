"""Envoy's gradient controller on TTFT, checked against its formula."""

from __future__ import annotations

import math

import pytest

from policies.base import Sample
from policies.gradient import GradientLimit, GradientLimitConfig
from policies.registry import reconfigure


def sample(now: float, ttft: float | None, bound: bool = False) -> Sample:
    return Sample(
        now=now,
        ttft_p95=ttft,
        itl_p95=0.03,
        output_tokens_per_s=500.0,
        in_flight=8,
        completed=4,
        engine_waiting=None,
        demand=0,
        ttft_p95_bound=bound,
    )


def measured(min_rtt: float = 0.1, **knobs: float | int) -> GradientLimit:
    """A controller past its first min-RTT window (10 s, from t=0), at t=10."""
    ctl = GradientLimit(GradientLimitConfig(**knobs))  # type: ignore[arg-type]
    ctl.update(sample(0.0, min_rtt))
    ctl.update(sample(10.0, min_rtt))
    return ctl


def envoy(limit: int, min_rtt: float, rtt: float, buffer: float = 0.25) -> int:
    gradient = max(0.5, min(2.0, min_rtt * (1 + buffer) / rtt))
    scaled = limit * gradient
    return int(scaled + math.sqrt(scaled))


def test_starts_by_measuring_min_rtt_at_min_concurrency() -> None:
    ctl = GradientLimit(GradientLimitConfig(initial=16, min=3))
    assert ctl.measuring_min_rtt and ctl.limit == 3
    assert ctl.update(sample(0.0, 0.08)) == 3
    assert ctl.update(sample(9.9, 0.08)) == 3  # the window must describe the low concurrency
    assert ctl.update(sample(10.0, 0.08)) == 16
    assert ctl.min_rtt == 0.08 and not ctl.measuring_min_rtt


def test_keeps_measuring_until_a_percentile_exists() -> None:
    ctl = GradientLimit(GradientLimitConfig(initial=16))
    ctl.update(sample(0.0, None))
    assert ctl.update(sample(30.0, None)) == 3
    assert ctl.update(sample(31.0, 0.07)) == 16


@pytest.mark.parametrize("rtt", [0.05, 0.1, 0.125, 0.2, 0.5, 2.0])
def test_limit_follows_envoys_formula(rtt: float) -> None:
    ctl = measured(initial=20)
    assert ctl.update(sample(15.0, rtt)) == envoy(20, 0.1, rtt)


def test_gradient_is_clamped_to_half_and_double() -> None:
    low = measured(initial=16)
    assert low.update(sample(15.0, 10.0)) == 8 + 2  # 16·0.5 + √8
    assert low.gradient == 0.5
    high = measured(initial=16)
    assert high.update(sample(15.0, 0.001)) == 32 + 5  # 16·2 + √32
    assert high.gradient == 2.0


def test_one_recomputation_per_update_interval() -> None:
    ctl = measured(initial=20, update_interval_s=5.0)
    first = ctl.update(sample(15.0, 0.125))
    assert ctl.update(sample(16.0, 0.125)) == first
    assert ctl.update(sample(20.0, 0.125)) == envoy(first, 0.1, 0.125)


def test_no_percentile_no_change() -> None:
    ctl = measured(initial=20)
    assert ctl.update(sample(15.0, None)) == 20


def test_bounds_hold() -> None:
    ctl = measured(initial=20, max=24)
    for t in range(15, 100, 5):
        assert 3 <= ctl.update(sample(float(t), 0.001)) <= 24
    assert ctl.limit == 24


def test_min_rtt_is_remeasured_periodically() -> None:
    ctl = measured(min_rtt=0.1, initial=20, min_rtt_interval_s=60.0)
    ctl.update(sample(15.0, 0.1))
    before = ctl.limit
    assert ctl.update(sample(69.9, 0.1)) != 3
    assert ctl.update(sample(70.0, 0.2)) == 3  # a new window opens at min concurrency
    ctl.update(sample(80.0, 0.2))
    assert ctl.min_rtt == 0.2
    assert ctl.limit >= before  # the limit from before the window is restored


def test_a_p95_that_is_only_a_bound_is_never_the_baseline() -> None:
    """Clients that gave up before their first token at 0.05 s, and no TTFT observed: the
    window's p95 is their wait, a lower bound. Taken for min_rtt, every later sample would
    be judged against a latency nobody measured."""
    ctl = GradientLimit(GradientLimitConfig(initial=16, min=3))
    assert ctl.update(sample(0.0, 0.05, bound=True)) == 3  # the window opens
    assert ctl.update(sample(10.0, 0.05, bound=True)) == 3  # over: nothing measured to keep
    assert ctl.min_rtt is None and ctl.measuring_min_rtt
    assert ctl.update(sample(11.0, 0.08)) == 16
    assert ctl.min_rtt == 0.08
    # A later window that holds only a bound keeps the baseline it had.
    ctl = measured(min_rtt=0.1, initial=20, min_rtt_interval_s=60.0)
    ctl.update(sample(70.0, 0.3, bound=True))  # a new window opens
    ctl.update(sample(80.0, 0.3, bound=True))
    assert ctl.min_rtt == 0.1 and not ctl.measuring_min_rtt


def test_five_updates_pinned_at_min_trigger_an_early_remeasure() -> None:
    ctl = measured(initial=3, min=3, min_rtt_interval_s=1000.0)
    t = 15.0
    for _ in range(5):
        assert ctl.update(sample(t, 10.0)) == 3
        assert not ctl.measuring_min_rtt
        t += 5
    ctl.update(sample(t, 10.0))
    assert ctl.measuring_min_rtt


def test_a_reload_keeps_the_measured_min_rtt_and_the_limit() -> None:
    # A new knob (buffer) made a new controller that measured min_rtt again from scratch:
    # pinned at min, for good when traffic was too light to give it a percentile.
    old = measured(initial=20)
    assert old.update(sample(15.0, 0.1)) == envoy(20, 0.1, 0.1)
    limit = old.limit
    new = reconfigure(old, GradientLimitConfig(initial=20, buffer=0.3))
    assert isinstance(new, GradientLimit)
    assert new.limit == limit and new.min_rtt == old.min_rtt and not new.measuring_min_rtt
    assert new.update(sample(16.0, None)) == limit  # no traffic: the limit stays


def test_a_reload_inside_a_min_rtt_window_carries_the_limit_it_will_return_to() -> None:
    old = measured(initial=20)
    old.update(sample(15.0, 0.1))
    settled = old.limit
    assert old.update(sample(200.0, 0.1)) == 3  # the periodic re-measure: pinned at min
    new = reconfigure(old, GradientLimitConfig(initial=20, buffer=0.3))
    assert new.limit == settled  # not the window's min
