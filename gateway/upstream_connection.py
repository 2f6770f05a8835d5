"""One keep-alive HTTP/1.1 connection to a plain-HTTP backend, as an ``asyncio`` protocol.

``httptools``' llhttp parser (uvicorn's) reads the answer as it arrives; body chunks are
buffered until the reader takes them (all at once), and the socket stops being read past
``HIGH_WATER`` bytes. One request at a time; the pool is :mod:`gateway.upstream`'s.
"""

from __future__ import annotations

import asyncio
from collections import deque

import httpcore
import httptools

Origin = tuple[str, int]
HIGH_WATER = 256 * 1024  # buffered body bytes before the socket stops being read


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; one request at a time."""

    def __init__(self, origin: Origin) -> None:
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
        if self.head_done:
            return  # a chunked body's trailer field (llhttp reports them here too): no header
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
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
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
