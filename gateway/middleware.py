"""Pure ASGI middleware (streams pass straight through, never buffered)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Awaitable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A random per-process prefix and a counter: unique like a UUID4's hex, without a
# urandom call and a UUID object per request.
_ID_PREFIX = os.urandom(8).hex()
_id_counter = itertools.count()


def new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_id_counter):016x}"


class RequestIdMiddleware:
    """Propagates the client's ``X-Request-ID`` or makes one, and returns it (the proxied
    endpoints do the same in ``gateway/front.py``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = ""
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                request_id = value.decode("latin-1")[:128]
                break
        request_id = request_id or new_request_id()
        encoded = request_id.encode("latin-1")

        # A plain function handing back send's awaitable: no coroutine of its own per
        # body chunk, only the start message is looked at.
        def send_with_id(message: Message) -> Awaitable[None]:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                headers.append((b"x-request-id", encoded))
                message["headers"] = headers
            return send(message)

        await self.app(scope, receive, send_with_id)
