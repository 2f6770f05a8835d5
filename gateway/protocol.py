"""uvicorn's httptools protocol, stamping when a request's first bytes were read,
refusing request heads too large to be honest, and writing a response's head with
the bytes that follow it."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

ARRIVED_SCOPE_KEY = "kneecap.arrived"
# httptools buffers a head of any size; a client must not make the gateway hold megabytes
# of headers per connection. 64 KiB is above what real clients send (Envoy's default limit
# is 60 KiB, nginx's 32 KiB).
MAX_HEAD_BYTES = 64 * 1024

_TOO_LARGE_BODY = json.dumps(
    {
        "error": {
            "message": f"request line and headers exceed {MAX_HEAD_BYTES} bytes",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_header_fields_too_large",
        }
    }
).encode()
_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_TOO_LARGE_BODY), _TOO_LARGE_BODY)
)


class _HeadTooLarge(Exception):
    pass


class HeadWithBody:
    """The transport a response is written through: its first write (the head) waits
    for the next one, made in the same step, so both leave in one system call.

    uvicorn writes a response's head and its body separately, and uvloop sends each
    write at once: two sends, each a trip through the loopback stack, for every
    whole answer. Held past the current step the head is sent alone (a stream's
    first event comes later), so nothing waits longer than one turn of the loop.
    While it is held, the protocol's own writes (a 400 for a bad pipelined request,
    a close) send it first: ``protocol.held_head`` names it.
    """

    __slots__ = ("_held", "_holding", "_loop", "_protocol", "_transport")

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        protocol: GatewayProtocol,
    ) -> None:
        self._transport = transport
        self._loop = loop
        self._protocol = protocol
        self._held: bytes | None = None
        self._holding = True  # only the first write is held

    def write(self, data: bytes) -> None:
        if self._holding:
            self._holding = False
            self._held = data
            self._protocol.held_head = self
            self._loop.call_soon(self.flush)
            return
        held = self._held
        if held is not None:
            self._release()
            self._transport.writelines((held, data))  # one writev
            return
        self._transport.write(data)

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._release()
            if not self._transport.is_closing():  # closed meanwhile: the client is gone
                self._transport.write(held)

    def _release(self) -> None:
        self._held = None
        if self._protocol.held_head is self:
            self._protocol.held_head = None

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        self.flush()  # whatever else is asked of the transport comes after the head
        return getattr(self._transport, name)


class GatewayProtocol(HttpToolsProtocol):
    _head_bytes = 0  # bytes of earlier reads while the head was incomplete
    _read = 0  # bytes of the read being parsed
    _heading = False  # a request's head is being read
    _head_too_large = False
    held_head: HeadWithBody | None = None  # a response head waiting for its body

    def flush_held_head(self) -> None:
        """Before the protocol writes or closes on its own: the held head goes first."""
        if self.held_head is not None:
            self.held_head.flush()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._heading = True
        self._head_bytes = 0
        self.scope[ARRIVED_SCOPE_KEY] = time.perf_counter()  # type: ignore[typeddict-unknown-key]

    def on_headers_complete(self) -> None:
        self._heading = False
        # The head is within the bytes read for it: measured only when those could exceed
        # the limit (a callback per header cost the request path more than the check).
        if self._head_bytes + self._read > MAX_HEAD_BYTES:
            size = len(self.url) + sum(len(name) + len(value) for name, value in self.headers)
            if size > MAX_HEAD_BYTES:
                self._head_too_large = True
                raise _HeadTooLarge  # httptools makes it a parser error: uvicorn's 400 path
        previous = self.cycle
        super().on_headers_complete()
        if self.cycle is not previous:  # the same: an upgrade, which uvicorn handles itself
            self.cycle.transport = HeadWithBody(self.transport, self.loop, self)  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._read = len(data)
        super().data_received(data)
        # A head still not whole after a read is counted there, so one that never ends
        # is held to at most one read past the limit.
        if self._heading:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES and self.transport is not None:
                self._heading = False
                self.flush_held_head()
                self.transport.write(_TOO_LARGE)
                self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self.flush_held_head()
        if not self._head_too_large:
            super().send_400_response(msg)
            return
        self.transport.write(_TOO_LARGE)
        self.transport.close()

    def handle_websocket_upgrade(self) -> None:
        self.flush_held_head()
        super().handle_websocket_upgrade()

    def shutdown(self) -> None:
        self.flush_held_head()
        super().shutdown()

    def timeout_keep_alive_handler(self) -> None:
        self.flush_held_head()
        super().timeout_keep_alive_handler()
