"""The rolling window the admission controller reads: percentiles, rates, eviction."""

from __future__ import annotations

import pytest

from gateway.window import RollingWindow, percentile


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
