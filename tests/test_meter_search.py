"""The meter's byte-search classifiers agree with the regular expressions that define them."""

from __future__ import annotations

import random

import pytest

from gateway import meter

FRAGMENTS = [
    b'"content"', b'"reasoning_content"', b'"reasoning"', b'"text"', b'"tool_calls"',
    b'"finish_reason"', b'"choices"', b'"usage"', b":", b'"', b" ", b"\t", b"\n", b"[", b"]",
    b"{", b"}", b"null", b"stop", b"length", b"x", b'""', b'":"', b'",', b"data: ", b'\\"',
    b'"content"content"', b"_",
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
        (b"data: [DONE]", False, None, False),
    ],
)  # fmt: skip
def test_known_events(event: bytes, output: bool, finish: str | None, usage: bool) -> None:
    assert meter.carries_output(event) is output
    assert meter.finish_reason_of(event) == finish
    assert meter.is_usage_chunk(event) is usage


def test_byte_search_matches_the_regular_expressions() -> None:
    for event in _events(10_000):
        assert meter.carries_output(event) == bool(meter._OUTPUT.search(event)), event
        found = meter._FINISH.search(event)
        assert meter.finish_reason_of(event) == (found.group(1).decode() if found else None), event
        usage = b'"usage"' in event and meter._USAGE_CHUNK.search(event) is not None
        assert meter.is_usage_chunk(event) == usage, event
