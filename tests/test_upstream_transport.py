"""The plain-HTTP upstream transport behind httpx's client: reuse, streaming, errors, limits."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from gateway.perf.backend import MODEL, BackendProtocol
from gateway.upstream import UpstreamTransport
from gateway.upstream_connection import HIGH_WATER
from tests.polling import eventually

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


class _Backend(asyncio.Protocol):
    """A raw test backend: counts its connections (per class) and each one's requests."""

    connections = 0

    def __init__(self) -> None:
        self.requests = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        type(self).connections += 1
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]


class _DiesMidBody(_Backend):
    def data_received(self, data: bytes) -> None:
        self.transport.write(
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


class _StallsAfterOneChunk(_Backend):
    def data_received(self, data: bytes) -> None:
        self.transport.write(
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


class _InterimFirst(_Backend):
    """Answers each request with ``interim`` (one or more 1xx responses), then its 200.

    Counts the connections it was given, so reuse is seen from the server's side too."""

    def __init__(self, interim: bytes) -> None:
        super().__init__()
        self.interim = interim

    def data_received(self, data: bytes) -> None:
        # Every request here is one write of head and body (no Expect), ended by its body.
        self.requests += 1
        self.transport.write(self.interim)
        # The 200 goes out two loop turns later, so the client has read the interim
        # responses alone (a loopback send is readable at once, and the client's read is
        # run in the next turn): what a real backend does that says 100 before working.
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, self._answer)

    def _answer(self) -> None:
        body = b'{"answer": %d}' % self.requests
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-real: yes\r\n"
            + b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )


@pytest.mark.parametrize(
    "interim",
    [
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n",
    ],
    ids=["100", "103", "100+103"],
)
async def test_interim_responses_are_skipped_and_the_connection_reused(interim: bytes) -> None:
    """An interim 1xx is not the answer: taken for it (as before the fix), the caller got
    a bodiless 1xx and the real 200 stayed on the pooled connection, where the next
    request read it as its own. The caller must get the 200 with its own headers only
    (no ``link`` from a 103) and its body; and the next request on the same connection
    must get its own answer, not the first one's."""
    _InterimFirst.connections = 0
    server, url = await _server(lambda: _InterimFirst(interim))
    transport = UpstreamTransport(max_connections=4)
    async with server:
        for n in (1, 2):
            reply = await transport.post(url + "/v1/chat/completions", b"", b"{}", {})
            assert reply.status_code == 200
            names = [name.lower() for name, _ in reply.raw_headers]
            assert b"x-real" in names and b"link" not in names
            assert names.count(b"content-length") == 1
            assert json.loads(await reply.aread()) == {"answer": n}
            await reply.aclose()
        assert transport._open == 1 and _InterimFirst.connections == 1  # reused
        await transport.aclose()


class _Unsolicited(_Backend):
    """Answers a request, then, once its client let the connection go idle (told by the
    test through ``poke``), sends another response nobody asked for."""

    made: list[_Unsolicited] = []

    def __init__(self) -> None:
        super().__init__()
        type(self).made.append(self)
        self.number = len(type(self).made)  # which connection of the server's this is

    def data_received(self, data: bytes) -> None:
        self.requests += 1
        body = b"own %d/%d" % (self.number, self.requests)
        self._answer(body)

    def _answer(self, body: bytes) -> None:
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    def poke(self) -> None:
        self._answer(b"UNSOLICITED")


async def test_unsolicited_bytes_on_an_idle_connection_close_it() -> None:
    """Bytes on an idle pooled connection answer nobody; parsed later, they would answer
    the next request (the cross-client leak). The transport must close that connection,
    give the next request a fresh one and its own answer, and keep its count of open
    connections right."""
    _Unsolicited.made = []
    server, url = await _server(_Unsolicited)
    transport = UpstreamTransport(max_connections=2)
    origin = ("127.0.0.1", _port(url))
    async with server:
        first = await transport.post(url + "/v1/chat/completions", b"", b"{}", {})
        assert await first.aread() == b"own 1/1"
        await first.aclose()
        assert transport._open == 1 and len(transport._idle[origin]) == 1
        [idle_conn] = transport._idle[origin]
        _Unsolicited.made[0].poke()
        await eventually(lambda: idle_conn.closed, "the idle connection was not closed")
        second = await transport.post(url + "/v1/chat/completions", b"", b"{}", {})
        assert await second.aread() == b"own 2/1"  # a new connection, its first answer
        await second.aclose()
        assert len(_Unsolicited.made) == 2
        assert transport._open == 1  # the closed one no longer counts, the new one does
        assert list(transport._idle[origin]) != [idle_conn] and len(transport._idle[origin]) == 1
        # Both slots are usable: two requests at once each get a connection and an answer.
        replies = await asyncio.gather(
            *(transport.post(url + "/v1/chat/completions", b"", b"{}", {}) for _ in range(2))
        )
        bodies = sorted([await r.aread() for r in replies])
        for reply in replies:
            await reply.aclose()
        assert bodies == [b"own 2/2", b"own 3/1"]
        assert transport._open == 2
        await transport.aclose()


