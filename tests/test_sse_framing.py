"""SSEFramer over arbitrary reads: the events and bytes are those of the whole stream
read at once, whichever reads an event's blank line, or a long event, is cut across."""

from __future__ import annotations

import random

import pytest

from gateway.sse import SSEFramer

LINE_ENDS = [b"\n", b"\r\n", b"\r"]


def _stream(rng: random.Random) -> tuple[bytes, int]:
    """Events with mixed line ends, some long enough to span many reads."""
    events = []
    for number in range(rng.randrange(3, 15)):
        end = rng.choice(LINE_ENDS)
        size = rng.choice([1, 7, 300, 5000, 40_000])
        events.append(b"data: %d %s%s%s" % (number, b"y" * size, end, end))
    return b"".join(events), len(events)


def _frame(stream: bytes, reads: list[int]) -> tuple[list[bytes], bytes]:
    framer = SSEFramer()
    framed: list[bytes] = []
    out: list[bytes] = []
    for begin, end in zip([0, *reads], reads, strict=False):
        whole, events = framer.feed(stream[begin:end])
        assert whole == framer.join(events)
        assert framer.pending_size == len(framer.pending)
        framed += events
        out.append(whole)
    out.append(framer.pending)
    return framed, b"".join(out)


@pytest.mark.parametrize("seed", range(120))
def test_events_and_bytes_do_not_depend_on_the_reads(seed: int) -> None:
    rng = random.Random(seed)
    stream, count = _stream(rng)
    at_once, _ = _frame(stream, [len(stream)])
    # Small reads (a blank line cut anywhere in it) and long runs of reads inside one event.
    sizes = [rng.choice([1, 2, 3, 4096]) for _ in range(len(stream))]
    reads, position = [], 0
    for size in sizes:
        position += size
        if position >= len(stream):
            break
        reads.append(position)
    framed, out = _frame(stream, [*reads, len(stream)])
    assert out == stream
    # Events keep their blank line only where a read held a "\r" (see SSEFramer.join), and
    # a lone "\n" completing a "\r" a read cut off is handed on as a piece of its own.
    assert _fields(framed) == _fields(at_once)
    assert len(_fields(framed)) == count


def _fields(events: list[bytes]) -> list[bytes]:
    return [e.rstrip(b"\r\n") for e in events if e.strip(b"\r\n")]


def test_a_long_event_is_held_until_its_blank_line_in_any_number_of_reads() -> None:
    event = b"data: " + b"z" * (1 << 20) + b"\r\n\r\n"
    framer = SSEFramer()
    for begin in range(0, len(event) - 4096, 4096):
        assert framer.feed(event[begin : begin + 4096]) == (b"", [])
    whole, events = framer.feed(event[begin + 4096 :])
    assert events == [event] and whole == event
    assert framer.pending_size == 0
