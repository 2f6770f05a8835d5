"""When a relayed stream is recorded and gives its permit back: recorded before the
client's write of [DONE], released as soon as the backend is done, before the client's
last write, and each exactly once whichever way the stream ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from gateway.meter import StreamMeter
from gateway.relay import StreamEnd, StreamRelay
from gateway.upstream_response import UpstreamResponse

CHUNKS = [
    b'data: {"choices":[{"delta":{"content":"a"},"finish_reason":null}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"b"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n',
]


class Body:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.closed = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk

    def close_nowait(self) -> bool:
        self.closed += 1
        return True

    async def aclose(self) -> None:
        self.closed += 1


class Finisher:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def record(self, end: StreamEnd) -> None:
        self.log.append(f"record {end.status}")

    def release(self, end: StreamEnd) -> None:
        self.log.append(f"release {end.status}")


class ResetAfterTheLastChunk(Body):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        raise httpx.ReadError("connection reset")


def relay(log: list[str], body: Body) -> StreamRelay:
    upstream = UpstreamResponse(200, [(b"content-type", b"text/event-stream")], body)  # type: ignore[arg-type]
    return StreamRelay(upstream, StreamMeter(started=0.0), {}, Finisher(log), b"text/event-stream")


def test_permit_is_back_before_the_last_write() -> None:
    log: list[str] = []
    body = Body(CHUNKS)

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            log.append("last write")
        elif message["type"] == "http.response.body":
            log.append("chunk")

    async def scenario() -> None:
        await relay(log, body)({"type": "http"}, None, send)  # type: ignore[arg-type]

    asyncio.run(scenario())
    assert log == ["chunk", "record ok", "chunk", "release ok", "last write"]
    assert body.closed == 1  # the upstream connection went back once, before the release


def test_a_client_gone_at_the_last_write_is_still_ok_and_finished_once() -> None:
    log: list[str] = []
    body = Body(CHUNKS)

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            raise OSError("client went away")

    async def scenario() -> None:
        await relay(log, body)({"type": "http"}, None, send)  # type: ignore[arg-type]

    asyncio.run(scenario())
    assert log == ["record ok", "release ok"] and body.closed == 1


def test_a_backend_failing_after_done_is_released_as_recorded() -> None:
    """The client had it all; a reset while the body's end was awaited costs it nothing
    and the backend no failure."""
    log: list[str] = []
    body = ResetAfterTheLastChunk(CHUNKS)
    sent: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            sent.append(message["body"])

    async def scenario() -> None:
        await relay(log, body)({"type": "http"}, None, send)  # type: ignore[arg-type]

    asyncio.run(scenario())
    assert b"connection reset" in b"".join(sent)  # the reset did happen after [DONE]
    assert log == ["record ok", "release ok"] and body.closed == 1


def test_a_client_gone_mid_stream_finishes_once_as_closed() -> None:
    log: list[str] = []
    body = Body(CHUNKS)

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            raise OSError("client went away")

    async def scenario() -> None:
        await relay(log, body)({"type": "http"}, None, send)  # type: ignore[arg-type]

    asyncio.run(scenario())
    assert log == ["record client_closed", "release client_closed"] and body.closed == 1