class _TrailingBytes(_Backend):
    """The server's first connection answers with a complete response followed by the
    start of another (``trailer``), as a misbehaving backend might; the others cleanly."""

    made: list[_TrailingBytes] = []

    def __init__(self, trailer: bytes, same_write: bool) -> None:
        super().__init__()
        self.trailer = trailer
        self.same_write = same_write
        type(self).made.append(self)
        self.number = len(type(self).made)

    def data_received(self, data: bytes) -> None:
        body = b'{"n": %d}' % self.number
        answer = b"HTTP/1.1 200 OK\r\nx-own: yes\r\ncontent-length: %d\r\n\r\n%s" % (
            len(body),
            body,
        )
        if self.number > 1:
            self.transport.write(answer)
        elif self.same_write:
            self.transport.write(answer + self.trailer)
        else:
            self.transport.write(answer)
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, self.transport.write, self.trailer)


@pytest.mark.parametrize("same_write", [True, False], ids=["same-read", "later-read"])
async def test_bytes_after_a_complete_answer_never_reach_the_next_request(
    same_write: bool,
) -> None:
    """Bytes after the answer, before the connection went back to the pool: kept on the
    connection, they would be parsed as the start of the next request's answer (a 500
    with a stray header instead of that request's own 200). The connection must not be
    reused, and the next request must get its own answer on a fresh one."""
    _TrailingBytes.made = []
    trailer = b"HTTP/1.1 500 Internal\r\nx-stray: "
    server, url = await _server(lambda: _TrailingBytes(trailer, same_write))
    transport = UpstreamTransport(max_connections=1)
    async with server:
        first = await transport.post(url + "/v1/chat/completions", b"", b"{}", {})
        assert first.status_code == 200 and json.loads(await first.aread()) == {"n": 1}
        # Read by the connection before it went back to the pool: it gives up on itself.
        conn = first._body._conn  # type: ignore[union-attr]
        await eventually(lambda: conn.closed, "the connection kept the trailing bytes")
        await first.aclose()
        second = await transport.post(url + "/v1/chat/completions", b"", b"{}", {})
        assert second.status_code == 200
        assert (b"x-own", b"yes") in second.raw_headers
        assert all(name != b"x-stray" for name, _ in second.raw_headers)
        assert json.loads(await second.aread()) == {"n": 2}  # a fresh connection's answer
        await second.aclose()
        assert transport._open == 1
        await transport.aclose()


class _BigAnswer(_Backend):
    """Answers every request with a body larger than the transport buffers before it stops
    reading the socket: all but its last bytes at once, the rest when the test says, so
    that the read that completes the answer is the one that crosses the limit (sent in
    one write, a loaded machine's partial sends made the limit fall mid-answer, and the
    answer never complete)."""

    TAIL = 10_000
    last: _BigAnswer | None = None

    def data_received(self, data: bytes) -> None:
        type(self).last = self
        head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (HIGH_WATER + self.TAIL)
        self.transport.write(head + b"x" * HIGH_WATER)

    def send_the_tail(self) -> None:
        self.transport.write(b"x" * self.TAIL)


async def test_a_connection_paused_on_a_whole_unread_answer_reads_again_when_reused() -> None:
    """An answer larger than the buffer limit that arrived whole while nobody read it
    (a slow client, or one gone) leaves reading paused on a complete, reusable
    connection. Reused so, the next request would wait for bytes never read, and time
    out against a healthy backend."""
    server, url = await _server(_BigAnswer)
    transport = UpstreamTransport(max_connections=1)
    async with server:
        first = await transport.post(url + "/v1/completions", b"", b"{}", {"read": 5.0})
        conn = first._body._conn  # type: ignore[union-attr]
        await eventually(lambda: conn.buffered == HIGH_WATER, "the answer's bulk never arrived")
        assert _BigAnswer.last is not None and not conn.paused
        _BigAnswer.last.send_the_tail()
        await eventually(lambda: conn.complete, "the whole answer never arrived")
        assert conn.paused  # what makes this case: it stopped reading, then completed
        await first.aclose()  # unread: the connection goes back to the pool as it is
        second = await transport.post(url + "/v1/completions", b"", b"{}", {"read": 2.0})
        assert second.status_code == 200
        assert _BigAnswer.last is not None
        _BigAnswer.last.send_the_tail()
        assert len(await second.aread()) == HIGH_WATER + _BigAnswer.TAIL
        await second.aclose()
        assert transport._open == 1  # the same connection, reused
        await transport.aclose()


