"""An SSE event over the relay's held limit (vLLM ``echo`` with ``logprobs: 20`` on a
2,000-token prompt sends a first event of ~1.5 MB): it goes out as it comes, and framing
resumes at its blank line.

Before the fix the relay stopped framing for the rest of the stream: the usage chunk the
gateway asked for itself reached a client that never asked for it (``choices: []``, and
``chunk.choices[0]`` raised IndexError), and the stream's tokens, gaps and finish reason
were lost to the metrics.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.relay import MAX_HELD_EVENT_BYTES
from gateway.sse import RELEASED_KEPT_BYTES, SSEFramer
from tests.procs import (
    Gateway,
    Proc,
    scripted_config,
    served,
    served_gateway,
    start_raw_sse,
)
from tests.test_proxy_wire import metric_sum
from tests.test_relay_edge_cases import (
    DONE,
    LAST_CHUNK,
    SSE_HEAD,
    chunks,
    delta,
    relayed,
    usage,
)

READ = 65536
TAIL_MARK = b"end-of-the-long-event"


def long_delta(content: str, finish: str | None = None, line_end: bytes = b"\n") -> bytes:
    """A chat chunk over the held limit: its output up front, then logprobs (the bulk), then
    the finish reason, where engines put them."""
    top = [{"token": f"t{i}", "logprob": -1.5} for i in range(20)]
    logprobs = {"content": [{"token": "x", "logprob": -0.1, "top_logprobs": top}] * 2400}
    filler = {"index": 0, "delta": {"content": content}, "logprobs": logprobs}
    payload = {"choices": [{**filler, "mark": TAIL_MARK.decode(), "finish_reason": finish}]}
    line = b"data: " + json.dumps(payload, separators=(",", ":")).encode()
    assert len(line) > MAX_HELD_EVENT_BYTES * 1.3
    return line + line_end + line_end


def in_reads(data: bytes) -> list[list[Any]]:
    return chunks(*(data[at : at + READ] for at in range(0, len(data), READ)))


def completion_tokens(gw: Gateway) -> float:
    return metric_sum(gw.url, "kneecap_completion_tokens_total", backend="raw")


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("oversize")


@pytest.fixture(scope="module")
def raw(module_tmp: Path) -> Iterator[Proc]:
    yield from served(start_raw_sse(module_tmp))


@pytest.fixture(scope="module")
def gw(module_tmp: Path, raw: Proc) -> Iterator[Gateway]:
    yield from served_gateway(module_tmp, scripted_config(raw))


def test_after_an_oversize_event_the_usage_chunk_is_still_stripped_and_counted(
    gw: Gateway, raw: Proc
) -> None:
    """The finding: a client that did not ask for usage gets exactly the backend's events
    less the usage chunk, and the gateway counts the stream's tokens and its gaps across
    the oversize event (an output event: it carries content)."""
    big = long_delta("big ")
    after = [delta("two "), delta("", "stop"), usage(7, 3), DONE]
    script = [
        ["send", SSE_HEAD],
        *chunks(delta(role=True), delta("one ")),
        *in_reads(big[:-1]),
        ["await_poke"],  # the client has the event's bytes before its blank line is sent
        *chunks(big[-1:] + b"".join(after)),  # its end and the rest in one read
        ["send", LAST_CHUNK],
    ]
    before = completion_tokens(gw)
    data, record = relayed(gw, script, poke=(raw, TAIL_MARK))
    sent = [delta(role=True), delta("one "), big, *after]
    assert data == b"".join(part for part in sent if part != usage(7, 3))
    assert (record["prompt_tokens"], record["completion_tokens"]) == (7, 3)
    assert completion_tokens(gw) - before == 3
    # "one ", the long event and "two ": three output events, two gaps.
    assert record["itl_count"] == 2
    assert (record["status"], record["finish_reason"]) == ("ok", "stop")


@pytest.mark.parametrize("line_end", [b"\n", b"\r\n"], ids=["lf", "crlf"])
def test_an_oversize_first_event_times_the_stream_and_gives_its_finish_reason(
    gw: Gateway, raw: Proc, line_end: bytes
) -> None:
    """The long event is the answer's first output and its last (max_tokens reached): it is
    the TTFT, its finish reason (after the logprobs) is read, and the blank line that ends
    it, cut in two by a read, is found all the same."""
    big = long_delta("echoed prompt", "length", line_end)
    tail = [usage(2000, 1).replace(b"\n", line_end), DONE.replace(b"\n", line_end)]
    script = [
        ["send", SSE_HEAD],
        *in_reads(big[: -len(line_end) - 1]),
        ["await_poke"],
        *chunks(big[-len(line_end) - 1 :]),
        *chunks(*tail),
        ["send", LAST_CHUNK],
    ]
    data, record = relayed(gw, script, poke=(raw, TAIL_MARK))
    assert data == big + tail[1]
    assert (record["prompt_tokens"], record["completion_tokens"]) == (2000, 1)
    assert record["ttft_s"] is not None
    assert (record["status"], record["finish_reason"]) == ("ok", "length")


def test_an_oversize_event_the_body_ends_inside_is_still_measured(gw: Gateway) -> None:
    """A backend that ends its body inside the long event: what went out is the client's,
    and the event is read as an event the close cut short is."""
    big = long_delta("only", "stop")[:-2]
    script = [["send", SSE_HEAD], *in_reads(big), ["send", LAST_CHUNK]]
    data, record = relayed(gw, script)
    assert data == big
    assert record["ttft_s"] is not None and record["finish_reason"] == "stop"


def test_a_stream_that_asked_for_usage_gets_every_byte(gw: Gateway) -> None:
    """Nothing is stripped for a client that asked; the long event is whole too."""
    big = long_delta("big ")
    stream = [delta(role=True), big, delta("", "stop"), usage(), DONE]
    script = [["send", SSE_HEAD], *in_reads(b"".join(stream)), ["send", LAST_CHUNK]]
    data, record = relayed(gw, script, asked=True)
    assert data == b"".join(stream)
    assert (record["prompt_tokens"], record["completion_tokens"]) == (7, 3)


# --- the framer, on its own -------------------------------------------------------


def _events(rng: random.Random) -> list[bytes]:
    """Events of one line-end style each, as engines send them, some of them long."""
    events = []
    for number in range(12):
        end = rng.choice([b"\n", b"\r\n", b"\r"])
        size = rng.choice([5, 40, 3000])
        events.append(b"data: %d %s%s%s" % (number, b"x" * size, end, end))
    return events


@pytest.mark.parametrize("seed", range(300))
def test_a_released_event_ends_at_its_blank_line_whatever_the_reads(seed: int) -> None:
    """An event released half read ends at its own blank line (one a read cut in two too);
    the bytes out are the bytes in, and the events after it are framed again."""
    rng = random.Random(seed)
    events = _events(rng)
    stream = b"".join(events)
    released = rng.randrange(len(events) - 1)
    start = sum(map(len, events[:released]))
    end_of_released = start + len(events[released])
    cut = rng.randrange(start + 1, end_of_released)  # released once this much is read
    # A read ending inside the blank line, one time in two.
    inside = (
        [end_of_released - rng.randrange(1, 4)] if seed % 2 and cut < end_of_released - 3 else []
    )
    reads = sorted({cut, *inside, *rng.sample(range(1, len(stream)), 40), len(stream)})
    framer = SSEFramer()
    out: list[bytes] = []
    framed: list[bytes] = []
    passing = False
    for begin, end in zip([0, *reads], reads, strict=False):
        chunk = stream[begin:end]
        if passing:
            at = framer.end_of_released(chunk)
            if at < 0:
                out.append(chunk)
                continue
            out.append(chunk[:at])
            assert begin + at == end_of_released
            passing, chunk = False, chunk[at:]
        whole, found = framer.feed(chunk)
        out.append(whole)
        framed += found
        if end == cut:
            assert framer.pending and len(framed) == released
            out.append(framer.release_pending())
            passing = True
    out.append(framer.pending)
    assert not passing
    assert b"".join(out) == stream
    numbers = [int(found.split()[1]) for found in framed if found.strip()]
    assert numbers == [n for n in range(len(events)) if n != released]


def test_a_released_event_ending_a_read_in_cr_leaves_the_next_event_whole() -> None:
    """A released event whose blank line is ``\\r\\r`` at the end of a read, and a next read
    opening with ``\\n``: that ``\\n`` ends a line of the released event, and the next event
    still starts with its field name (else its ``[DONE]`` would not be seen)."""
    framer = SSEFramer()
    assert framer.feed(b"data: " + b"x" * 100) == (b"", [])
    assert framer.release_pending().startswith(b"data: x")
    assert framer.end_of_released(b"xx\r") == -1
    assert framer.end_of_released(b"\r") == 1
    _, events = framer.feed(b"\ndata: [DONE]\r\r")
    assert [event for event in events if event.startswith(b"data: [DONE]")], events


def test_a_released_event_is_read_by_its_first_and_last_bytes() -> None:
    """The meter reads the released event's start (its output) and its end (finish reason),
    not the bulk in between, whatever the reads it came in."""
    framer = SSEFramer()
    head = b'data: {"choices":[{"index":0,"text":"big"'
    bulk = b',"logprobs":"' + b"y" * (4 * RELEASED_KEPT_BYTES) + b'"'
    end = b',"finish_reason":"length"}]}\n\n'
    held = 2 * RELEASED_KEPT_BYTES
    framer.feed(head + bulk[:held])
    framer.release_pending()
    rest = bulk[held:] + end
    within, last = rest[:-40], rest[-40:]
    for at in range(0, len(within), 50_000):
        assert framer.end_of_released(within[at : at + 50_000]) == -1
    assert framer.end_of_released(last + b"data: next\n\n") == len(last)
    seen = framer.released_event()
    assert seen.startswith(head) and seen.endswith(end)
    assert len(seen) == 2 * RELEASED_KEPT_BYTES + 1
