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
import functools
from collections import deque
from collections.abc import Awaitable, Callable

import httpcore
import httpx

from gateway.overload import (
    LOCAL_SHORTAGES,
    GatewayOutOfResources,
    describe,
    local_shortage,
    overload_warning,
)
from gateway.upstream_connection import Connection, Origin
from gateway.upstream_response import HttpxBody, PooledBody, UpstreamResponse


class UpstreamTransport(httpx.AsyncBaseTransport):
    """Keep-alive HTTP/1.1 to plain-HTTP upstreams; ``max_connections`` bounds the pool."""

    def __init__(self, *, max_connections: int, tls: httpx.AsyncBaseTransport | None = None):
        self._max = max_connections  # a reload changes it: :meth:`resize`
        self._open = 0
        self._idle: dict[Origin, deque[Connection]] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._tls = tls or httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=max_connections)
        )
        # Every call through this pool that found the gateway short is warned of here:
        # throttled, as a burst of them would flood the log.
        self.overload_warning = overload_warning()

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
            stream=PooledBody(self, conn, timeouts.get("read")),
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
            return UpstreamResponse(response.status_code, response.headers.raw, HttpxBody(response))
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
        return UpstreamResponse(
            conn.status, conn.headers, PooledBody(self, conn, timeouts.get("read"))
        )

    async def _via_tls(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self._tls.handle_async_request(request)
        except httpx.ConnectError as exc:
            shortage = local_shortage(exc)
            if shortage is None:
                raise
            raise GatewayOutOfResources(describe(shortage)) from exc

    async def _exchange(
        self,
        origin: Origin,
        head: bytes,
        body: bytes,
        timeouts: dict[str, float | None],
        on_wire: Callable[[bool], None] | None = None,
    ) -> Connection:
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

    async def _acquire(self, origin: Origin, timeouts: dict[str, float | None]) -> Connection:
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

    async def _connect(self, origin: Origin, connect_s: float | None) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(lambda: Connection(origin), *origin)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {origin[0]}:{origin[1]} timed out") from exc
        except OSError as exc:
            local = exc.errno in LOCAL_SHORTAGES
            raise (GatewayOutOfResources if local else httpx.ConnectError)(describe(exc)) from exc
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

    def release(self, conn: Connection) -> None:
        if conn.reusable() and self._open <= self._max:
            conn.idle = True
            conn.idle_since = conn.loop.time()
            self._idle.setdefault(conn.origin, deque()).append(conn)
        else:
            self._discard(conn)
            return
        self._wake_one()

    def _discard(self, conn: Connection, wake: bool = True) -> None:
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
def _target(url: str) -> tuple[Origin, bytes, bytes] | None:
    """(origin, Host value, request target) of a plain-HTTP URL; None for any other scheme."""
    parsed = httpx.URL(url)
    if parsed.scheme != "http":
        return None
    port = parsed.port or 80
    host = parsed.raw_host + (b":%d" % parsed.port if parsed.port else b"")
    return (parsed.host, port), host, parsed.raw_path


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
