"""The meter's fixes in the meter alone: per-token spreading, reasoning never streamed,
and the window's live estimate replaced at a stream's end (see test_meter_fixes.py)."""

from __future__ import annotations

import pytest

from gateway.meter import Usage, _spread
from gateway.window import ItlBuckets, RollingWindow
from tests.test_meter_fixes import delta, fed

# --- the meter alone: spreading, reasoning, the window's correction ---------------


def test_spreading_in_parts_gives_the_values_of_spreading_whole() -> None:
    gaps = [0.01 * (k + 1) for k in range(11)]
    for tokens, events in [(37, 12), (4000, 1000), (2500, 1000), (12, 12), (5, 12)]:
        whole = _spread(gaps, 0, tokens, events)
        assert _spread(gaps[:4], 0, tokens, events) + _spread(gaps[4:], 4, tokens, events) == whole
        assert sum(whole) == pytest.approx(sum(gaps))


def test_streamed_reasoning_is_not_taken_out() -> None:
    """Reasoning streamed a token an event (the usual case): its tokens are the gaps'."""
    timeline = [(0.1 * k, delta(reasoning_content="r")) for k in range(1, 6)]
    timeline += [(0.1 * k, delta(content="c")) for k in range(6, 11)]
    meter = fed(timeline)
    meter.usage = Usage(5, 10, reasoning_tokens=5)
    assert meter.token_gaps() == pytest.approx([0.1] * 9)


def test_usage_reads_reasoning_tokens_in_either_place() -> None:
    details = {"completion_tokens_details": {"reasoning_tokens": 7}}
    assert Usage.from_json({"completion_tokens": 9, **details}) == Usage(0, 9, 7)
    assert Usage.from_json({"completion_tokens": 9, "reasoning_tokens": 7}) == Usage(0, 9, 7)
    assert Usage.from_json({"completion_tokens": 9, "reasoning_tokens": 70}) == Usage(0, 9, 0)
    assert Usage.from_json({"completion_tokens": 9, "reasoning_tokens": "7"}) == Usage(0, 9, 0)


def counts_of(window: RollingWindow) -> dict[int, int]:
    merged: dict[int, int] = {}
    for _, buckets in window._itl:
        for index, count in buckets.counts.items():
            if count:
                merged[index] = merged.get(index, 0) + count
    return merged


@pytest.mark.parametrize("learned", [None, 2.0, 4.0], ids=["nothing", "too-few", "right"])
def test_the_window_ends_up_holding_the_streams_token_gaps(learned: float | None) -> None:
    """Live flushes spread by the learned ratio (or none); the final flush replaces them
    by the stream's own: the window's counts are those of ``token_gaps()``."""
    window = RollingWindow(60.0)
    if learned is not None:
        window.learn_tokens_per_event(learned)
    timeline = [(0.05 * k, delta(content="abcd")) for k in range(1, 41)]
    meter = fed(timeline, window=window)
    assert meter.estimated  # live flushes happened
    meter.usage = Usage(5, 160)
    meter.flush(2.1, final=True)
    expected = ItlBuckets()
    expected.add_many(meter.token_gaps())
    assert len(meter.token_gaps()) == 156
    assert counts_of(window) == {i: c for i, c in expected.counts.items() if c}
    assert window.stats(2.1).itl_samples == 156
    assert meter.tokens_per_event == 4.0
