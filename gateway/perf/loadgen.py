"""A closed-loop HTTP/1.1 load generator on raw asyncio protocols (uvloop when installed).

Each client owns one keep-alive connection and sends the same pre-built request
again as soon as the previous answer ended. Responses are de-chunked and split
into SSE events incrementally; an event's arrival time is the time of the socket
read that completed it, so TTFT (first event carrying content) and inter-event
gaps are what a client on this machine sees. Counting windows are exact:
events and completions are counted only when they happen inside [t0, t1).
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

# A non-empty content delta: the role-only first chunk carries "content":"".
OUTPUT = re.compile(rb'"(?:content|reasoning_content|text)":"(?!")')


def build_request(host: str, port: int, body: bytes, path: str = "/v1/chat/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


@dataclass
class Window:
    """What one phase counts; ``t0``/``t1`` bound the counted interval (perf_counter)."""

    t0: float
    t1: float
    completed: int = 0  # responses that ended inside the window
    events: int = 0  # SSE events that arrived inside the window
    errors: int = 0
    statuses: dict[str, int] = field(default_factory=dict)  # errors by status or cause
    ttft: list[float] = field(default_factory=list)  # requests started inside the window
    itl: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    first_outputs: int = 0  # streams that have received their first content event
    all_open: asyncio.Event | None = None
    hold_target: int = 0

    def inside(self, t: float) -> bool:
        return self.t0 <= t < self.t1

    def error(self, cause: str) -> None:
        self.errors += 1
        self.statuses[cause] = self.statuses.get(cause, 0) + 1


class Exchange:
    """The response to one request, parsed as it arrives."""

    __slots__ = ("done", "events", "first", "gaps", "last", "sent", "status", "tail")

    def __init__(self, sent: float, done: asyncio.Future[None]) -> None:
        self.sent = sent
        self.done = done
        self.status = 0
        self.first: float | None = None
        self.last = 0.0
        self.gaps: list[float] = []
        self.events = 0
        self.tail = b""


_HEAD, _LENGTH, _SIZE, _DATA, _END = range(5)


class ClientProtocol(asyncio.Protocol):
    def __init__(self, window: Window) -> None:
        self.window = window
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.state = _HEAD
        self.need = 0
        self.exchange: Exchange | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.exchange is not None and not self.exchange.done.done():
            self.exchange.done.set_exception(ConnectionError("connection closed mid-response"))
        if not self.closed.done():
            self.closed.set_result(None)

    def send(self, request: bytes) -> Exchange:
        assert self.transport is not None, "connection is closed"
        loop = asyncio.get_running_loop()
        self.exchange = Exchange(time.perf_counter(), loop.create_future())
        self.state = _HEAD
        self.transport.write(request)
        return self.exchange

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        buf = self.buf
        buf += data
        exchange = self.exchange
        if exchange is None:
            return
        while True:
            state = self.state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(buf[:end]).lower()
                del buf[: end + 4]
                exchange.status = int(head[9:12])
                if b"transfer-encoding: chunked" in head:
                    self.state = _SIZE
                else:
                    at = head.find(b"content-length:")
                    stop = head.find(b"\r\n", at)
                    self.need = int(head[at + 15 : stop if stop >= 0 else len(head)])
                    self.state = _LENGTH
            elif state == _LENGTH:
                if len(buf) < self.need:
                    return
                del buf[: self.need]
                self._finish(exchange, now)
                return
            elif state == _SIZE:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                self.need = int(bytes(buf[:end]).split(b";")[0], 16)
                del buf[: end + 2]
                self.state = _DATA if self.need else _END
            elif state == _DATA:
                if len(buf) < self.need + 2:
                    return
                self._body(exchange, bytes(buf[: self.need]), now)
                del buf[: self.need + 2]
                self.state = _SIZE
            else:  # _END: the empty trailer line after the last chunk
                if len(buf) < 2:
                    return
                del buf[:2]
                self._finish(exchange, now)
                return

    def _body(self, exchange: Exchange, data: bytes, now: float) -> None:
        events = (exchange.tail + data).split(b"\n\n") if exchange.tail else data.split(b"\n\n")
        exchange.tail = events.pop()
        if not events:
            return
        exchange.events += len(events)
        window = self.window
        if window.inside(now):
            window.events += len(events)
        for event in events:
            if OUTPUT.search(event) is None:
                continue
            if exchange.first is None:
                exchange.first = now
                window.first_outputs += 1
                if window.all_open is not None and window.first_outputs >= window.hold_target:
                    window.all_open.set()
            else:
                exchange.gaps.append(now - exchange.last)
            exchange.last = now

    def _finish(self, exchange: Exchange, now: float) -> None:
        self.exchange = None
        window = self.window
        if exchange.status != 200:
            window.error(str(exchange.status))
        elif window.inside(now):
            window.completed += 1
        if window.inside(exchange.sent) and exchange.status == 200:
            window.latency.append(now - exchange.sent)
            if exchange.first is not None:
                window.ttft.append(exchange.first - exchange.sent)
                window.itl.extend(exchange.gaps)
        exchange.done.set_result(None)


async def connect(host: str, port: int, window: Window) -> ClientProtocol:
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_connection(lambda: ClientProtocol(window), host, port)
    return protocol


async def run_client(host: str, port: int, request: bytes, window: Window, stop_at: float) -> None:
    """One closed-loop client: ``request`` back to back on one connection until ``stop_at``."""
    protocol: ClientProtocol | None = None
    try:
        while time.perf_counter() < stop_at:
            if protocol is None or protocol.transport is None:
                protocol = await connect(host, port, window)
            exchange = protocol.send(request)
            try:
                await exchange.done
            except ConnectionError:
                window.error("connection closed")
                protocol = None
    finally:
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()


def hold_window(streams: int) -> Window:
    """A window for :func:`open_streams`: its ``all_open`` is set once ``streams`` have content."""
    return Window(t0=0.0, t1=float("inf"), all_open=asyncio.Event(), hold_target=streams)


async def open_streams(
    host: str, port: int, request: bytes, window: Window, protocols: list[ClientProtocol]
) -> None:
    """Open ``window.hold_target`` streaming requests; return once each has received content.

    Connections land in ``protocols`` as they open, so a caller that gives up waiting
    can still count and release them.
    """
    streams = window.hold_target
    batch = 200  # stay well under the listen backlog while connecting
    for offset in range(0, streams, batch):
        opened = await asyncio.gather(
            *(connect(host, port, window) for _ in range(min(batch, streams - offset)))
        )
        for protocol in opened:
            protocol.send(request)
        protocols += opened
    assert window.all_open is not None
    await window.all_open.wait()


async def release(protocols: list[ClientProtocol]) -> None:
    for protocol in protocols:
        if protocol.transport is not None:
            protocol.transport.close()
    await asyncio.gather(*(p.closed for p in protocols))
    for protocol in protocols:  # held exchanges end with the close: nothing to report
        if protocol.exchange is not None and protocol.exchange.done.done():
            protocol.exchange.done.exception()
