"""The rolling window the admission controller reads: percentiles, rates, eviction."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from gateway.window import RollingWindow, kaplan_meier, percentile


def censored_percentiles(
    observed: list[float], censored: list[float], qs: tuple[float, ...]
) -> list[float | None]:
    """The estimates' values."""
    return [estimate.value for estimate in kaplan_meier(observed, censored, qs)]


def test_nearest_rank_percentile() -> None:
    values = sorted(float(v) for v in range(1, 101))
    assert percentile(values, 50) == 50
    assert percentile(values, 95) == 95
    assert percentile(values, 99) == 99
    assert percentile([], 95) is None


def test_ttft_percentiles_and_completions_over_the_span() -> None:
    window = RollingWindow(span_s=5, created=0.0)
    for i in range(100):
        window.add_ttft(1.0 + i * 0.01, 0.001 * (i + 1))
        window.add_completed(1.0 + i * 0.01)
    stats = window.stats(3.0)
    assert stats.ttft_samples == 100 and stats.completed == 100
    assert stats.ttft_p50 == pytest.approx(0.050)
    assert stats.ttft_p95 == pytest.approx(0.095)
    assert window.stats(10.0).ttft_samples == 0  # all older than the span


def test_itl_percentiles_are_within_bucket_resolution() -> None:
    window = RollingWindow(span_s=5, created=0.0)
    gaps = [0.010] * 90 + [0.050] * 9 + [0.200]
    window.add_itl(1.0, gaps)
    stats = window.stats(1.5)
    assert stats.itl_p50 == pytest.approx(0.010, rel=0.03)
    assert stats.itl_p95 == pytest.approx(0.050, rel=0.03)
    assert stats.itl_p99 == pytest.approx(0.050, rel=0.03)
    window.add_itl(1.2, [0.200] * 100)  # same slice
    assert window.stats(1.5).itl_p95 == pytest.approx(0.200, rel=0.03)


def test_itl_slices_expire_whole() -> None:
    window = RollingWindow(span_s=2, created=0.0)
    window.add_itl(0.0, [0.5] * 10)
    window.add_itl(2.5, [0.01] * 10)  # a new slice
    assert window.stats(2.9).itl_p99 == pytest.approx(0.5, rel=0.03)  # first slice still in span
    assert window.stats(3.5).itl_p99 == pytest.approx(0.01, rel=0.03)


def test_tokens_per_second_divides_by_age_until_the_span_is_full() -> None:
    window = RollingWindow(span_s=10)
    window.add_tokens(100.0, 50)
    window.add_tokens(102.0, 50)
    assert window.stats(102.0).output_tokens_per_s == pytest.approx(50.0)  # 100 tokens in 2 s
    assert window.stats(104.0).output_tokens_per_s == pytest.approx(25.0)
    assert window.stats(115.0).output_tokens_per_s == pytest.approx(0.0)


# --- censored TTFTs: Kaplan-Meier ------------------------------------------------
# Streams that ended before their first token bound their TTFT from below. Cases
# computed by hand from the product-limit rule: an observed value multiplies S by
# 1 - 1/at_risk, a censored one only leaves the risk set; p_q is the first observed
# value where 1 - S >= q/100, else the largest censored value.

ONE_TO_TEN = [float(v) for v in range(1, 11)]
QS = (50, 90, 95, 99)


def test_without_censoring_the_estimate_is_the_nearest_rank() -> None:
    for n in range(1, 120):
        values = [0.001 * v for v in range(1, n + 1)]
        for q in (0, 1, 10, 50, 90, 95, 99, 99.9, 100):
            assert censored_percentiles(values, [], (q,)) == [percentile(values, q)], (n, q)


def test_censored_below_every_observed_value_changes_nothing() -> None:
    # At risk 11, the 0.5 leaves: the same ten steps as without it.
    assert censored_percentiles(ONE_TO_TEN, [0.5], QS) == [5, 9, 10, 10]


def test_censored_between_observed_values_raises_what_is_above_it() -> None:
    # 1..5: S = 10/11 ... 6/11 (1 - S = 0.45); 5.5 leaves (at risk 6 -> 5);
    # 6: S = 6/11 * 4/5 = 0.436 (0.56 >= 0.5); 9: S = 6/55 (0.89 < 0.9); 10: S = 0.
    assert censored_percentiles(ONE_TO_TEN, [5.5], QS) == [6, 10, 10, 10]
    assert [percentile(ONE_TO_TEN, q) for q in QS] == [5, 9, 10, 10]  # the survivors'


def test_censored_above_every_observed_value_is_a_lower_bound_at_the_top() -> None:
    # At risk 11: after k observed 1 - S = k/11, at most 10/11 = 0.909: p50 at k = 6,
    # p90 at k = 10, p95 and p99 never reached: the largest censored value.
    assert censored_percentiles(ONE_TO_TEN, [20.0], QS) == [6, 10, 20, 20]


