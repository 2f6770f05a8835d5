"""Three ways the meter mis-measured ITL, through a real gateway and in the meter alone.

1. The backend's window counted one ITL value per *event* while the record and the
   histogram count one per *token*: with several tokens an event (vLLM's
   ``--stream-interval``, speculative decoding) the controller saw ITL k times too long.
2. Tokens the client never saw streamed (vLLM's ``include_reasoning: false``; SGLang's
   ``stream_reasoning: false`` sends the reasoning as one first event) were spread over
   the visible gaps: ITL read up to 20 times too short.
3. ``n`` spelled ``"2"`` or ``2.0`` (vLLM reads both as 2) was metered as one sequence:
   the wrong finish reason, gaps measured across the sequences.

Timing assertions leave a loaded machine room: a scripted pause may run long, never
short, and the bounds sit between the right value and the wrong one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.meter import StreamMeter
from gateway.proxy_request import several_sequences
from tests.procs import Gateway, Proc, served, start_gateway, start_raw_sse
from tests.raw_sse_backend import MODEL
from tests.test_proxy_wire import new_id, record_of

SSE_HEAD = (
    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
CHAT = "/v1/chat/completions"


def event(**fields: Any) -> bytes:
    payload = {"id": "c1", "object": "chat.completion.chunk", "model": MODEL, **fields}
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def delta(index: int = 0, finish: str | None = None, **change: str) -> bytes:
    choice = {"index": index, "delta": change, "logprobs": None, "finish_reason": finish}
    return event(choices=[choice])


def usage(completion: int, **extra: Any) -> bytes:
    counts = {"prompt_tokens": 5, "completion_tokens": completion, **extra}
    return event(choices=[], usage=counts)


DONE = b"data: [DONE]\n\n"


def script(*steps: bytes | float | str) -> list[list[Any]]:
    """Events, each an HTTP chunk of its own; a number is a pause, ``"poke"`` a wait
    for ``GET /poke``."""
    out: list[list[Any]] = [["send", SSE_HEAD]]
    for step in steps:
        if step == "poke":
            out.append(["await_poke"])
        elif isinstance(step, float | int):
            out.append(["pause", step])
        else:
            assert isinstance(step, bytes)
            out.append(["send", (b"%x\r\n%s\r\n" % (len(step), step)).decode("latin-1")])
    out.append(["send", "0\r\n\r\n"])
    return out


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    yield from served(start_raw_sse(tmp_path_factory.mktemp("meter-fixes")))


@pytest.fixture
def gw(tmp_path: Path, raw: Proc) -> Iterator[Gateway]:
    """A gateway of its own per test: a backend window nothing else has fed."""
    config = {
        "backends": [{"name": "raw", "url": raw.url, "pool": "short", "models": [MODEL]}],
        "health": {"interval_s": 30, "failure_threshold": 1000},
        "upstream": {"read_timeout_s": 10, "max_attempts": 1},
    }
    gateway = start_gateway(tmp_path, config)
    try:
        yield gateway
    finally:
        gateway.proc.stop()


def streamed(
    gw: Gateway,
    steps: list[list[Any]],
    poke: tuple[Proc, bytes, list[dict[str, Any]]] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """The record of a streamed request answered by ``steps``. ``poke``: (backend, bytes,
    out): once the client got those bytes, the window is read into ``out`` and the
    backend poked to go on."""
    request_id = new_id("meterfix")
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    request.update(raw_script=steps, **fields)
    data = b""
    with httpx.stream(
        "POST", gw.url + CHAT, json=request, headers={"x-request-id": request_id}, timeout=20
    ) as response:
        assert response.status_code == 200
        for part in response.iter_raw():
            data += part
            if poke is not None and poke[1] in data:
                poke[2].append(window_of(gw))
                assert httpx.get(poke[0].url + "/poke", timeout=5).status_code == 200
                poke = None
    return record_of(gw, request_id)


def window_of(gw: Gateway) -> dict[str, Any]:
    (backend,) = gw.state()["backends"]
    return backend["window"]


# --- 1. the window counts per token, as the record does --------------------------


def interval_stream(events: int, tail: list[bytes | float | str] | None = None) -> list[Any]:
    """vLLM's ``--stream-interval 4``: the first token alone, then 4 tokens an event, 40 ms
    apart (10 ms a token); ``tail``: steps before the end."""
    steps: list[bytes | float | str] = [delta(role="assistant", content=""), 0.05]
    steps += [delta(content="a"), 0.04]
    for _ in range(events - 1):
        steps += [delta(content="abcd"), 0.04]
    tail = tail or []
    steps += tail
    outputs = events + sum(isinstance(step, bytes) for step in tail)  # 4 tokens each
    steps += [delta(finish="length", content=""), usage(1 + 4 * (outputs - 1)), DONE]
    return script(*steps)


def test_the_window_sees_the_records_per_token_itl(gw: Gateway) -> None:
    """Before the fix the window held 9 values of ~40 ms (one per event) while the record
    held 36 of ~10 ms. The stream outlasts a live flush (0.25 s), so the estimate made
    while it ran (one token an event: nothing learned yet) must have been corrected."""
    record = streamed(gw, interval_stream(10))
    assert record["itl_count"] == 36
    window = window_of(gw)
    assert window["itl_samples"] == 36
    assert window["itl_p50"] < 0.025  # per event: >= 0.040


def test_a_running_stream_is_fed_per_token_once_the_backend_is_known(
    gw: Gateway, raw: Proc
) -> None:
    """After one stream the window has learned 4 tokens an event: a second stream,
    read while it still runs (its gaps in the window only through live flushes), shows
    per-token ITL. Without the learned ratio its many per-event values (~40 ms) would be
    the window's p95."""
    streamed(gw, interval_stream(3))  # 2 gaps, 8 values
    mark = delta(content="MARK")
    seen: list[dict[str, Any]] = []
    record = streamed(gw, interval_stream(15, [mark, "poke"]), poke=(raw, b"MARK", seen))
    (live,) = seen
    assert live["itl_samples"] >= 8 + 4 * 5  # at least one live flush of this stream
    assert live["itl_samples"] % 4 == 0  # each gap spread over 4 tokens
    assert live["itl_p95"] < 0.025
    assert record["itl_count"] == 4 * 15  # 16 output events: 15 gaps of 4 tokens
    assert window_of(gw)["itl_samples"] == 8 + 60


