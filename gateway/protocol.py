"""uvicorn's httptools protocol, stamping when a request's first bytes were read, and
refusing request heads too large to be honest."""

from __future__ import annotations

import json
import time

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


class GatewayProtocol(HttpToolsProtocol):
    _head_bytes = 0  # bytes of earlier reads while the head was incomplete
    _read = 0  # bytes of the read being parsed
    _heading = False  # a request's head is being read
    _head_too_large = False

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
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        self._read = len(data)
        super().data_received(data)
        # A head still not whole after a read is counted there, so one that never ends
        # is held to at most one read past the limit.
        if self._heading:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES and self.transport is not None:
                self._heading = False
                self.transport.write(_TOO_LARGE)
                self.transport.close()

    def send_400_response(self, msg: str) -> None:
        if not self._head_too_large:
            super().send_400_response(msg)
            return
        self.transport.write(_TOO_LARGE)
        self.transport.close()
