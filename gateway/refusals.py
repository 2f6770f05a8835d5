"""The answers the HTTP protocol (``gateway/protocol.py``) writes itself, before or
outside the app: OpenAI-shaped like the app's, with the CORS headers the app would give
the request's ``Origin``."""

from __future__ import annotations

import json
from typing import Any

from gateway.cors import RawHeaders, origin_rules, request_origin
from gateway.errors import InternalError
from gateway.settings import CorsConfig

# httptools buffers a head of any size; a client must not make the gateway hold megabytes
# of headers per connection. 64 KiB is above what real clients send (Envoy's default limit
# is 60 KiB, nginx's 32 KiB).
MAX_HEAD_BYTES = 64 * 1024
_DEFAULT_CORS = CorsConfig()


def refusal(status: bytes, message: str, code: str) -> bytes:
    """A whole answer the protocol writes itself, OpenAI-shaped like the app's, before closing."""
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    ).encode()
    return (
        b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (status, len(body), body)
    )


TOO_LARGE = refusal(
    b"431 Request Header Fields Too Large",
    f"request line and headers exceed {MAX_HEAD_BYTES} bytes",
    "request_header_fields_too_large",
)
HEAD_TIMEOUT = refusal(
    b"408 Request Timeout",
    "request line and headers not received in time",
    "request_timeout",
)

BODY_TIMEOUT = refusal(
    b"408 Request Timeout",
    "request body not received in time",
    "request_timeout",
)


def cors_for(request_headers: list[tuple[bytes, bytes]] | None, state: Any) -> RawHeaders:
    """The CORS headers the app would give the request, read from the live ``cors:``
    block, when it named an ``Origin`` that block allows; else none. Looked at only when
    the protocol answers itself: a request it does not refuse costs nothing.

    Only the headers the parser handed over are known, and httptools hands one over once
    the next begins (or the head ends). A head refused before its ``Origin`` came gets
    none (a 400 for its request line, a 408 for a head stalled before that line, a 431
    for one whose bytes ran past the limit first): guessing an origin would grant what
    the rules may refuse."""
    origin = request_origin(request_headers or ())  # None before a connection's first head
    if origin is None:
        return []
    runtime = state.get("runtime")  # the lifespan's state, once it started
    config = runtime.current.settings.cors if runtime is not None else _DEFAULT_CORS
    return origin_rules(config).for_refusal(origin)


def cors_added(answer: bytes, cors: RawHeaders) -> bytes:
    """One of the answers above with the CORS headers after its status line."""
    if not cors:
        return answer
    status, _, rest = answer.partition(b"\r\n")
    return b"%s\r\n%s%s" % (status, b"".join(b"%s: %s\r\n" % header for header in cors), rest)


# As the proxied endpoints answer what they did not expect (gateway/front.py).
INTERNAL_ERROR_BODY = InternalError().body()
INTERNAL_ERROR_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", b"%d" % len(INTERNAL_ERROR_BODY)),
    (b"connection", b"close"),  # as uvicorn's own 500: what failed may have left the stream bad
]
