"""The drain's end cuts streams cleanly: each ends with an error event the client can read.

At ``listen.drain_timeout_s`` the streams still going used to be cancelled by uvicorn a
second later: a ``CancelledError`` traceback logged per stream, and a client left with a
broken connection and no reason. Now each ends itself when the drain stops: a last SSE
event ``shutting_down``, then the end of the response, its permit and upstream given back.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.drain import DRAIN_STATE_KEY, Drain
from gateway.meter import StreamMeter
from gateway.relay import StreamRelay
from gateway.upstream_response import UpstreamResponse
from tests import test_ops_robustness
from tests.instrumented_gateway import start_instrumented_gateway
from tests.procs import (
    MODEL,
    Proc,
    backend,
    free_port,
    start_gateway,
    start_process,
    start_raw_sse,
    start_sim,
    wait_until,
)
from tests.test_front_protocol_fixes import post
from tests.test_ops_robustness import is_token
from tests.test_proxy_wire import record_of
from tests.test_relay_order import CHUNKS, Body, Finisher
from tests.test_reload_live import sse

slow_sim = test_ops_robustness.slow_sim  # the same module-scoped fixture, here too

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
LONG = 1000  # tokens at 20 ms: 20 s, far past the drain timeout


# How the drain stops: its timeout passes, or a second signal ends it at once.
DRAIN_ENDS = {"timeout": ("1", 1), "second signal": ("60", 2)}


@pytest.mark.parametrize(("drain_timeout_s", "signals"), DRAIN_ENDS.values(), ids=DRAIN_ENDS)
def test_streams_in_flight_at_the_drain_end_end_with_a_shutting_down_event(
    tmp_path: Path, slow_sim: Proc, drain_timeout_s: str, signals: int
) -> None:
    gw = start_gateway(
        tmp_path,
        {"backends": [backend("s", slow_sim.url)]},
        env={"KNEECAP_LISTEN__DRAIN_TIMEOUT_S": drain_timeout_s},
    )
    lines: list[str] = []
    raw_streaming = threading.Event()
    sdk_streaming = threading.Event()
    sdk_errors: list[openai.APIError] = []

    def raw_stream() -> None:
        body = {**CHAT, "stream": True, "max_tokens": LONG}
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                lines.append(line)
                if is_token(line):
                    raw_streaming.set()

    def sdk_stream() -> None:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)
        stream = client.chat.completions.create(**CHAT, stream=True, max_tokens=LONG)
        try:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    sdk_streaming.set()
        except openai.APIError as exc:
            sdk_errors.append(exc)

    clients = [threading.Thread(target=raw_stream), threading.Thread(target=sdk_stream)]
    for client in clients:
        client.start()
    try:
        assert raw_streaming.wait(10) and sdk_streaming.wait(10), "the streams never started"
        gw.proc.process.send_signal(signal.SIGTERM)
        if signals == 2:
            wait_until(lambda: "received SIGTERM, draining" in gw.proc.output())
            gw.proc.process.send_signal(signal.SIGTERM)
        for client in clients:
            client.join(10)
        assert not any(client.is_alive() for client in clients), "a stream did not end"
        events = [line for line in lines if line]
        assert events[-1].startswith('data: {"error"'), f"no error event last: {events[-1]}"
        error = json.loads(events[-1].removeprefix("data: "))["error"]
        assert error["code"] == "shutting_down"
        assert error["type"] == "service_unavailable"
        assert 0 < sum(1 for line in events if is_token(line)) < LONG  # cut, not finished
        assert len(sdk_errors) == 1, "the SDK saw no error: its stream ended as if complete"
        assert sdk_errors[0].code == "shutting_down"
        assert "shutting down" in sdk_errors[0].message
        assert gw.proc.process.wait(10) == 0
        output = gw.proc.output()
        assert "Traceback" not in output, output
        assert "Exception in ASGI application" not in output, output
    finally:
        gw.proc.stop()
        for client in clients:
            client.join(5)


def test_a_whole_answer_awaited_at_the_drain_end_is_answered_503(
    tmp_path: Path, slow_sim: Proc
) -> None:
    """uvicorn cancels what still runs a grace after the drain's end: a non-streamed request
    then waiting on its backend got a 500 and a logged traceback; now the 503 a refused
    request gets, which a client may retry elsewhere."""
    gw = start_gateway(
        tmp_path,
        {"backends": [backend("s", slow_sim.url)]},
        env={"KNEECAP_LISTEN__DRAIN_TIMEOUT_S": "1"},
    )
    answers: list[httpx.Response] = []

    def whole() -> None:
        body = {**CHAT, "max_tokens": LONG}
        answers.append(httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30))

    client = threading.Thread(target=whole)
    client.start()
    try:
        wait_until(lambda: gw.state()["backends"][0]["in_flight"] == 1)
        gw.proc.process.send_signal(signal.SIGTERM)
        client.join(15)
        assert not client.is_alive(), "the request was never answered"
        assert answers[0].status_code == 503, answers[0].text
        assert answers[0].json()["error"]["code"] == "shutting_down"
        assert gw.proc.process.wait(10) == 0
        assert "Traceback" not in gw.proc.output(), gw.proc.output()
    finally:
        gw.proc.stop()
        client.join(5)


HANG = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + sse("a")
# A whole answer whose head came and whose body never ends: the drain's end finds the
# gateway reading it, where a backend slow to answer at all (``["hang"]``) has it waiting
# for the head.
HALF_ANSWER = 'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 99\r\n\r\n{"c'
STATIC_8 = {"kind": "static", "initial": 8, "min": 1, "max": 8}


def test_what_the_drain_cuts_is_counted_as_the_gateway_shutting_down(tmp_path: Path) -> None:
    """Cut by the drain's end, streams and whole answers were counted ``client_closed``,
    which the dashboard reads as users giving up: a deploy looked like users leaving. They
    are ``gateway_shutdown`` now; a client that really left is still ``client_closed``."""
    raw = start_raw_sse(tmp_path)
    config = {"backends": [backend("s", raw.url, limit=STATIC_8)], "health": {"interval_s": 60}}
    env = {"KNEECAP_LISTEN__DRAIN_TIMEOUT_S": "1"}
    try:
        gw, at_exit = start_instrumented_gateway(tmp_path, config, env)
    except BaseException:
        raw.stop()
        raise
    url = gw.url + "/v1/chat/completions"

    def post_as(request_id: str, script: list[list[Any]]) -> httpx.Response:
        body = {**CHAT, "raw_script": script}
        return httpx.post(url, json=body, headers={"x-request-id": request_id}, timeout=30)

    def in_flight() -> int:
        return httpx.get(gw.url + "/admin/state", timeout=5).json()["backends"][0]["in_flight"]

    def stream_as(request_id: str, lines: list[str], then_leave: bool) -> None:
        body = {**CHAT, "stream": True, "raw_script": [["send", HANG], ["hang"]]}
        headers = {"x-request-id": request_id}
        with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as r:
            for line in r.iter_lines():
                lines.append(line)
                if then_leave and line.startswith("data: {"):
                    return

    cut_lines: list[str] = []
    clients = ThreadPoolExecutor(4)
    try:
        # Clients that really leave: a stream after its first token, a whole answer on
        # its own timeout. Each is counted before the drain starts.
        stream_as("left-stream", [], then_leave=True)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                url,
                json={**CHAT, "raw_script": [["hang"]]},
                headers={"x-request-id": "left-whole"},
                timeout=0.5,
            )
        for request_id in ("left-stream", "left-whole"):
            assert record_of(gw, request_id)["status"] == "client_closed"  # type: ignore[arg-type]
        # What the drain's end finds: a stream between two tokens, a whole answer awaiting
        # its backend's head, another its body.
        cut_stream = clients.submit(stream_as, "cut-stream", cut_lines, False)
        head = clients.submit(post_as, "cut-head", [["hang"]])
        body = clients.submit(post_as, "cut-body", [["send", HALF_ANSWER], ["hang"]])
        wait_until(lambda: in_flight() == 3)
        wait_until(lambda: any(line.startswith("data: {") for line in cut_lines))
        gw.process.send_signal(signal.SIGTERM)
        cut_stream.result(10)
        assert '"code": "shutting_down"' in [line for line in cut_lines if line][-1]
        for answer in (head.result(10), body.result(10)):
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down"
        assert gw.process.wait(10) == 0
    finally:
        gw.stop()
        raw.stop()
        clients.shutdown(wait=False, cancel_futures=True)
    final = json.loads(at_exit.read_text())
    statuses = {r["request_id"]: r["status"] for r in final["requests"]}
    assert statuses == {
        "left-stream": "client_closed",
        "left-whole": "client_closed",
        "cut-stream": "gateway_shutdown",
        "cut-head": "gateway_shutdown",
        "cut-body": "gateway_shutdown",
    }
    counted = {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(final["metrics"])
        for sample in family.samples
        if sample.name == "kneecap_requests_total"
    }
    assert counted == {"client_closed": 2, "gateway_shutdown": 3}


def test_a_second_ctrl_c_cuts_the_embedded_default_cleanly(tmp_path: Path) -> None:
    """Forced, uvicorn skipped the apps' shutdown: the gateway's and each embedded sim's
    lifespan was cancelled at the loop's end, a traceback each."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_process(["serve", "--port", str(port)], url, "/ready", tmp_path / "s.log")
    body = {**CHAT, "stream": True, "max_tokens": 3000, "ignore_eos": True}
    lines: list[str] = []

    def read_the_stream() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines.extend(r.iter_lines())

    reader = threading.Thread(target=read_the_stream)
    reader.start()
    try:
        wait_until(lambda: any(is_token(line) for line in lines))
        proc.process.send_signal(signal.SIGINT)
        wait_until(lambda: "draining" in proc.output())
        proc.process.send_signal(signal.SIGINT)
        assert proc.process.wait(10) == 0
        reader.join(10)
        assert '"code": "shutting_down"' in [line for line in lines if line][-1]
        assert "Traceback" not in proc.output(), proc.output()
    finally:
        proc.stop()
        reader.join(5)


