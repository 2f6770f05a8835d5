"""``listen.body_timeout_s``: a request body that stops coming is answered 408 and its
connection closed, as nginx's client_body_timeout; one that keeps coming, however
slowly, is read whole.

A real GatewayProtocol serves small apps on 127.0.0.1 in the test's own loop, so a test
can see what the app was told; the last test runs a real gateway in front of the
simulator.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest

from gateway.settings import ListenConfig
from tests.procs import MODEL, backend, start_gateway, start_sim
from tests.protocol_server import protocol_server
from tests.test_front_protocol_fixes import CHAT, STATIC_1, answers, post

TIMEOUT = 0.5
# Late, on a loaded machine, but far from "never": the timer is not lost.
LATE = TIMEOUT + 3
# Where a test races the client's pace or the app's against the body timer, both in one
# loop: the slack between them is the longest loop stall it survives.
SLOW_TIMEOUT = 2.0


class App:
    """Reads the body (after ``gate``, when given) and answers its length; ``answer_first``
    answers whole before reading, ``start_first`` sends only a response head first. Keeps
    every message it received; ``done`` once it returned."""

    def __init__(
        self, *, answer_first: bool = False, start_first: bool = False, gate: Any = None
    ) -> None:
        self.answer_first = answer_first
        self.start_first = start_first
        self.gate: asyncio.Event | None = gate
        self.received: list[dict[str, Any]] = []
        self.done = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        try:
            await self._serve(receive, send)
        finally:
            self.done.set()

    async def _serve(self, receive: Any, send: Any) -> None:
        if self.answer_first:
            await send(_start(200, b"2"))
            await send({"type": "http.response.body", "body": b"no"})
            return
        if self.start_first:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        if self.gate is not None:
            await self.gate.wait()
        size = 0
        while True:
            message = await receive()
            self.received.append(message)
            if message["type"] != "http.request":
                return  # the client is gone: nobody to answer
            size += len(message["body"])
            if not message["more_body"]:
                break
        body = json.dumps({"body_bytes": size}).encode()
        if not self.start_first:
            await send(_start(200, b"%d" % len(body)))
        await send({"type": "http.response.body", "body": body})


def _start(status: int, length: bytes) -> dict[str, Any]:
    headers = [(b"content-type", b"application/json"), (b"content-length", length)]
    return {"type": "http.response.start", "status": status, "headers": headers}


@asynccontextmanager
async def served(
    app: App, body_timeout_s: float = TIMEOUT
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    # What the gateway's lifespan hands its protocols: the runtime, its live settings.
    listen = ListenConfig.model_validate({"body_timeout_s": body_timeout_s})
    settings = SimpleNamespace(listen=listen)
    app_state = {"runtime": SimpleNamespace(current=SimpleNamespace(settings=settings))}
    async with protocol_server(app, app_state) as (_, reader, writer):
        yield reader, writer


def chunked_head(path: bytes = b"/v1/chat/completions") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        % path
    )


PARTIAL = {
    "content-length": post(b"x" * 1000)[: -1000 + 10],  # the head and 10 bytes of 1000
    "chunked": chunked_head() + b"3e8\r\n" + b"x" * 10,  # a chunk of 1000, 10 bytes of it
}


@pytest.mark.anyio
@pytest.mark.parametrize("framing", PARTIAL)
async def test_a_body_that_stops_is_answered_408_and_its_handler_ends(framing: str) -> None:
    app = App()
    loop = asyncio.get_running_loop()
    async with served(app) as (reader, writer):
        writer.write(PARTIAL[framing])
        sent = loop.time()
        raw = await asyncio.wait_for(reader.read(), 10)  # to the close
        closed = loop.time()
        await asyncio.wait_for(app.done.wait(), 5)
    got = answers(raw)
    assert [(status, headers["content-type"]) for status, headers, _ in got] == [
        (408, "application/json")
    ], raw
    assert json.loads(got[0][2])["error"] == {
        "message": "request body not received in time",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_timeout",
    }
    assert TIMEOUT * 0.95 <= closed - sent < LATE
    # What came, then the client gone: the handler's wait for the rest is over.
    assert [message["type"] for message in app.received][-1] == "http.disconnect"
    assert sum(len(message.get("body", b"")) for message in app.received) == 10


@pytest.mark.anyio
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_body_that_keeps_coming_is_read_however_long_it_takes(framing: str) -> None:
    """The timeout is between two reads, not for the whole body: sixteen pieces, each a
    tenth of it after the last, take more than one and a half times as long as it, and the
    body is read whole. The client paces in the server's loop: a stall of that loop longer
    than the slack between a piece and the timeout would be a 408 of the test's making."""
    pieces = [b"x" * 50] * 16
    if framing == "chunked":
        request = [chunked_head(), *(b"32\r\n%s\r\n" % piece for piece in pieces), b"0\r\n\r\n"]
    else:
        whole = post(b"".join(pieces), close=True)
        head = len(whole) - 800
        request = [whole[:head], *(whole[head + i * 50 : head + (i + 1) * 50] for i in range(16))]
    app = App()
    loop = asyncio.get_running_loop()
    async with served(app, SLOW_TIMEOUT) as (reader, writer):
        started = loop.time()
        for part in request:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(SLOW_TIMEOUT * 0.1)  # the client's pace: the scenario, not a wait
        raw = await asyncio.wait_for(reader.read(), 10)
    assert loop.time() - started > SLOW_TIMEOUT * 1.5
    assert [(status, json.loads(body)) for status, _, body in answers(raw)] == [
        (200, {"body_bytes": 800})
    ], raw