def test_heavy_censoring_at_the_top_reads_as_the_largest_censored_value() -> None:
    # Half gave up after 11..20 s: 1 - S reaches 10/20 at the last observed value.
    censored = [float(v) for v in range(11, 21)]
    assert censored_percentiles(ONE_TO_TEN, censored, QS) == [10, 20, 20, 20]


def test_all_censored_is_the_largest_censored_value() -> None:
    assert censored_percentiles([], [1.0, 2.0, 3.0], QS) == [3, 3, 3, 3]
    assert censored_percentiles([], [], QS) == [None] * 4


def test_an_observed_value_leaves_before_a_censored_one_it_ties_with() -> None:
    # 1 (observed, at risk 3): S = 2/3; 1 (censored) leaves; 2 (at risk 1): S = 0.
    # Censored first would have read S = 1/2 at 1, and p50 = 1.
    assert censored_percentiles([1.0, 2.0], [1.0], (50,)) == [2]
    # 1: 5/6; 2: 4/6; 2: 3/6 (p50); both censored 2s leave; 3: S = 0.
    assert censored_percentiles([1.0, 2.0, 2.0, 3.0], [2.0, 2.0], (50, 95)) == [2, 3]


def walked_kaplan_meier(
    observed: list[float], censored: list[float], qs: tuple[float, ...]
) -> list[float | None]:
    """The estimator by its definition, one value at a time, with exact fractions: the
    reference the solved stretches must match."""
    if not observed and not censored:
        return [None] * len(qs)
    events = sorted([(v, 0) for v in observed] + [(v, 1) for v in censored])
    at_risk, survival = len(events), Fraction(1)
    results: list[float | None] = [None] * len(qs)
    for value, is_censored in events:
        if not is_censored:
            survival *= Fraction(at_risk - 1, at_risk)
            for i, q in enumerate(qs):
                if results[i] is None and 1 - survival >= Fraction(q) / 100:
                    results[i] = value
        at_risk -= 1
    return [max(censored) if r is None else r for r in results]


def test_the_solved_estimator_matches_the_walked_one() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        # Few distinct values half the time: ties between and among both kinds.
        pool = [rng.choice((0.1, 0.2, 0.3, 0.5, 1.0)) for _ in range(4)]
        tied = rng.random() < 0.5

        def draw(pool: list[float] = pool, tied: bool = tied) -> float:
            return rng.choice(pool) if tied else rng.uniform(0, 2)

        observed = sorted(draw() for _ in range(rng.randint(0, 60)))
        censored = sorted(draw() for _ in range(rng.randint(0, 12)))
        expected = walked_kaplan_meier(observed, censored, (50, 90, 95, 99))
        got = censored_percentiles(observed, censored, (50, 90, 95, 99))
        assert got == expected, (observed, censored)


def test_a_large_window_with_one_censored_value() -> None:
    observed = [i / 1000 for i in range(50_000)]
    assert censored_percentiles(observed, [25.0], (50, 95, 99)) == [25.0, 47.5, 49.5]


def test_only_a_percentile_no_observed_value_reaches_is_a_bound() -> None:
    estimates = kaplan_meier(ONE_TO_TEN, [20.0], QS)
    assert [e.bound for e in estimates] == [False, False, True, True]
    assert [e.bound for e in kaplan_meier(ONE_TO_TEN, [0.5], QS)] == [False] * 4
    window = RollingWindow(span_s=60)
    for value in (0.1, 0.2):
        window.add_ttft(1.0, value)
    window.add_censored_ttft(1.0, 5.0)
    stats = window.stats(2.0)
    assert (stats.ttft_p95, stats.ttft_p95_bound) == (5.0, True)
    window.add_ttft(1.5, 9.0)  # observed past the wait: the p95 is measured again
    stats = window.stats(2.0)
    assert (stats.ttft_p95, stats.ttft_p95_bound) == (9.0, False)


def test_the_window_keeps_censored_ttfts_over_the_same_span() -> None:
    window = RollingWindow(span_s=5, created=0.0)
    for i, value in enumerate(ONE_TO_TEN):
        window.add_ttft(1.0 + i * 0.01, value)
    window.add_censored_ttft(2.0, 20.0)
    stats = window.stats(3.0)
    assert (stats.ttft_samples, stats.ttft_censored) == (11, 1)
    assert (stats.ttft_p50, stats.ttft_p95, stats.ttft_p99) == (6, 20, 20)
    assert stats.as_dict()["ttft_censored"] == 1  # what /admin/state shows
    window.add_ttft(6.5, 0.5)
    stats = window.stats(6.9)  # the observed ones left the span, the censored one is in
    assert (stats.ttft_samples, stats.ttft_censored, stats.ttft_p50) == (2, 1, 0.5)
    assert stats.ttft_p95 == 20
    stats = window.stats(7.1)  # and now it is gone too: the nearest rank again
    assert (stats.ttft_samples, stats.ttft_censored, stats.ttft_p95) == (1, 0, 0.5)