class Endless(Body):
    """A backend that sends its first events, then nothing more until it is closed."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.chunks[0]
        await asyncio.Event().wait()
        yield b""  # pragma: no cover


def cut_relay(body: Body, content_type: bytes = b"text/event-stream") -> tuple[StreamRelay, list]:
    """A relay of ``body`` whose finisher logs what it records and releases."""
    log: list[str] = []
    upstream = UpstreamResponse(200, [(b"content-type", content_type)], body)  # type: ignore[arg-type]
    return StreamRelay(upstream, StreamMeter(started=0.0), {}, Finisher(log), content_type), log


def run_relay(relay: StreamRelay, drain: Drain, send: Any) -> None:
    """The relay served under ``drain``, to its end (at most 5 s)."""

    async def scenario() -> None:
        scope = {"type": "http", "state": {DRAIN_STATE_KEY: drain}}
        await asyncio.wait_for(relay(scope, None, send), 5)  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_a_cut_stream_is_closed_recorded_and_released_once() -> None:
    body = Endless(CHUNKS)
    drain = Drain(0.0)
    sent: list[dict] = []
    relay, log = cut_relay(body)

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and message["body"] == CHUNKS[0]:
            drain.stop()  # the first event is out: the stream waits on its backend

    run_relay(relay, drain, send)
    assert log == ["record gateway_shutdown", "release gateway_shutdown"]
    assert body.closed == 1
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert bodies[0]["body"] == CHUNKS[0]
    assert b'"code": "shutting_down"' in bodies[1]["body"]
    assert bodies[1]["body"].startswith(b"data: ") and bodies[1]["body"].endswith(b"\n\n")
    assert bodies[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert len(bodies) == 3


class SlowToClose(Body):
    """An upstream whose close must be awaited (the ``https://`` path), and takes long."""

    def __init__(self, chunks: list[bytes]) -> None:
        super().__init__(chunks)
        self.closing = asyncio.Event()

    def close_nowait(self) -> bool:
        return False

    async def aclose(self) -> None:
        self.closing.set()
        await asyncio.sleep(3600)


def test_a_cut_landing_in_the_upstream_close_still_releases_the_permit() -> None:
    """The shield around the close keeps anyio's cancellations out, not a task's own:
    the cut used to skip the release, and the backend's permit was never given back."""
    body = SlowToClose(CHUNKS)
    drain = Drain(0.0)
    relay, log = cut_relay(body)

    async def send(message: dict) -> None:
        pass

    async def scenario() -> None:
        scope = {"type": "http", "state": {DRAIN_STATE_KEY: drain}}
        stream = asyncio.ensure_future(relay(scope, None, send))  # type: ignore[arg-type]
        await asyncio.wait_for(body.closing.wait(), 5)
        drain.stop()
        await asyncio.wait_for(stream, 5)

    asyncio.run(scenario())
    assert log == ["record ok", "release ok"]


def test_a_stream_whose_answer_comes_after_the_drain_is_cut_at_once() -> None:
    """Its backend answered after the drain's end: nothing would cut it before uvicorn."""
    body = Endless(CHUNKS)
    drain = Drain(0.0)
    drain.stop()
    sent: list[dict] = []
    relay, log = cut_relay(body)

    async def send(message: dict) -> None:
        sent.append(message)

    run_relay(relay, drain, send)
    assert log == ["record gateway_shutdown", "release gateway_shutdown"] and body.closed == 1
    assert b'"code": "shutting_down"' in sent[-2]["body"] and not sent[-1]["more_body"]


def test_a_client_reading_nothing_at_the_drain_end_is_cut_at_once(tmp_path: Path) -> None:
    """A cut stream's client that reads nothing gets no last event: its connection used to
    be left to close itself, logged "ASGI callable returned without completing response",
    and the gateway waited on it past its graceful timeout before it could exit."""
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=0.2)
    gw = start_gateway(
        tmp_path,
        {"backends": [backend("sim", sim.url)]},
        env={"KNEECAP_LISTEN__DRAIN_TIMEOUT_S": "1"},
    )
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills fast
    try:
        stalled.connect(("127.0.0.1", int(gw.url.rsplit(":", 1)[1])))
        # Long events (logprobs) at 5000 a second: the buffers fill long before the drain ends.
        body = {**CHAT, "stream": True, "max_tokens": 20_000, "logprobs": True, "top_logprobs": 5}
        stalled.sendall(post(json.dumps(body).encode()))
        assert stalled.recv(100).startswith(b"HTTP/1.1 200")  # then reads no more
        gw.proc.process.send_signal(signal.SIGTERM)
        assert gw.proc.process.wait(10) == 0
        output = gw.proc.output()
        # Out once the drain's 1 s and the cut's write are: not held to uvicorn's graceful
        # timeout (which then logs at ERROR), nor to listen.send_timeout_s (60 s).
        assert "timeout graceful shutdown exceeded" not in output, output
        assert "ASGI callable returned without completing response" not in output, output
        assert "Traceback" not in output, output
        assert "ERROR" not in output, output
    finally:
        stalled.close()
        gw.proc.stop()
        sim.stop()