@pytest.mark.anyio
async def test_a_stalled_body_after_an_early_answer_is_closed_without_a_408() -> None:
    """The app answered (as with a 413) before the body ended: its answer stands, and a
    body whose rest stops coming has its connection closed, nothing written after the
    answer. uvicorn's keep-alive timer, cancelled by the body's later read, would not."""
    app = App(answer_first=True)
    loop = asyncio.get_running_loop()
    async with served(app) as (reader, writer):
        writer.write(PARTIAL["content-length"])
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\nno"), 10)
        writer.write(b"y" * 10)  # more of the body, then nothing
        sent = loop.time()
        rest = await asyncio.wait_for(reader.read(), 10)
        closed = loop.time()
    assert [status for status, _, _ in answers(first)] == [200]
    assert rest == b""
    assert closed - sent < LATE


@pytest.mark.anyio
async def test_a_stalled_body_after_a_response_began_only_closes() -> None:
    app = App(start_first=True)
    async with served(app) as (reader, writer):
        writer.write(PARTIAL["chunked"])
        raw = await asyncio.wait_for(reader.read(), 10)
        await asyncio.wait_for(app.done.wait(), 5)
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"408" not in raw, raw
    assert rest == b""  # the 200's body never came, and no second answer
    assert app.received[-1]["type"] == "http.disconnect"


@pytest.mark.anyio
@pytest.mark.parametrize("expect", [False, True], ids=["not reading yet", "100-continue"])
async def test_a_body_the_gateway_has_not_asked_for_is_not_timed(expect: bool) -> None:
    """The app takes its time before reading: a client waiting for ``100 Continue`` sends
    nothing, and one whose body filled the gateway's buffer cannot send more. Neither is
    the client's stall."""
    gate = asyncio.Event()
    app = App(gate=gate)
    body = b"x" * 300_000  # past uvicorn's 64 KiB high-water mark: reading pauses
    loop = asyncio.get_running_loop()
    async with served(app, SLOW_TIMEOUT) as (reader, writer):
        if expect:
            request = post(body, b"expect: 100-continue\r\n", close=True)
            writer.write(request[: -len(body)])
        else:
            writer.write(post(body, close=True))
        # The app's own pace, the scenario: half way between two looks of the body timer
        # (at 1 and 2 timeouts: the second finds the app reading), so that a stall of the
        # loop shorter than half a timeout cannot put the gate and a look in one turn.
        timed = loop.call_later(SLOW_TIMEOUT * 1.5, gate.set)
        if expect:
            assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == (
                b"HTTP/1.1 100 Continue\r\n\r\n"
            )
            writer.write(body)
        raw = await asyncio.wait_for(reader.read(), 10)
        timed.cancel()
    assert [(status, json.loads(answer)) for status, _, answer in answers(raw)] == [
        (200, {"body_bytes": len(body)})
    ], raw[:300]


@pytest.mark.anyio
async def test_a_client_asked_for_its_body_has_the_whole_timeout_from_then() -> None:
    """The app asks for the body (``100 Continue``) half a timeout before the timer's next
    look, and the client sends it three quarters of a timeout later, within the timeout:
    the body is read. (The look found no read since the one before, when the wait was
    the gateway's, and answered 408.)"""
    timeout = 1.0
    gate = asyncio.Event()
    app = App(gate=gate)
    body = b"x" * 10
    loop = asyncio.get_running_loop()
    async with served(app, timeout) as (reader, writer):
        request = post(body, b"expect: 100-continue\r\n", close=True)
        writer.write(request[: -len(body)])
        timed = loop.call_later(timeout * 2.5, gate.set)  # between the looks at 2 and 3
        continued = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert continued == b"HTTP/1.1 100 Continue\r\n\r\n"
        await asyncio.sleep(timeout * 0.75)  # the client's pace: the scenario, not a wait
        writer.write(body)
        raw = await asyncio.wait_for(reader.read(), 10)
        timed.cancel()
    assert [(status, json.loads(answer)) for status, _, answer in answers(raw)] == [
        (200, {"body_bytes": len(body)})
    ], raw


def test_a_proxied_request_whose_body_stops_is_answered_408_and_the_next_admitted(
    tmp_path: Path,
) -> None:
    """Through a real gateway whose one backend admits one request at a time: the stalled
    request is answered 408, nothing is left in flight, nothing was logged as a failure,
    and the next request is served."""
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=0.2)
    config = {
        "backends": [backend("sim", sim.url, limit=STATIC_1)],
        "listen": {"body_timeout_s": TIMEOUT},
    }
    gw = start_gateway(tmp_path, config)
    try:
        port = int(gw.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(post(CHAT + b" " * 1000)[: -1000 + 10])
            sent = time.monotonic()
            raw = b""
            while chunk := sock.recv(65536):  # a timeout here fails the test
                raw += chunk
            closed = time.monotonic()
        got = answers(raw)
        assert [status for status, _, _ in got] == [408], raw
        assert json.loads(got[0][2])["error"]["code"] == "request_timeout"
        assert TIMEOUT * 0.95 <= closed - sent < LATE
        assert gw.state()["backends"][0]["in_flight"] == 0
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=20)
        completion = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert completion.choices[0].message.content
        log = gw.proc.output()
        assert "Traceback" not in log and "Exception" not in log, log
    finally:
        gw.proc.stop()
        sim.stop()
