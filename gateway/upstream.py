"""An httpx transport for plain-HTTP upstreams: O(1) keep-alive pool, C parser, no copies.

httpx's default transport (httpcore + h11) costs the relay most of its time:
every request and every response close walks the whole pool and polls each
idle socket (``has_expired`` → ``is_socket_readable``), and h11 parses each
chunk in pure Python. This transport keeps httpx's interface (the client, its
``Response``, its exception tree, its timeouts and limits) and replaces only
the wire: ``asyncio`` protocols, ``httptools``' llhttp parser (uvicorn's), and
one deque of idle connections per origin. ``https://`` goes to httpx's own
transport unchanged.

Body chunks that arrived together are handed on together, so the relay writes
them to the client in one go; nothing waits to be merged.
"""

from __future__ import annotations

import asyncio
import errno
import functools
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

import httpcore
import httptools
import httpx

_Origin = tuple[str, int]
_HIGH_WATER = 256 * 1024  # buffered body bytes before the socket stops being read
# What ``socket()``/``connect()`` fail with when the gateway's own process or host has run
# out: descriptors (``ulimit -n``, the system's table), socket buffers, kernel memory.
_LOCAL_SHORTAGES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class GatewayOutOfResources(httpx.ConnectError):
    """The gateway could not connect for want of its own resources (file descriptors,
    socket buffers, memory): no fault of the backend, which any other would share.

    An ``httpx.ConnectError`` still, so a caller that knows no better (a metrics scrape)
    takes it as the failed call it is; the proxy and the health probe tell it apart."""


def _local_shortage(exc: BaseException) -> OSError | None:
    """The ``OSError`` of a local shortage behind ``exc`` (httpx's own transport chains the
    original under its ``ConnectError``), if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _LOCAL_SHORTAGES:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; one request at a time."""

    def __init__(self, origin: _Origin) -> None:
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used = False  # has served a request: a failure may be a stale keep-alive
        self.counted = True  # holds one of the pool's ``max_connections`` slots
        self.idle = False  # in the pool, no request on it
        self.idle_since = 0.0  # loop time it was last put in the pool
        self.timer: asyncio.TimerHandle | None = None
        self.deadline = 0.0
        self.paused = False
        self._reset()

    def _reset(self) -> None:
        # A fresh parser per request: whatever a misbehaving backend sent beyond its
        # last answer cannot become the start of the next one.
        self.parser = httptools.HttpResponseParser(self)
        self._resume()  # an answer may have completed, paused, while nobody read it
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.framed = False  # content-length or chunked: the end is not the close
        self.interim = False  # parsing a 1xx response: the real one follows
        self.head_done = False
        self.keep_alive = False
        self.complete = False
        self.received = False
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.idle or self.complete:
            # Bytes after the answer, that nobody asked for: kept, they could be read
            # as the next request's answer. The connection is not reused.
            self.close()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            # An upgrade (101) is no answer to a proxied POST either.
            self._fail(httpcore.RemoteProtocolError(f"invalid HTTP response: {exc!r}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        if self.head_done and not self.complete and not self.framed:
            if exc is None:
                self.on_message_complete()  # a body delimited by the close
            else:  # a reset is no close: the body was cut, not ended
                self._fail(
                    httpcore.ReadError(f"connection lost before the end of the body: {exc!r}")
                )
        elif not self.complete:
            what = "response headers" if not self.head_done else "complete message body"
            self._fail(httpcore.RemoteProtocolError(f"peer closed connection without {what}"))

    # -- httptools callbacks ----------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:  # more after the answer, in the same read: as above
            raise httptools.HttpParserError("bytes after the complete response")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length" or lowered == b"transfer-encoding":
            self.framed = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            # An interim answer (100 Continue, 103 Early Hints): not the response.
            self.interim = True
            self.headers = []
            self.framed = False
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()  # reads False once complete
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self._wake()

    # -- used by the transport and the body stream ----------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        self.error = error
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    async def wait(self, limit_s: float | None) -> None:
        """Until the parser made progress, the connection failed, or ``limit_s`` passed.

        One timer per connection, re-armed only when it fires early, instead of a
        timer made and cancelled for every chunk of a stream. A timer left by an
        earlier wait with a longer limit (a health probe's, or the read timeout before
        a reload) would fire late: a deadline before it moves it forward.
        """
        if self.error is not None:
            raise self.error
        self.waiter = waiter = self.loop.create_future()
        if limit_s is None:
            self.deadline = float("inf")  # a timer still armed by an earlier wait lets go
        else:
            self.deadline = deadline = self.loop.time() + limit_s
            timer = self.timer
            if timer is None or deadline < timer.when():
                if timer is not None:
                    timer.cancel()
                self.timer = self.loop.call_at(deadline, self._check_deadline)
        try:
            await waiter
        finally:
            self.waiter = None

    def _check_deadline(self) -> None:
        self.timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # not waiting now: the next wait arms the timer again
        if self.loop.time() >= self.deadline:
            waiter.set_exception(httpcore.ReadTimeout("timed out waiting for the upstream"))
        elif self.deadline != float("inf"):
            self.timer = self.loop.call_at(self.deadline, self._check_deadline)

    def take(self) -> bytes:
        """Every body byte buffered so far, as one chunk."""
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        self._resume()
        return data

    def _resume(self) -> None:
        if self.paused and self.transport is not None:
            self.transport.resume_reading()
        self.paused = False

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.closed = True


class _Body(httpx.AsyncByteStream):
    def __init__(self, pool: UpstreamTransport, conn: _Connection, read_timeout: float | None):
        self._pool = pool
        self._conn = conn
        self._read_timeout = read_timeout
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        try:
            while True:
                if conn.chunks:
                    yield conn.take()
                elif conn.complete:
                    return
                else:
                    await conn.wait(self._read_timeout)
        except httpcore.ReadTimeout as exc:
            raise httpx.ReadTimeout(str(exc)) from exc
        except httpcore.RemoteProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc)) from exc
        except httpcore.ReadError as exc:
            raise httpx.ReadError(str(exc)) from exc

    def close_nowait(self) -> bool:
        """Gives the connection back (to the pool, or closed) at once; never waits."""
        if not self._released:
            self._released = True
            self._pool._release(self._conn)
        return True

    async def aclose(self) -> None:
        self.close_nowait()