class _ClosesKeptAlive(_Backend):
    """Answers the first request on each connection (keep-alive), and closes the
    connection on the second without answering: a server whose idle timeout ran out just
    as the client reused the connection."""

    def data_received(self, data: bytes) -> None:
        self.requests += 1
        if self.requests > 1:
            self.transport.close()
            return
        body = b'{"connection": %d}' % type(self).connections
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


async def test_a_request_lost_on_a_closed_keep_alive_connection_is_sent_again() -> None:
    """The server closed the pooled connection as the request was written: nothing came
    back, so the request is sent once more on a fresh connection and answered there.
    ``on_wire`` hears the lost write withdrawn, so a caller never counts a request as
    delivered on the strength of a write the server never read."""
    _ClosesKeptAlive.connections = 0
    server, url = await _server(_ClosesKeptAlive)
    transport = UpstreamTransport(max_connections=2)
    async with server:
        first = await transport.post(url + "/v1/completions", b"", b"{}", {"read": 5.0})
        assert json.loads(await first.aread()) == {"connection": 1}
        await first.aclose()
        calls: list[bool] = []
        second = await transport.post(
            url + "/v1/completions", b"", b"{}", {"read": 5.0}, on_wire=calls.append
        )
        assert json.loads(await second.aread()) == {"connection": 2}
        await second.aclose()
        assert calls == [True, False, True]
        assert transport._open == 1 and _ClosesKeptAlive.connections == 2
        await transport.aclose()


class _Upgrades(_Backend):
    """Answers with ``101 Switching Protocols``, which no proxied POST asked for."""

    def data_received(self, data: bytes) -> None:
        self.transport.write(
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
            b"connection: upgrade\r\n\r\n\x81\x05hello"
        )


async def test_an_upgrade_answer_is_a_protocol_error_not_a_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 101 is neither an answer nor an interim one here: the request fails as a protocol
    error (the gateway's 502), the connection is dropped, and nothing escapes into the
    event loop's error log."""
    server, url = await _server(_Upgrades)
    transport = UpstreamTransport(max_connections=1)
    async with server:
        with pytest.raises(httpx.RemoteProtocolError):
            await transport.post(url + "/v1/completions", b"", b"{}", {"read": 5.0})
        assert transport._open == 0
        await transport.aclose()
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text


class _AnswersOnceThenStalls(_Backend):
    """Answers the first request on a connection; never answers the ones after it."""

    def data_received(self, data: bytes) -> None:
        self.requests += 1
        if self.requests == 1:
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")


async def test_a_shorter_read_timeout_on_a_reused_connection_is_kept() -> None:
    """The connection's last request waited with a longer read timeout (a health probe's,
    or the read timeout before a reload), and its timer is still armed for that later
    deadline. The next request's stall must be cut at its own, shorter, limit (before
    the fix: at the old one, 5 s here)."""
    _AnswersOnceThenStalls.connections = 0
    server, url = await _server(_AnswersOnceThenStalls)
    transport = UpstreamTransport(max_connections=1)
    async with server:
        first = await transport.post(url + "/health", b"", b"{}", {"read": 5.0})
        assert await first.aread() == b"ok"
        await first.aclose()
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(httpx.ReadTimeout):
            await transport.post(url + "/v1/completions", b"", b"{}", {"read": 0.2})
        assert loop.time() - started < 2.0
        assert _AnswersOnceThenStalls.connections == 1  # the same connection, reused
        await transport.aclose()


async def test_room_given_to_a_waiter_that_left_goes_to_the_next(backend: str) -> None:
    """A waiter woken for a free slot and cancelled before it ran (its client left) used
    to keep the wake-up: the next waiter sat until its pool timeout with the slot free."""
    transport = UpstreamTransport(max_connections=1)
    url = backend + "/v1/chat/completions"
    body = json.dumps(_chat(max_tokens=2)).encode()
    fields = b"content-type: application/json\r\n"
    timeouts = {"connect": 5.0, "read": 10.0, "write": 10.0, "pool": 10.0}
    holder = await transport.post(url, fields, body, timeouts)
    async for _ in holder.aiter_raw():
        pass
    leaving = asyncio.create_task(transport.post(url, fields, body, timeouts))
    next_in_line = asyncio.create_task(transport.post(url, fields, body, timeouts))
    await eventually(lambda: len(transport._waiters) == 2, "both wait for the one slot")
    holder.close_nowait()  # the slot is free: the first waiter is woken...
    leaving.cancel()  # ...and its client leaves before it runs
    started = asyncio.get_running_loop().time()
    reply = await next_in_line
    async for _ in reply.aiter_raw():
        pass
    reply.close_nowait()
    assert reply.status_code == 200
    assert asyncio.get_running_loop().time() - started < 5.0  # not at the 10 s pool timeout
    with pytest.raises(asyncio.CancelledError):
        await leaving
    await transport.aclose()
