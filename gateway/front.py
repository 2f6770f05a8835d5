"""The gateway's ASGI entry: proxied requests go straight to their handler.

The three proxied endpoints carry all the traffic, and Starlette's stack in
front of a handler (error middleware, request-id middleware, exception
middleware, router, request/response wrapper, each with its own ``send``
wrapper) cost about a third of a short proxied request's CPU. So ``Front``
takes ``POST`` on those paths itself, as a plain ASGI callable, and does what
that stack did for them: the request id, CORS headers (``gateway/cors.py``),
OpenAI-style errors rendered once, a 500 in the same shape for anything unexpected.
Everything else (models, health, admin, metrics, preflights, wrong methods, unknown
paths, lifespan) goes to Starlette.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Mapping, Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.cors import RawHeaders, origin_rules, with_cors
from gateway.disconnect import DisconnectWatch
from gateway.drain import DRAIN_STATE_KEY
from gateway.errors import (
    GatewayError,
    InternalError,
    PayloadTooLarge,
    Unauthorized,
    Unavailable,
    openai_error_response,
)
from gateway.middleware import StampedSend, request_id_from
from gateway.payload import REQUIRED_FIELD, parse_payload
from gateway.protocol import ARRIVED_SCOPE_KEY, PIPELINED_SCOPE_KEY
from gateway.proxy import ProxyRequest, proxy
from gateway.runtime import Runtime

log = logging.getLogger("kneecap")

PROXIED_PATHS = frozenset(REQUIRED_FIELD)


class Front:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in PROXIED_PATHS and scope["method"] == "POST":
            await serve_proxied(scope, receive, send)
        else:
            await self.app(scope, receive, send)


class ProxiedEndpoint:
    """The same handler as a Starlette route's ASGI app, so the router knows the paths
    (and answers 405 to other methods on them)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_proxied(scope, receive, send)


class Reply(StampedSend):
    """The client's ``send``, stamped with the request id; notes when the response is
    complete, after which a disconnect is the client being done, not leaving."""

    __slots__ = ("started", "watch")

    def __init__(self, send: Send, request_id: str) -> None:
        super().__init__(send, request_id)
        self.watch: DisconnectWatch | None = None
        self.started = False

    def __call__(self, message: Message) -> Awaitable[None]:
        if message["type"] == "http.response.start":
            self.started = True
        elif not message.get("more_body", False) and self.watch is not None:
            self.watch.finished = True
        return super().__call__(message)


class CorsReply(Reply):
    """A reply to a request that named an ``Origin``: its start carries the gateway's CORS
    headers. A class of its own, so a reply to one without costs not even the check."""

    __slots__ = ("cors",)

    def __init__(self, send: Send, request_id: str, cors: RawHeaders) -> None:
        super().__init__(send, request_id)
        self.cors = cors

    def __call__(self, message: Message) -> Awaitable[None]:
        if message["type"] == "http.response.start":
            message["headers"] = with_cors(message.get("headers", ()), self.cors)
        return super().__call__(message)


def _drain_over(scope: Scope) -> bool:
    drain = scope["state"].get(DRAIN_STATE_KEY)
    return drain is not None and drain.stopped


def header_map(raw: Sequence[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's headers by name (lower case, as uvicorn gives them), the first of
    repeated ones, like ``Headers.get``: built in one pass, where each lookup in
    Starlette's ``Headers`` scans and decodes the whole list again.

    Repeated ``Connection`` lines are one list (RFC 9110 §5.3), joined: every header
    any of them names is hop-by-hop, and must not reach the backend."""
    headers: dict[str, str] = {}
    for name, value in raw:
        key = name.decode("latin-1")
        if key not in headers:
            headers[key] = value.decode("latin-1")
        elif key == "connection":
            headers[key] += ", " + value.decode("latin-1")
    return headers


def bearer(headers: Mapping[str, str]) -> str | None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def client_priority(runtime: Runtime, headers: Mapping[str, str]) -> str:
    """The caller's priority class; 401 unless the key is accepted."""
    priority = runtime.current.client_priority(bearer(headers))
    if priority is None:
        raise Unauthorized("Incorrect or missing API key.")
    return priority


async def read_body(receive: Receive, headers: Mapping[str, str], limit: int) -> bytes | None:
    """The whole request body, or None when the client hung up while sending it."""
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def serve_proxied(scope: Scope, receive: Receive, send: Send) -> None:
    # TTFT and e2e start when the request's first bytes were read, not when this task ran.
    received = scope.get(ARRIVED_SCOPE_KEY) or time.perf_counter()
    headers = header_map(scope["headers"])
    request_id = request_id_from(headers.get("x-request-id"))
    runtime: Runtime = scope["state"]["runtime"]
    origin = headers.get("origin")
    if origin is None:
        reply = Reply(send, request_id)
    else:
        cors = origin_rules(runtime.current.settings.cors).headers(origin)
        reply = CorsReply(send, request_id, cors)
    endpoint = scope["path"]
    try:
        key_priority = client_priority(runtime, headers)
        body = await read_body(receive, headers, runtime.current.settings.max_body_bytes)
        if body is None:
            return  # nobody to answer
        payload = parse_payload(body, endpoint)
    except GatewayError as error:
        await openai_error_response(error)(scope, receive, reply)
        return
    request = ProxyRequest(
        endpoint=endpoint,
        payload=payload,
        body=body,
        headers=headers,
        raw_headers=scope["headers"],
        request_id=request_id,
        started=received,
        key_priority=key_priority,
    )
    watch = reply.watch = runtime.disconnects.watch(receive)
    try:
        try:
            response = await proxy(runtime, request, scope.get(PIPELINED_SCOPE_KEY, 0.0))
        except GatewayError as error:
            response = openai_error_response(error)
        await response(scope, receive, reply)
    except asyncio.CancelledError:
        if watch.left:
            asyncio.current_task().uncancel()  # type: ignore[union-attr]  # nobody is listening
        elif not reply.started and _drain_over(scope):
            # uvicorn cancels what still runs STOP_GRACE_S after the drain's end: a request
            # still awaiting its backend hears what a refused one does, and may retry.
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            error = Unavailable("the gateway is shutting down", code="shutting_down")
            await openai_error_response(error)(scope, receive, reply)
        else:
            raise
    except Exception:
        if reply.started:
            raise
        log.exception("request %s failed", request_id)
        await openai_error_response(InternalError())(scope, receive, reply)
    finally:
        watch.close()