class _HttpxBody:
    """An ``httpx.Response``'s body (the ``https://`` path) behind the same interface."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._response.aiter_raw()

    def close_nowait(self) -> bool:
        return False  # httpx's close must be awaited

    async def aclose(self) -> None:
        await self._response.aclose()


class UpstreamResponse:
    """A proxied request's answer: status, raw headers, and the body as it arrives.

    Lighter than ``httpx.Response`` (no header parsing, no decoder and chunker
    generators around each body chunk), which the relay pays for per token.
    """

    __slots__ = ("_body", "raw_headers", "status_code")

    def __init__(
        self, status_code: int, raw_headers: list[tuple[bytes, bytes]], body: _Body | _HttpxBody
    ) -> None:
        self.status_code = status_code
        self.raw_headers = raw_headers
        self._body = body

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return self._body.__aiter__()

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self._body])

    def close_nowait(self) -> bool:
        """Closes the body now when that needs no waiting (the plain-HTTP path)."""
        return self._body.close_nowait()

    async def aclose(self) -> None:
        await self._body.aclose()


class UpstreamTransport(httpx.AsyncBaseTransport):
    """Keep-alive HTTP/1.1 to plain-HTTP upstreams; ``max_connections`` bounds the pool."""

    def __init__(self, *, max_connections: int, tls: httpx.AsyncBaseTransport | None = None):
        self._max = max_connections  # a reload changes it: :meth:`resize`
        self._open = 0
        self._idle: dict[_Origin, deque[_Connection]] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._tls = tls or httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=max_connections)
        )

    def resize(self, max_connections: int) -> None:
        """The pool's new bound (a reload). Raised, requests waiting for a connection go
        on at once; lowered, idle connections over it close now and those in use as
        they come back: none is cut. (The ``https://`` pool keeps its startup bound.)"""
        self._max = max_connections
        for idle in self._idle.values():
            while idle and self._open > self._max:
                self._discard(idle.popleft())  # the longest idle first
        for _ in range(self._max - self._open):
            self._wake_one()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            return await self._via_tls(request)
        try:
            body = request.content  # built with content=bytes: already read
        except httpx.RequestNotRead:
            body = await request.aread()
        origin = (url.host, url.port or 80)
        timeouts = request.extensions.get("timeout", {})
        conn = await self._exchange(origin, _head(request), body, timeouts)
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=_Body(self, conn, timeouts.get("read")),
            extensions={"http_version": b"HTTP/1.1"},
            request=request,
        )

    async def post(
        self,
        url: str,
        fields: bytes,
        body: bytes,
        timeouts: dict[str, float | None],
        on_wire: Callable[[bool], None] | None = None,
    ) -> UpstreamResponse:
        """``POST url`` with ``fields`` (``name: value\r\n`` lines, no Host or
        Content-Length) and ``body``, without building an ``httpx.Request``: the
        proxied request's head is written from the client's raw header bytes.
        ``on_wire(True)`` is called once the request is on the wire, and
        ``on_wire(False)`` if that write was lost on a keep-alive connection the server
        had closed, before it is sent again on a fresh one."""
        target = _target(url)
        if target is None:
            extensions: dict[str, object] = {"timeout": timeouts}
            if on_wire is not None:
                extensions["trace"] = _on_body_sent(on_wire)
            request = httpx.Request(
                "POST", url, content=body, headers=_parse_fields(fields), extensions=extensions
            )
            response = await self._via_tls(request)
            return UpstreamResponse(
                response.status_code, response.headers.raw, _HttpxBody(response)
            )
        origin, host, path = target
        head = b"".join(
            (
                b"POST ",
                path,
                b" HTTP/1.1\r\nhost: ",
                host,
                b"\r\ncontent-length: ",
                str(len(body)).encode(),
                b"\r\n",
                fields,
                b"\r\n",
            )
        )
        conn = await self._exchange(origin, head, body, timeouts, on_wire)
        return UpstreamResponse(conn.status, conn.headers, _Body(self, conn, timeouts.get("read")))

    async def _via_tls(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self._tls.handle_async_request(request)
        except httpx.ConnectError as exc:
            shortage = _local_shortage(exc)
            if shortage is None:
                raise
            raise GatewayOutOfResources(_describe(shortage)) from exc

    async def _exchange(
        self,
        origin: _Origin,
        head: bytes,
        body: bytes,
        timeouts: dict[str, float | None],
        on_wire: Callable[[bool], None] | None = None,
    ) -> _Connection:
        """Sends the request on a pooled connection; returns it once the head is in."""
        for attempt in range(2):
            conn = await self._acquire(origin, timeouts)
            reused = conn.used
            conn.used = True
            try:
                assert conn.transport is not None
                conn.transport.write(head + body if len(body) < 65536 else head)
                if len(body) >= 65536:
                    conn.transport.write(body)
                if on_wire is not None:
                    on_wire(True)
                while not conn.head_done:
                    await conn.wait(timeouts.get("read"))
            except httpcore.RemoteProtocolError as exc:
                self._discard(conn)
                if reused and not conn.received and attempt == 0:
                    # The server closed a keep-alive connection: the write was lost.
                    if on_wire is not None:
                        on_wire(False)
                    continue  # once more, fresh
                raise httpx.RemoteProtocolError(str(exc)) from exc
            except httpcore.ReadTimeout as exc:
                self._discard(conn)
                raise httpx.ReadTimeout(str(exc)) from exc
            except BaseException:
                self._discard(conn)
                raise
            return conn
        raise AssertionError("unreachable")

    async def _acquire(self, origin: _Origin, timeouts: dict[str, float | None]) -> _Connection:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()  # most recently used: the warmest
            conn.idle = False
            if not conn.closed:
                conn._reset()
                return conn
            self._discard(conn)
        while self._open >= self._max:
            self._purge_closed()
            self._evict_idle()
            if self._open < self._max:
                break
            await self._wait_for_room(timeouts.get("pool"))
            idle = self._idle.get(origin)
            if idle:
                return await self._acquire(origin, timeouts)
        self._open += 1
        try:
            return await self._connect(origin, timeouts.get("connect"))
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise

    async def _connect(self, origin: _Origin, connect_s: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(lambda: _Connection(origin), *origin)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {origin[0]}:{origin[1]} timed out") from exc
        except OSError as exc:
            local = exc.errno in _LOCAL_SHORTAGES
            raise (GatewayOutOfResources if local else httpx.ConnectError)(_describe(exc)) from exc
        return conn

    async def _wait_for_room(self, pool_s: float | None) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(pool_s):
                await waiter
        except BaseException as exc:
            # Woken, then cancelled before it ran (its client left, or its timeout fell due
            # in the same turn): the room it was given goes on to the next waiter, which
            # would otherwise wait for a free slot until its own pool timeout.
            if waiter.done() and not waiter.cancelled():
                self._wake_one()
            if isinstance(exc, TimeoutError):
                message = "no upstream connection free within the pool timeout"
                raise httpx.PoolTimeout(message) from exc
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _release(self, conn: _Connection) -> None:
        if conn.reusable() and self._open <= self._max:
            conn.idle = True
            conn.idle_since = conn.loop.time()
            self._idle.setdefault(conn.origin, deque()).append(conn)
        else:
            self._discard(conn)
            return
        self._wake_one()

    def _discard(self, conn: _Connection, wake: bool = True) -> None:
        conn.close()
        if conn.counted:
            conn.counted = False
            self._open -= 1
            if wake and self._open < self._max:  # over a lowered bound, no room yet
                self._wake_one()

    def _purge_closed(self) -> None:
        for idle in self._idle.values():
            for conn in [c for c in idle if c.closed]:
                idle.remove(conn)
                self._discard(conn)

    def _evict_idle(self) -> None:
        """The pool is full: one idle connection, to whichever origin, makes room. Those
        to a backend nobody calls any more (a reload removed or re-addressed it) would
        otherwise hold their slots until the backend closes them."""
        oldest = min(
            (idle for idle in self._idle.values() if idle),
            key=lambda idle: idle[0].idle_since,
            default=None,
        )
        if oldest is not None:
            self._discard(oldest.popleft(), wake=False)  # the caller takes the room

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        await self._tls.aclose()


def _on_body_sent(on_wire: Callable[[bool], None]) -> Callable[[str, dict], Awaitable[None]]:
    """httpcore's ``trace`` hook, calling ``on_wire(True)`` once the body has been sent."""

    async def trace(event: str, info: dict) -> None:
        if event.endswith(".send_request_body.complete"):
            on_wire(True)

    return trace


@functools.lru_cache(maxsize=1024)
def _target(url: str) -> tuple[_Origin, bytes, bytes] | None:
    """(origin, Host value, request target) of a plain-HTTP URL; None for any other scheme."""
    parsed = httpx.URL(url)
    if parsed.scheme != "http":
        return None
    port = parsed.port or 80
    host = parsed.raw_host + (b":%d" % parsed.port if parsed.port else b"")
    return (parsed.host, port), host, parsed.raw_path


def _describe(exc: OSError) -> str:
    return f"[Errno {exc.errno}] {exc.strerror}"


def _parse_fields(fields: bytes) -> list[tuple[bytes, bytes]]:
    pairs = []
    for line in fields.split(b"\r\n"):
        if line:
            name, _, value = line.partition(b":")
            pairs.append((name.strip(), value.strip()))
    return pairs


def _head(request: httpx.Request) -> bytes:
    target = request.url.raw_path
    lines = [request.method.encode(), b" ", target, b" HTTP/1.1\r\n"]
    for name, value in request.headers.raw:
        lines += [name, b": ", value, b"\r\n"]
    lines.append(b"\r\n")
    return b"".join(lines)
