"""Streams of several sequences (``n`` > 1, a batch of prompts): engines interleave the
sequences' chunks, each at its own pace. Each inter-token gap runs from the same
sequence's previous output event, and the finish reason is the first sequence's, as a
whole answer's is read."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.meter import StreamMeter
from gateway.proxy_request import several_sequences


def chunk(index: int, content: str | None = None, finish: str | None = None, **extra: Any) -> bytes:
    delta = {} if content is None else {"content": content}
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    body = {"id": "c", "object": "chat.completion.chunk", "choices": [choice], **extra}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fed(timeline: list[tuple[float, bytes]], several: bool = True) -> StreamMeter:
    clock = Clock()
    meter = StreamMeter(started=0.0, clock=clock, several_sequences=several)
    for at, event in timeline:
        clock.now = at
        meter.observe([event])
    return meter


def test_gaps_run_within_each_sequence() -> None:
    """Two sequences 20 ms a token each, offset by 10 ms: every gap is 20 ms (before the
    fix: 10 ms, measured across the sequences)."""
    timeline = [(0.100 + 0.020 * step, chunk(0, f"a{step}")) for step in range(5)]
    timeline += [(0.110 + 0.020 * step, chunk(1, f"b{step}")) for step in range(5)]
    meter = fed(sorted(timeline))
    assert meter.ttft == pytest.approx(0.100)
    assert len(meter.gaps) == 8
    assert meter.gaps == pytest.approx([0.020] * 8)


def test_a_second_sequence_that_speaks_first_is_told_apart() -> None:
    timeline = [
        (0.100, chunk(1, "b0")),
        (0.105, chunk(0, "a0")),
        (0.130, chunk(1, "b1")),
        (0.145, chunk(0, "a1")),
    ]
    meter = fed(timeline)
    assert meter.ttft == pytest.approx(0.100)
    assert meter.gaps == pytest.approx([0.030, 0.040])


def test_a_single_sequence_stream_is_timed_event_to_event_whatever_its_spelling() -> None:
    """Only a request that may stream several sequences is looked at per sequence: the
    others pay nothing for it, however their engine spells its JSON."""
    spaced = [(0.1 * k, chunk(0, "x").replace(b'"index":0', b'"index": 0')) for k in (1, 2, 3)]
    meter = fed(spaced, several=False)
    assert meter.gaps == pytest.approx([0.1, 0.1])
    assert meter.last_by_sequence is None


def test_one_sequence_in_other_spellings_is_still_one() -> None:
    """Spaces, or no index at all: read as JSON, the same gaps as the compact spelling."""
    spaced = [(0.1 * k, chunk(0, "x").replace(b'"index":0', b'"index": 0')) for k in (1, 2, 3)]
    bare = [(0.1 * k, b'data: {"choices":[{"delta":{"content":"x"}}]}') for k in (1, 2, 3)]
    assert fed(spaced).gaps == pytest.approx([0.1, 0.1])
    assert fed(bare).gaps == pytest.approx([0.1, 0.1])


def test_the_finish_reason_is_the_first_sequences() -> None:
    """The second sequence stops first; a whole answer would report choice 0's reason."""
    timeline = [
        (0.10, chunk(0, "a")),
        (0.11, chunk(1, "b")),
        (0.12, chunk(1, None, "stop")),
        (0.13, chunk(0, "c")),
        (0.14, chunk(0, None, "length")),
    ]
    assert fed(timeline).finish_reason == "length"


def test_a_second_sequence_finishing_without_output_does_not_set_the_reason() -> None:
    timeline = [
        (0.10, chunk(0, "a")),
        (0.11, chunk(1, None, "stop")),
        (0.12, chunk(0, None, "length")),
    ]
    assert fed(timeline).finish_reason == "length"


@pytest.mark.parametrize(
    ("payload", "several"),
    [
        ({"messages": []}, False),
        ({"messages": [], "n": 1}, False),
        ({"messages": [], "n": 2}, True),
        ({"prompt": "x"}, False),
        ({"prompt": ["x"]}, False),
        ({"prompt": ["x", "y"]}, True),
        ({"prompt": [1, 2, 3]}, False),  # token ids: one prompt
        ({"prompt": [[1], [2]]}, True),
        ({"prompt_embeds": "AAAA"}, False),
        ({"prompt_embeds": ["AAAA"]}, False),
        ({"prompt_embeds": ["AAAA", "BBBB"]}, True),  # timed as one before
    ],
)
def test_which_requests_may_stream_several_sequences(payload: dict, several: bool) -> None:
    assert several_sequences(payload) is several