# --- 2. reasoning that was not streamed belongs to the TTFT ----------------------


def test_reasoning_vllm_did_not_stream_is_left_out_of_the_gaps(gw: Gateway) -> None:
    """vLLM, ``include_reasoning: false``: 200 reasoning tokens, never sent, then 10 content
    tokens 20 ms apart. Before the fix 189 values of ~1 ms; now 9 of ~20 ms."""
    steps: list[bytes | float] = [delta(role="assistant", content=""), 0.3]
    for _ in range(10):
        steps += [delta(content="w"), 0.02]
    details = {"completion_tokens_details": {"reasoning_tokens": 200}}
    steps += [delta(finish="stop", content=""), usage(211, **details), DONE]
    record = streamed(gw, script(*steps), include_reasoning=False)
    assert record["itl_count"] == 9
    assert record["itl_mean_s"] > 0.015
    assert record["ttft_s"] > 0.3
    assert window_of(gw)["itl_samples"] == 9


def test_reasoning_sglang_sent_in_one_block_is_left_out_of_the_gaps(gw: Gateway) -> None:
    """SGLang, ``stream_reasoning: false``: the reasoning arrives as one first event, then
    content a token an event. Before the fix 190 values of ~1 ms; now 10 of ~20 ms (the
    first from the block to the first content token)."""
    steps: list[bytes | float] = [delta(role="assistant", content=""), 0.2]
    steps += [delta(reasoning_content="thought " * 200), 0.02]
    for _ in range(10):
        steps += [delta(content="w"), 0.02]
    steps += [delta(finish="stop", content=""), usage(210, reasoning_tokens=200), DONE]
    record = streamed(gw, script(*steps), separate_reasoning=True)
    assert record["itl_count"] == 10
    assert record["itl_mean_s"] > 0.015


