"""The meter's fixes in the meter alone: per-token spreading, reasoning never streamed,
and the window's live estimate replaced at a stream's end (see test_meter_fixes.py)."""

from __future__ import annotations

import time

import pytest

from backends.replica import Replica
from gateway.meter import Usage, _spread
from gateway.settings import BackendConfig
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
    meter.usage = Usage(5, 157)  # --stream-interval 4: the first token alone, then 4 an event
    meter.flush(2.1, final=True)
    expected = ItlBuckets()
    expected.add_many(meter.token_gaps())
    assert len(meter.token_gaps()) == 156
    assert counts_of(window) == {i: c for i, c in expected.counts.items() if c}
    assert window.stats(2.1).itl_samples == 156
    assert meter.tokens_per_event == 4.0


def vllm_answer(tokens: int, gap: float = 0.05) -> list[tuple[float, bytes]]:
    """vLLM's stream of a ``tokens``-token answer ending at its EOS: one token an event,
    then an empty last chunk whose token (the EOS) usage counts."""
    timeline = [(gap * k, delta(content="x")) for k in range(1, tokens + 1)]
    return [*timeline, (gap * (tokens + 1), delta(finish="stop", content=""))]


@pytest.mark.parametrize("tokens", [1, 2, 3, 40])
def test_vllms_eos_is_no_gaps_token(tokens: int) -> None:
    """Usage counts the EOS no output event carried: a one-token answer read as two
    tokens an event, the window learned that, and the next streams' ITL read half and
    their tokens/s double (40 against 20) until each ended."""
    meter = fed(vllm_answer(tokens))
    meter.usage = Usage(5, tokens + 1)
    assert meter.token_gaps() == pytest.approx([0.05] * (tokens - 1))
    assert meter.tokens_per_event == (None if tokens == 1 else 1.0)  # what the window learns


def test_a_stop_whose_last_chunk_carried_text_keeps_every_token() -> None:
    """A stop string ends an answer on a chunk with text: no EOS to take out."""
    timeline = [(0.05 * k, delta(content="x")) for k in range(1, 4)]
    meter = fed([*timeline, (0.2, delta(finish="stop", content="y"))])
    meter.usage = Usage(5, 4)
    assert meter.token_gaps() == pytest.approx([0.05] * 3)


def test_a_young_window_counts_tokens_from_its_creation() -> None:
    """A fresh gateway's window took its age from its first sample: one 2 s answer of 500
    tokens ending read 9,088 tokens/s."""
    window = RollingWindow(5.0, created=10.0)
    window.add_tokens(12.0, 500)
    assert window.stats(12.0).output_tokens_per_s == pytest.approx(250.0)


def test_a_new_backends_window_is_as_old_as_the_backend() -> None:
    before = time.perf_counter()
    replica = Replica(BackendConfig(name="r", url="http://127.0.0.1:1"), "http://127.0.0.1:1")
    after = time.perf_counter()
    replica.window.add_tokens(after + 2.0, 500)  # one answer, ending 2 s on
    rate = replica.window.stats(after + 2.05).output_tokens_per_s
    assert 500 / (2.05 + after - before) <= rate <= 500 / 2.05