class ResetAfterItsEvents(Body):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        raise httpx.ReadError("connection reset")


_LAST = b'data: {"choices":[{"delta":{"content":"b"},"finish_reason":"stop"}]}'
# Bodies over when the drain's end lands in the write of what was left of them: the last
# event without its blank line (the close cut it short), the [DONE] so, an upstream error.
ENDED = {
    "a last event held": ([CHUNKS[0], _LAST], Body, _LAST),
    "a last [DONE] held": ([CHUNKS[0], _LAST + b"\n\ndata: [DONE]"], Body, b"data: [DONE]"),
    "an upstream error": ([CHUNKS[0]], ResetAfterItsEvents, b'"code": "upstream_error"'),
}


@pytest.mark.parametrize(("chunks", "kind", "due"), ENDED.values(), ids=ENDED)
def test_a_cut_landing_in_the_last_write_of_a_body_over_sends_what_was_due(
    chunks: list[bytes], kind: type[Body], due: bytes
) -> None:
    """The body was over: its client used to get a shutting_down event instead of the rest
    of it (the held tail dropped), though nothing was cut short."""
    drain = Drain(0.0)
    sent: list[dict] = []
    relay, log = cut_relay(kind(chunks))

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and due in message["body"]:
            if not drain.stopped:
                drain.stop()  # lands in this write, which so wrote nothing
                await asyncio.sleep(0)
        sent.append(message)

    run_relay(relay, drain, send)
    assert drain.stopped, "the cut never landed"
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert due in [body for body in bodies if body][-1], bodies
    assert not any(b"shutting_down" in body for body in bodies), bodies
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert len(log) == 2 and log[0].startswith("record") and log[1].startswith("release")


def test_a_cut_stream_that_is_no_sse_just_ends() -> None:
    """NDJSON, text: an SSE error event would be content the client takes for the backend's."""
    body = Endless([b'{"text": "a"}\n'])
    drain = Drain(0.0)
    sent: list[dict] = []
    relay, log = cut_relay(body, b"application/x-ndjson")

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and message["body"] == body.chunks[0]:
            drain.stop()  # the first line is out: the stream waits on its backend

    run_relay(relay, drain, send)
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert bodies == [b'{"text": "a"}\n', b""] and not sent[-1]["more_body"]
    assert log == ["record gateway_shutdown", "release gateway_shutdown"] and body.closed == 1