# --- 3. n as the engine reads it -------------------------------------------------


@pytest.mark.parametrize("n", [2, "2", 2.0], ids=["int", "string", "float"])
def test_n_in_any_spelling_vllm_reads_is_metered_per_sequence(gw: Gateway, n: Any) -> None:
    """Two sequences, 100 ms a token each, 10 ms apart; the second stops first with
    ``length``, the first with ``stop``. Read as one sequence (before the fix, for "2"
    and 2.0): finish ``length``, gaps of 10 and 90 ms."""
    steps: list[bytes | float] = [delta(0, role="assistant"), delta(1, role="assistant"), 0.1]
    for _ in range(4):
        steps += [delta(0, content="a"), 0.01, delta(1, content="b"), 0.09]
    steps += [delta(1, "length", content=""), 0.05, delta(0, "stop", content="")]
    steps += [usage(8), DONE]
    record = streamed(gw, script(*steps), n=n)
    assert record["finish_reason"] == "stop"
    assert record["itl_count"] == 6
    assert record["itl_mean_s"] > 0.095


@pytest.mark.parametrize(
    ("n", "several"),
    [
        ("2", True),
        (2.0, True),
        (" 3 ", True),
        ("1", False),
        (1.0, False),
        (True, False),
        ("two", False),
        (None, False),
    ],
)
def test_n_is_read_as_a_lax_integer(n: Any, several: bool) -> None:
    assert several_sequences({"messages": [], "n": n}) is several


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fed(timeline: list[tuple[float, bytes]], **fields: Any) -> StreamMeter:
    clock = Clock()
    meter = StreamMeter(started=0.0, clock=clock, **fields)
    for at, item in timeline:
        clock.now = at
        meter.observe([item])
    return meter


def test_a_second_sequence_the_request_did_not_announce_is_told_apart() -> None:
    """Whatever ``n`` the gateway read, a second sequence's event switches the meter to
    per-sequence timing (gaps and finish reason)."""
    timeline = [(0.1 + 0.1 * k + 0.01 * i, delta(i, content="x")) for k in range(4) for i in (0, 1)]
    timeline += [(0.6, delta(1, "length")), (0.7, delta(0, "stop"))]
    meter = fed(timeline)
    assert meter.several_sequences
    assert meter.gaps == pytest.approx([0.1] * 6)
    assert meter.finish_reason == "stop"


def test_a_second_sequence_that_only_finishes_does_not_set_the_reason() -> None:
    timeline = [(0.1 * k, delta(0, content="x")) for k in (1, 2, 3)]
    timeline += [(0.35, delta(1, "length")), (0.4, delta(0, "stop"))]
    assert fed(timeline).finish_reason == "stop"


def test_one_sequence_takes_the_fast_path_after_its_second_event() -> None:
    meter = fed([(0.1 * k, delta(0, content="x")) for k in (1, 2, 3, 4)])
    assert meter.plain and not meter.several_sequences and meter.last_by_sequence is None
    assert meter.gaps == pytest.approx([0.1] * 3)


# --- an error event's code in digits no integer reads ------------------------------


@pytest.mark.parametrize(
    "code", ["\u00b2", "\uff11\uff12", "9" * 5000], ids=["superscript", "fullwidth", "5000-digits"]
)
def test_an_error_code_of_odd_digits_is_relayed_and_judged_by_its_type(
    gw: Gateway, code: str
) -> None:
    """``str.isdigit`` takes "²" and fullwidth digits, which ``int`` refuses or reads as
    12, and ``int`` refuses 5,000 digits: the meter read such a code as a status and broke
    the stream. It is judged by its type, as a code that is no number is."""
    body = {"error": {"message": "no", "type": "BadRequestError", "param": None, "code": code}}
    error = b"data: " + json.dumps(body).encode() + b"\n\n"  # as vLLM sends one
    steps = script(delta(role="assistant", content=""), delta(content="a"), error, DONE)
    record = streamed(gw, steps)
    assert record["status"] == "client_error"  # BadRequestError: the request's fault
