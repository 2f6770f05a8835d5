"""What a backend may legally (or half-legally) send, relayed and measured right.

A real gateway in front of :mod:`tests.raw_sse_backend`, whose every answer is the
script its request carries: line ends other than ``\\n``, events cut by a close or a
reset, error events in other spellings, usage chunks where engines put them, a
whole answer that stalls. "Strip mode": the client did not ask for usage, so the
gateway asked for it and must take its usage chunk out; "asked mode": the client
asked, and the bytes go through as they are.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.relay import MAX_HELD_EVENT_BYTES
from tests.procs import (
    Gateway,
    Proc,
    scripted_config,
    served,
    served_gateway,
    start_gateway,
    start_raw_sse,
    wait_until,
)
from tests.raw_sse_backend import MODEL
from tests.test_proxy_wire import idle, metric_sum, new_id, record_of, records

SSE_HEAD = (
    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
CLOSE_DELIMITED_HEAD = (
    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
)
LAST_CHUNK = "0\r\n\r\n"
DONE = b"data: [DONE]\n\n"
CHAT = "/v1/chat/completions"


def event(**fields: Any) -> bytes:
    payload = {"id": "c1", "object": "chat.completion.chunk", "model": MODEL, **fields}
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def delta(content: str | None = None, finish: str | None = None, role: bool = False) -> bytes:
    change: dict[str, str] = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        change["content"] = content
    return event(choices=[{"index": 0, "delta": change, "finish_reason": finish}])


def usage(prompt: int = 7, completion: int = 3) -> bytes:
    counts = {"prompt_tokens": prompt, "completion_tokens": completion}
    return event(choices=[], usage={**counts, "total_tokens": prompt + completion})


# Azure's prompt filter results: empty choices, no usage. Not the usage chunk.
NULL_USAGE = event(choices=[], usage=None, prompt_filter_results=[{"prompt_index": 0}])
STREAM = [delta(role=True), delta("one "), delta("two "), delta("three"), delta("", "stop")]


def send(data: bytes) -> list[str]:
    return ["send", data.decode("latin-1")]


def chunks(*pieces: bytes) -> list[list[Any]]:
    """Each piece as one HTTP chunk, in a write of its own."""
    return [send(b"%x\r\n%s\r\n" % (len(piece), piece)) for piece in pieces]


def chunked_stream(*pieces: bytes) -> list[list[Any]]:
    return [["send", SSE_HEAD], *chunks(*pieces), ["send", LAST_CHUNK]]


# --- fixtures ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("edges")


@pytest.fixture(scope="module")
def raw(module_tmp: Path) -> Iterator[Proc]:
    yield from served(start_raw_sse(module_tmp))


@pytest.fixture(scope="module")
def gw(module_tmp: Path, raw: Proc) -> Iterator[Gateway]:
    yield from served_gateway(module_tmp, scripted_config(raw, read_timeout_s=1))


def body(script: list[list[Any]], stream: bool = True, asked: bool = False) -> dict[str, Any]:
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "raw_script": script,
    }
    if asked:
        request["stream_options"] = {"include_usage": True}
    return request


def relayed(
    gw: Gateway,
    script: list[list[Any]],
    asked: bool = False,
    poke: tuple[Proc, bytes] | None = None,
    *,
    request_id: str | None = None,
    got: bytearray | None = None,
) -> tuple[bytes, dict]:
    """What the client got of a streamed answer to ``script``, and the request's record.

    ``poke``: (backend, bytes): the backend is poked once the client got those bytes.
    ``got``: where the bytes also go as they come, for a stream that ends in an error."""
    request_id = request_id or new_id("edge")
    data = got if got is not None else bytearray()
    with httpx.stream(
        "POST",
        gw.url + CHAT,
        json=body(script, asked=asked),
        headers={"x-request-id": request_id},
        timeout=10,
    ) as response:
        assert response.status_code == 200
        for part in response.iter_raw():
            data += part
            if poke is not None and poke[1] in data:
                assert httpx.get(poke[0].url + "/poke", timeout=5).status_code == 200
                poke = None
    return bytes(data), record_of(gw, request_id)


def events_of(data: bytes) -> list[bytes]:
    assert data.endswith(b"\n\n"), data[-80:]
    return data[:-2].split(b"\n\n")


# --- an event cut short, then the gateway's error event ---------------------------


@pytest.mark.parametrize("asked", [True, False], ids=["asked", "strip"])
@pytest.mark.parametrize("cut", [40, -1], ids=["mid-line", "before-blank-line"])
def test_error_event_after_an_event_cut_short_is_an_event_of_its_own(
    gw: Gateway, asked: bool, cut: int
) -> None:
    """The backend closes in the middle of an event. The client must get the whole
    events before it and then the gateway's error event, clean: glued onto the half
    event (as in asked mode before the fix), the SDK got one invalid JSON line."""
    whole = STREAM[:3]
    script = [["send", SSE_HEAD], *chunks(*whole, STREAM[3][:cut]), ["close"]]
    data, record = relayed(gw, script, asked)
    events = events_of(data)
    assert b"".join(event + b"\n\n" for event in events[:-1]) == b"".join(whole)
    error = json.loads(events[-1].removeprefix(b"data: "))
    assert error["error"]["code"] == "upstream_error"
    assert record["status"] == "upstream_error"


# --- line ends, and bytes that are not SSE at all ---------------------------------


def _with_line_end(data: bytes, line_end: bytes) -> bytes:
    return data.replace(b"\n", line_end)


def _in_two(pieces: list[bytes]) -> list[bytes]:
    """Each piece cut before its last byte: a read ending between two line-end bytes."""
    return [half for piece in pieces for half in (piece[:-1], piece[-1:])]


@pytest.mark.parametrize("asked", [True, False], ids=["asked", "strip"])
@pytest.mark.parametrize("split", [False, True], ids=["whole-reads", "split-line-ends"])
@pytest.mark.parametrize("line_end", [b"\r\n", b"\r"], ids=["crlf", "cr"])
def test_any_line_end_is_framed_and_relayed_byte_for_byte(
    gw: Gateway, asked: bool, split: bool, line_end: bytes
) -> None:
    """SSE ends lines with CRLF, LF or CR. The client gets the backend's own bytes
    (before the fix, strip mode turned CRLF into LF, and never found a CR-only event:
    the usage chunk reached the client), less the usage chunk in strip mode, and the
    stream is measured."""
    pieces = [_with_line_end(p, line_end) for p in [*STREAM, usage(), DONE]]
    data, record = relayed(gw, chunked_stream(*(_in_two(pieces) if split else pieces)), asked)
    expected = pieces if asked else [p for p in pieces if b'"usage"' not in p]
    assert data == b"".join(expected)
    assert (record["prompt_tokens"], record["completion_tokens"]) == (7, 3)
    assert record["finish_reason"] == "stop" and record["ttft_s"] is not None
    assert record["status"] == "ok"


def test_a_body_that_is_no_sse_is_relayed_byte_for_byte(gw: Gateway) -> None:
    """Bytes with ``\\r\\n`` and ``\\n\\n`` that are no events (a backend that compresses
    anyway): before the fix, strip mode dropped every ``\\r`` of a CRLF."""
    rng = random.Random(5)
    noise = rng.randbytes(3000) + b"\r\n\r\n\n\n\r\r" + rng.randbytes(500)
    data, record = relayed(gw, chunked_stream(noise[:1700], noise[1700:]))
    assert data == noise
    assert record["status"] == "ok"


def test_an_answer_that_is_no_sse_streams_as_it_comes(gw: Gateway, raw: Proc) -> None:
    """NDJSON (or any stream that says it is no SSE) has no blank lines: held back as an
    unfinished event, nothing reached the client before the backend ended its body."""
    head = "HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
    first, second = b'{"line": 1}\n', b'{"line": 2}\n'
    script = [
        ["send", head + "transfer-encoding: chunked\r\n\r\n"],
        *chunks(first),
        ["await_poke"],  # until the client has the first line: streamed, not held
        *chunks(second),
        ["send", LAST_CHUNK],
    ]
    data, record = relayed(gw, script, poke=(raw, b'"line": 1'))
    assert data == first + second
    assert record["status"] == "ok"


# --- a close-delimited body cut by a reset ----------------------------------------


def test_a_close_delimited_stream_cut_by_a_reset_is_an_upstream_error(
    gw: Gateway, raw: Proc
) -> None:
    """An answer delimited by the close ends cleanly with a FIN, not with a reset: that
    is a stream cut short, to be told to the client and recorded as the backend's
    failure (before the fix: a silently truncated stream, recorded ok)."""
    script = [
        ["send", CLOSE_DELIMITED_HEAD],
        send(STREAM[0] + STREAM[1]),
        ["await_poke"],
        ["reset"],
    ]
    # The poke comes once the client has the events: the gateway has read them.
    data, record = relayed(gw, script, poke=(raw, b'"content":"one "'))
    events = events_of(data)
    assert b"".join(event + b"\n\n" for event in events[:-1]) == STREAM[0] + STREAM[1]
    assert json.loads(events[-1].removeprefix(b"data: "))["error"]["code"] == "upstream_error"
    assert record["status"] == "upstream_error"


def test_a_close_delimited_stream_ended_by_a_fin_is_ok(gw: Gateway) -> None:
    script = [["send", CLOSE_DELIMITED_HEAD], send(b"".join([*STREAM, usage(), DONE])), ["close"]]
    data, record = relayed(gw, script)
    assert data == b"".join([*STREAM, DONE])
    assert record["status"] == "ok" and record["completion_tokens"] == 3


# --- a whole answer that stalls after its first bytes -----------------------------


def test_a_whole_answer_stalling_after_its_first_bytes_is_a_timeout(gw: Gateway) -> None:
    """The stall guard cut it: the client is told 504 upstream_timeout, as for a stall
    before the head, and as the record says (before the fix: 502 bad_gateway)."""
    request_id = new_id("stall")
    head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"
    script = [["send", head + '{"id":'], ["hang"]]
    response = httpx.post(
        gw.url + CHAT,
        json=body(script, stream=False),
        headers={"x-request-id": request_id},
        timeout=10,
    )
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_timeout"
    assert record_of(gw, request_id)["status"] == "upstream_timeout"


def test_a_whole_answer_records_its_finish_reason(gw: Gateway) -> None:
    answer = {
        "id": "c1",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }
    payload = json.dumps(answer)
    head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}"
    request_id = new_id("whole")
    response = httpx.post(
        gw.url + CHAT,
        json=body([["send", head + "\r\n\r\n" + payload]], stream=False),
        headers={"x-request-id": request_id},
        timeout=10,
    )
    assert response.json() == answer
    record = record_of(gw, request_id)
    assert record["finish_reason"] == "length"
    assert (record["prompt_tokens"], record["completion_tokens"]) == (5, 2)


# --- an engine's error event --------------------------------------------------------

ERROR = b'{"error": {"message": "x", "type": "InternalServerError", "code": 500}}'


@pytest.mark.parametrize(
    "error_event",
    [
        b"data: " + ERROR + b"\n\n",
        b"data:" + ERROR + b"\n\n",
        b"event: error\ndata: " + ERROR.replace(b'"error": ', b'"detail": ') + b"\n\n",
        b"data: " + ERROR.replace(b'{"error"', b'{ "error"') + b"\n\n",
        b"data: " + ERROR + b"\r\n\r\n",
    ],
    ids=["canonical", "no-space", "event-type", "space-in-json", "crlf"],
)
def test_an_engine_error_event_in_any_spelling_is_an_upstream_error(
    gw: Gateway, error_event: bytes
) -> None:
    data, record = relayed(gw, chunked_stream(*STREAM[:3], error_event, DONE))
    assert data == b"".join([*STREAM[:3], error_event, DONE])
    assert record["status"] == "upstream_error"


# --- the usage chunk ----------------------------------------------------------------


def _data_lines(event: bytes) -> bytes:
    """The event with its JSON split over two ``data:`` lines (legal SSE)."""
    json_text = event.removeprefix(b"data: ").removesuffix(b"\n\n")
    cut = json_text.index(b',"choices"') + 1
    return b"data: " + json_text[:cut] + b"\ndata: " + json_text[cut:] + b"\n\n"


FINISH_WITH_USAGE = event(
    choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}],
    usage={"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
)
USAGE_CASES = {
    # name: (one upstream write per item, what a client that did not ask must get)
    "unterminated-last": ([*STREAM, usage()[:-2]], STREAM),
    "two-in-one-read": ([*STREAM, usage() + usage(), DONE], [*STREAM, DONE]),
    "then-null-usage": ([*STREAM, usage() + NULL_USAGE, DONE], [*STREAM, NULL_USAGE, DONE]),
    "data-on-two-lines": ([*STREAM, _data_lines(usage()), DONE], [*STREAM, DONE]),
    # Not the usage chunk: it carries the finish, and is forwarded whole.
    "on-the-finish-chunk": (
        [*STREAM[:-1], FINISH_WITH_USAGE, DONE],
        [*STREAM[:-1], FINISH_WITH_USAGE, DONE],
    ),
}


@pytest.mark.parametrize("case", USAGE_CASES)
def test_the_usage_chunk_is_read_and_only_it_is_stripped(gw: Gateway, case: str) -> None:
    """Only the usage chunk is the gateway's (every one of them), never an event with
    ``"usage": null``, whose empty choices made it look like one before the fix; and
    its tokens are read wherever it stands, never erased by such an event."""
    writes, expected = USAGE_CASES[case]
    data, record = relayed(gw, chunked_stream(*writes))
    assert data == b"".join(expected)
    assert (record["prompt_tokens"], record["completion_tokens"]) == (7, 3)


def test_an_event_with_null_usage_read_alone_reaches_the_client(gw: Gateway, raw: Proc) -> None:
    """Read on its own (the usage chunk comes after the client has the stream), so
    that the usage chunk's drop cannot hide it: it is the client's all the same."""
    script = [
        ["send", SSE_HEAD],
        *chunks(NULL_USAGE, *STREAM),
        ["await_poke"],
        *chunks(usage(), DONE),
        ["send", LAST_CHUNK],
    ]
    data, record = relayed(gw, script, poke=(raw, b'"finish_reason":"stop"'))
    assert data == b"".join([NULL_USAGE, *STREAM, DONE])
    assert (record["prompt_tokens"], record["completion_tokens"]) == (7, 3)


# --- an event that never ends -------------------------------------------------------


def test_an_event_past_the_held_limit_is_relayed_before_it_ends(gw: Gateway, raw: Proc) -> None:
    """Only whole events go out, so an event is held until its blank line; one that runs
    past MAX_HELD_EVENT_BYTES is relayed as it comes instead (before the fix: held without
    bound, the client got nothing until it ended, and the gateway's memory grew with it)."""
    big = b'data: {"filler":"' + b"x" * (MAX_HELD_EVENT_BYTES + 512 * 1024)
    big_end = b'"}\n\n'
    script = [
        ["send", SSE_HEAD],
        *chunks(delta(role=True), delta("one ")),
        *chunks(*(big[i : i + 65536] for i in range(0, len(big), 65536))),
        ["await_poke"],  # until the client has the bulk of the unended event
        *chunks(big_end, delta("", "stop"), usage(), DONE),
        ["send", LAST_CHUNK],
    ]
    data, record = relayed(gw, script, asked=True, poke=(raw, b"x" * MAX_HELD_EVENT_BYTES))
    assert data == b"".join([delta(role=True), delta("one "), big, big_end]) + b"".join(
        [delta("", "stop"), usage(), DONE]
    )
    assert record["status"] == "ok"
    assert record["ttft_s"] is not None  # timed up to the event it could not frame


def test_a_failure_after_the_held_limit_still_ends_with_an_error_event_of_its_own(
    gw: Gateway, raw: Proc
) -> None:
    """Relayed unframed, the stream may stop inside an event: the gateway's error event
    must not be glued into it (before: the client's last event was the half-sent one
    with the error's bytes appended, no error event at all)."""
    big = b'data: {"filler":"' + b"x" * (MAX_HELD_EVENT_BYTES + 1024)
    script = [
        ["send", SSE_HEAD],
        *chunks(delta(role=True), delta("one ")),
        *chunks(*(big[i : i + 65536] for i in range(0, len(big), 65536))),
        ["await_poke"],  # until the client has the bulk: the stream went unframed
        ["reset"],
    ]
    data, record = relayed(gw, script, asked=True, poke=(raw, b"x" * MAX_HELD_EVENT_BYTES))
    last = events_of(data)[-1]
    assert last.startswith(b'data: {"error"'), last[:80]
    assert json.loads(last[len(b"data: ") :])["error"]["code"] == "upstream_error"
    assert record["status"] == "upstream_error"


# --- recorded at [DONE] ------------------------------------------------------------


def test_a_stream_is_counted_once_the_client_has_its_done(gw: Gateway, raw: Proc) -> None:
    """The SDK stops reading at [DONE] and may read /metrics at once, while a backend can
    take a while to end its body after it (a real vLLM on a busy CI machine did, and the
    count was not there yet). The request is counted by the time the client has [DONE];
    the backend's permit waits for the body's end."""
    request_id = new_id("done")
    script = [
        ["send", SSE_HEAD],
        *chunks(*STREAM, usage(7, 4), DONE),
        ["await_poke"],
        ["send", LAST_CHUNK],
    ]
    before = metric_sum(gw.url, "kneecap_completion_tokens_total", backend="raw")
    with httpx.stream(
        "POST", gw.url + CHAT, json=body(script), headers={"x-request-id": request_id}, timeout=10
    ) as response:
        parts = response.iter_raw()
        data = b""
        while not data.endswith(DONE):
            data += next(parts)
        counted = metric_sum(gw.url, "kneecap_completion_tokens_total", backend="raw") - before
        listed = [r for r in records(gw) if r["request_id"] == request_id]
        in_flight = {b["name"]: b["in_flight"] for b in gw.state()["backends"]}["raw"]
        assert httpx.get(raw.url + "/poke", timeout=5).status_code == 200
        data += b"".join(parts)
    assert data == b"".join([*STREAM, DONE])
    assert counted == 4
    assert [(r["status"], r["completion_tokens"]) for r in listed] == [("ok", 4)]
    assert in_flight == 1  # held until the body is over
    wait_until(lambda: idle(gw), timeout=10)


# --- inter-token latency ------------------------------------------------------------


def test_inter_token_latencies_add_up_to_the_time_between_output_events(gw: Gateway) -> None:
    """Three one-token events 0.1 s apart and a usage of four tokens (the EOS counted,
    carried by the empty final chunk): the recorded ITLs must add up to the 0.2 s
    between the first and the last output event (before the fix: 0.15 s, each gap cut
    by 4/3 and kept once)."""
    paced = [["pause", 0.1], *chunks(delta("two ")), ["pause", 0.1], *chunks(delta("three"))]
    script = [
        ["send", SSE_HEAD],
        *chunks(delta(role=True), delta("one ")),
        *paced,
        *chunks(delta("", "stop"), usage(7, 4), DONE),
        ["send", LAST_CHUNK],
    ]
    _, record = relayed(gw, script)
    assert record["completion_tokens"] == 4
    assert record["itl_count"] == 2
    assert 0.19 <= record["itl_mean_s"] * record["itl_count"] <= 0.3


# --- the read timeout on a reused upstream connection ----------------------------


def test_a_read_timeout_shortened_by_a_reload_cuts_the_next_stall_in_time(
    tmp_path: Path, raw: Proc
) -> None:
    """The pooled connection's last request ran under a 5 s read timeout; after a reload
    to 0.5 s, a stall on that same connection must be cut at 0.5 s (before the fix: at
    the old 5 s, the timer still armed for it)."""
    config = {
        "backends": [{"name": "raw", "url": raw.url, "pool": "short", "models": [MODEL]}],
        "health": {"interval_s": 30, "failure_threshold": 1000},
        "upstream": {"read_timeout_s": 5, "max_attempts": 1},
    }
    gateway = start_gateway(tmp_path, config)
    try:
        _, record = relayed(gateway, chunked_stream(*STREAM, DONE))
        assert record["status"] == "ok"
        gateway.write_config(
            {**gateway.config, "upstream": {"read_timeout_s": 0.5, "max_attempts": 1}}
        )
        assert httpx.post(gateway.url + "/admin/reload", timeout=5).json()["ok"] is True
        request_id = new_id("stall")
        response = httpx.post(
            gateway.url + CHAT,
            json=body([["hang"]], stream=False),
            headers={"x-request-id": request_id},
            timeout=10,
        )
        assert response.status_code == 504
        assert record_of(gateway, request_id)["e2e_s"] < 2.5
    finally:
        gateway.proc.stop()


def test_nothing_is_left_taken(gw: Gateway) -> None:
    """Whatever the cases above did to their streams, every permit came back."""
    assert idle(gw)


def test_an_answer_that_is_no_sse_cut_mid_body_is_cut_for_the_client_too(gw: Gateway) -> None:
    """NDJSON cut by the backend: the client got an SSE error event appended to its JSON
    lines and a clean end, as if the body were whole. Now its body is cut as the backend's
    was, and the request is the backend's failure."""
    head = "HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
    first = b'{"line": 1}\n'
    script = [["send", head + "transfer-encoding: chunked\r\n\r\n"], *chunks(first), ["reset"]]
    request_id = new_id("edge")
    got = bytearray()
    with pytest.raises(httpx.HTTPError):  # the body did not end: the client can tell
        relayed(gw, script, request_id=request_id, got=got)
    assert got == first
    assert record_of(gw, request_id)["status"] == "upstream_error"
