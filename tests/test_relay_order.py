"""When a relayed stream gives its permit back: as soon as the backend is done, before
the client's last write, and exactly once whichever way the stream ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.meter import StreamMeter
from gateway.relay import StreamEnd, StreamRelay
from gateway.upstream import UpstreamResponse

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


def relay(log: list[str], body: Body) -> StreamRelay:
    upstream = UpstreamResponse(200, [(b"content-type", b"text/event-stream")], body)  # type: ignore[arg-type]

    def finish(end: StreamEnd) -> None:
        log.append(f"finish {end.status}")

    return StreamRelay(upstream, StreamMeter(started=0.0), {}, finish)


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
    assert log == ["chunk", "chunk", "finish ok", "last write"]
    assert body.closed == 1  # the upstream connection went back once, before the finish


def test_a_client_gone_at_the_last_write_is_still_ok_and_finished_once() -> None:
    log: list[str] = []
    body = Body(CHUNKS)

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            raise OSError("client went away")

    async def scenario() -> None:
        await relay(log, body)({"type": "http"}, None, send)  # type: ignore[arg-type]

    asyncio.run(scenario())
    assert log == ["finish ok"] and body.closed == 1


def test_a_client_gone_mid_stream_finishes_once_as_closed() -> None:
    log: list[str] = []
    body = Body(CHUNKS)

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            raise OSError("client went away")

    async def scenario() -> None:
        await relay(log, body)({"type": "http"}, None, send)  # type: ignore[arg-type]

    asyncio.run(scenario())
    assert log == ["finish client_closed"] and body.closed == 1
