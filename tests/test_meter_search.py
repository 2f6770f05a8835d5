"""The SSE event classifiers' byte searches agree with the regular expressions defining them."""

from __future__ import annotations

import random

import pytest

from gateway import sse_events as sse
from gateway.meter import StreamMeter, Usage

FRAGMENTS = [
    b'"content"', b'"reasoning_content"', b'"reasoning"', b'"text"', b'"tool_calls"',
    b'"finish_reason"', b'"choices"', b'"usage"', b":", b'"', b" ", b"\t", b"\n", b"[", b"]",
    b"{", b"}", b"null", b"stop", b"length", b"x", b'""', b'":"', b'",', b"data: ", b'\\"',
    b'"content"content"', b"_", b"error", b'"error"', b"event: error", b"data:", b"\r",
]  # fmt: skip


def _events(count: int) -> list[bytes]:
    rng = random.Random(4)
    return [
        b"".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 14))) for _ in range(count)
    ]


@pytest.mark.parametrize(
    ("event", "output", "finish", "usage"),
    [
        (b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}', False, None, False),
        (b'data: {"choices":[{"delta":{"content":"a"},"finish_reason":null}]}', True, None, False),
        (b'data: {"choices":[{"delta":{"content":"."},"finish_reason":"length"}]}', True, "length",
         False),
        (b'data: {"choices": [{"delta": {"content": "a"}, "finish_reason": "stop"}]}', True, "stop",
         False),
        (b'data: {"choices":[{"delta":{"tool_calls":[{"id":"1"}]}}]}', True, None, False),
        (b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}', False, None,
         True),
        (b'data: {"choices": [ ], "usage": {"prompt_tokens": 1}}', False, None, True),
        (b'data: {"choices":[],"usage":null,"prompt_filter_results":[]}', False, None, False),
        (b"data: [DONE]", False, None, False),
    ],
)  # fmt: skip
def test_known_events(event: bytes, output: bool, finish: str | None, usage: bool) -> None:
    assert sse.carries_output(event) is output
    assert sse.finish_reason_of(event) == finish
    assert sse.is_usage_chunk(event) is usage


def test_byte_search_matches_the_regular_expressions() -> None:
    for event in _events(10_000):
        assert sse.carries_output(event) == bool(sse._OUTPUT.search(event)), event
        found = sse._FINISH.search(event)
        assert sse.finish_reason_of(event) == (found.group(1).decode() if found else None), event
        usage = sse._USAGE_OBJECT.search(event) and sse._USAGE_CHUNK.search(event)
        assert sse.is_usage_chunk(event) == bool(usage), event
        assert sse.is_error_event(event) == bool(sse._ERROR_EVENT.search(event)), event


@pytest.mark.parametrize(
    "event",
    [
        b'data: {"error": {"message": "x"}}',
        b'data:{"error":{"message":"x"}}',
        b'data: { "error" : {"message": "x"}}',
        b'event: error\ndata: {"message": "x"}',
        b'id: 4\r\nevent: error\r\ndata: {"message": "x"}\r\n\r\n',
    ],
)
def test_error_events_in_any_spelling(event: bytes) -> None:
    assert sse.is_error_event(event)


@pytest.mark.parametrize(
    "event",
    [
        b'data: {"choices":[{"delta":{"content":"error"}}]}',
        b'data: {"object":"chat.completion.chunk","error_count":0}',
        b"event: errors\ndata: {}",
    ],
)
def test_events_that_merely_mention_errors(event: bytes) -> None:
    assert not sse.is_error_event(event)


@pytest.mark.parametrize(
    ("gaps", "events", "completion", "empty_stop", "count"),
    [
        ([0.1, 0.1], 3, 3, False, 2),  # one token an event: the gaps as they are
        ([0.1, 0.1], 3, 4, True, 2),  # vLLM's EOS, in its empty last chunk: no gap's token
        ([0.1, 0.2, 0.3], 4, 10, False, 9),  # the first token alone, then three an event
        ([0.3], 2, 6, False, 5),  # the first alone, then five in one event
        ([0.04, 0.04], 3, 9, False, 8),  # --stream-interval 4: 1, then 4 and 4 (10 ms each)
    ],
)
def test_token_gaps_add_up_to_the_time_between_output_events(
    gaps: list[float], events: int, completion: int, empty_stop: bool, count: int
) -> None:
    """The first output event carries one token (vLLM sends the first alone, whatever its
    --stream-interval); the gaps carry the rest. Spread over every event instead, a first
    event of one token and events of four read as 13.5 ms gaps where they were 10."""
    measured = StreamMeter(started=0.0, gaps=gaps, output_events=events)
    measured.usage = Usage(prompt_tokens=1, completion_tokens=completion)
    if empty_stop:
        measured.finish_reason, measured.finish_empty = "stop", True
    spread = measured.token_gaps()
    assert len(spread) == count
    assert sum(spread) == pytest.approx(sum(gaps))
    per_gap = -(-count // len(gaps))
    assert min(spread) >= min(gaps) / per_gap - 1e-12  # none cut finer than its tokens
