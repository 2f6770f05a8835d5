"""The plain-HTTP upstream transport behind httpx's client: reuse, streaming, errors, limits."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from gateway.perf.backend import MODEL, BackendProtocol
from gateway.upstream import UpstreamTransport

pytestmark = pytest.mark.anyio


async def _server(factory: Callable[[], asyncio.Protocol]) -> tuple[asyncio.Server, str]:
    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


@pytest.fixture
async def backend() -> AsyncIterator[str]:
    server, url = await _server(BackendProtocol)
    async with server:
        yield url


def _client(transport: UpstreamTransport, **timeouts: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5.0, **timeouts))


def _chat(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


async def test_keep_alive_connection_is_reused(backend: str) -> None:
    transport = UpstreamTransport(max_connections=4)
    async with _client(transport) as client:
        for _ in range(3):
            reply = await client.post(backend + "/v1/chat/completions", json=_chat(max_tokens=2))
            assert reply.status_code == 200
            assert reply.json()["usage"]["completion_tokens"] == 2
        assert transport._open == 1


async def test_streamed_body_arrives_whole(backend: str) -> None:
    transport = UpstreamTransport(max_connections=4)
    async with _client(transport) as client:
        body = _chat(max_tokens=5, stream=True, perf_itl_ms=1)
        async with client.stream("POST", backend + "/v1/chat/completions", json=body) as reply:
            assert reply.headers["content-type"].startswith("text/event-stream")
            data = b"".join([chunk async for chunk in reply.aiter_raw()])
        events = [e for e in data.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        contents = [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[:-1]]
        assert contents[1:] == [" knee"] * 5
        assert transport._open == 1 and len(transport._idle[("127.0.0.1", _port(backend))]) == 1


async def test_closing_a_stream_early_closes_its_connection(backend: str) -> None:
    transport = UpstreamTransport(max_connections=4)
    async with _client(transport) as client:
        body = _chat(max_tokens=1000, stream=True, perf_itl_ms=50)
        async with client.stream("POST", backend + "/v1/chat/completions", json=body) as reply:
            async for _ in reply.aiter_raw():
                break
        assert transport._open == 0  # an unfinished response is never handed to another request


async def test_connection_refused_is_a_connect_error() -> None:
    server, url = await _server(asyncio.Protocol)
    server.close()
    await server.wait_closed()
    async with _client(UpstreamTransport(max_connections=1)) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(url + "/health")


class _Silent(asyncio.Protocol):
    """Accepts and never answers."""


class _DiesMidBody(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(  # type: ignore[attr-defined]
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n7\r\ndata: 1\r\n"
        )
        self.transport.close()


async def test_stalled_upstream_is_a_read_timeout() -> None:
    server, url = await _server(_Silent)
    async with server, _client(UpstreamTransport(max_connections=1), read=0.2) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.get(url + "/health")


async def test_upstream_dying_mid_body_is_a_protocol_error() -> None:
    server, url = await _server(_DiesMidBody)
    async with server, _client(UpstreamTransport(max_connections=1)) as client:
        async with client.stream("POST", url + "/v1/chat/completions", content=b"{}") as reply:
            with pytest.raises(httpx.RemoteProtocolError):
                async for _ in reply.aiter_raw():
                    pass


async def test_pool_limit_waits_then_times_out(backend: str) -> None:
    transport = UpstreamTransport(max_connections=1)
    async with _client(transport, pool=0.2) as client:
        body = _chat(max_tokens=1000, stream=True, perf_itl_ms=50)
        async with client.stream("POST", backend + "/v1/chat/completions", json=body):
            with pytest.raises(httpx.PoolTimeout):
                await client.get(backend + "/health")
        assert (await client.get(backend + "/health")).status_code == 200


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_read_timeout_is_per_gap_not_per_stream(backend: str) -> None:
    """A stream longer than the read timeout, whose gaps are all shorter, is not cut."""
    body = json.dumps(_chat(stream=True, max_tokens=12, perf_itl_ms=40)).encode()
    async with _client(UpstreamTransport(max_connections=1), read=0.15) as client:
        async with client.stream("POST", backend + "/v1/chat/completions", content=body) as reply:
            data = b"".join([chunk async for chunk in reply.aiter_raw()])
    assert data.count(b'"content":"') >= 12
    assert data.rstrip().endswith(b"data: [DONE]")


class _StallsAfterOneChunk(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(  # type: ignore[attr-defined]
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n7\r\ndata: 1\r\n"
        )


async def test_stall_mid_stream_is_a_read_timeout() -> None:
    server, url = await _server(_StallsAfterOneChunk)
    async with server, _client(UpstreamTransport(max_connections=1), read=0.2) as client:
        async with client.stream("POST", url + "/v1/chat/completions", content=b"{}") as reply:
            received = []
            with pytest.raises(httpx.ReadTimeout):
                async for chunk in reply.aiter_raw():
                    received.append(chunk)
    assert received == [b"data: 1"]
