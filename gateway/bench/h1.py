"""A lean HTTP/1.1 client for the load generator: asyncio protocols and httptools.

A load generator must read events faster than the target writes them, and a
simulator at ``--speed 20`` streams twenty times a GPU's tokens, tens of
thousands of SSE events a second. So the streaming path has no layers: the
connection's protocol hands each body chunk to the caller's sink straight from
``data_received``, where its arrival is also timed (no task wake-up or
generator chain between the socket and the clock). One request per connection
at a time; finished connections are kept for the next request (keep-alive),
bounded by ``max_connections``. Every failure leaves here as a
:class:`TransportError` with a short message for the user.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

BodySink = Callable[[bytes], None]


class TransportError(Exception):
    """The request got no complete answer; the message is one short line."""


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes  # the whole body, unless it was handed to a sink (status < 400)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; :meth:`begin` starts each exchange on it."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.begin(None)
        # Idle until the first request: no exchange is pending, so a close now (a
        # server dropping an unused pre-opened connection, or aclose) fails nothing.
        # A pending ``done`` here would take the close's error with nobody to await it.
        self.done.set_result(None)

    def begin(self, sink: BodySink | None) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.sink = sink
        self.streaming = False  # the body goes to the sink, not to ``chunks``
        self.chunks: list[bytes] = []
        self.status = 0
        self.keep_alive = False
        self.framed = False  # content-length or chunked: the close is not the end
        self.head_done = False
        self.received = False
        self.last_data = self.loop.time()
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.timer: asyncio.TimerHandle | None = None  # the stall watch

    # -- asyncio.Protocol -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        self.last_data = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(f"invalid HTTP response ({exc})")
        except Exception as exc:  # the sink raised: end this exchange, not the loop
            self.fail(f"{type(exc).__name__}: {exc}")

    def eof_received(self) -> bool:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        if self.done.done():
            return
        if self.head_done and not self.framed:
            self.on_message_complete()  # a body delimited by the close
        else:
            self.fail("the server closed the connection mid-response")

    # -- httptools callbacks ----------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-length" or lowered == b"transfer-encoding":
            self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True
        self.streaming = self.sink is not None and self.status < 400

    def on_body(self, body: bytes) -> None:
        if self.streaming:
            self.sink(body)  # type: ignore[misc]
        else:
            self.chunks.append(body)

    def on_message_complete(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    # -- used by the client -----------------------------------------------------

    def fail(self, message: str) -> None:
        if not self.done.done():
            self.done.set_exception(TransportError(message))
        self.close()

    def watch_stall(self, limit_s: float) -> None:
        """Fail when no byte came for ``limit_s``; re-arms itself, one timer per period."""
        if self.done.done():
            return
        quiet = self.loop.time() - self.last_data
        if quiet >= limit_s:
            self.fail(f"timed out: no data for {limit_s:g} s")
        else:
            self.timer = self.loop.call_later(limit_s - quiet, self.watch_stall, limit_s)

    def reusable(self) -> bool:
        return self.done.done() and self.keep_alive and not self.closed

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Client:
    """Requests to one origin (``http[s]://host:port``) over kept-alive connections."""

    def __init__(
        self,
        origin: str,
        *,
        headers: Mapping[str, str] | None = None,
        connect_timeout_s: float = 10.0,
        stall_timeout_s: float = 120.0,
        max_connections: int = 256,
    ) -> None:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"bad origin {origin!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        fixed = {"Host": parts.netloc, "User-Agent": "kneecap-bench", **(headers or {})}
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")
        self._connect_s = connect_timeout_s
        self._stall_s = stall_timeout_s
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Connection] = []

    async def request(
        self, method: str, path: str, body: bytes | None = None, sink: BodySink | None = None
    ) -> Reply:
        """One exchange; with ``sink``, a successful response's body goes there as it comes."""
        head = f"{method} {path} HTTP/1.1\r\n".encode("latin-1") + self._headers
        if body is not None:
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        message = head + b"\r\n" + (body or b"")
        async with self._slots:
            for attempt in range(2):
                conn = self._take_idle()
                reused = conn is not None
                if conn is None:
                    conn = await self._connect()
                conn.begin(sink)
                try:
                    assert conn.transport is not None
                    conn.transport.write(message)
                    stall = self._stall_s
                    conn.timer = conn.loop.call_later(stall, conn.watch_stall, stall)
                    try:
                        await conn.done
                    finally:
                        conn.timer.cancel()  # type: ignore[union-attr]
                except TransportError:
                    conn.close()
                    if reused and not conn.received and attempt == 0:
                        continue  # the server had closed a kept-alive connection: once more
                    raise
                except BaseException:  # cancelled mid-response: the connection is spent
                    conn.close()
                    raise
                if conn.reusable():
                    self._idle.append(conn)
                else:
                    conn.close()
                return Reply(conn.status, b"".join(conn.chunks))
        raise AssertionError("unreachable")

    async def preconnect(self, count: int) -> None:
        """Open connections until ``count`` are idle, so a burst of requests finds them ready.

        A burst that also had to connect would reach the server spread out by the
        handshakes, a spread a fast simulator multiplies into its own time.
        """
        self._idle = [conn for conn in self._idle if not conn.closed]
        missing = count - len(self._idle)
        if missing > 0:
            opened = await asyncio.gather(
                *(self._connect() for _ in range(missing)), return_exceptions=True
            )
            # A failure is left for the requests to meet and record.
            self._idle.extend(c for c in opened if isinstance(c, _Connection))

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()  # the most recently used
            if not conn.closed:
                return conn
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_s):
                _, conn = await loop.create_connection(
                    _Connection, self._host, self._port, ssl=self._ssl
                )
        except TimeoutError:
            raise TransportError(f"timed out connecting (after {self._connect_s:g} s)") from None
        except ssl.SSLError as exc:
            raise TransportError(f"TLS: {exc.reason or exc}") from None
        except OSError:
            raise TransportError("connection refused or unreachable") from None
        return conn

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
