"""Pure ASGI middleware (streams pass straight through, never buffered)."""

from __future__ import annotations

import os
from collections.abc import Awaitable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_SCOPE_KEY = "kneecap.request_id"


_ID_BYTES = 16
_IDS_PER_READ = 256
_random = bytearray()


def new_request_id() -> str:
    # Random, like vLLM's and OpenAI's: the ids reach clients (and vLLM builds its
    # completion ids from them), and a counter in them told any client how many
    # requests the gateway served between two of its own. The OS's randomness is read
    # for 256 ids at a time: a system call on every request's path cost ~5 us of it.
    global _random
    if not _random:
        _random = bytearray(os.urandom(_ID_BYTES * _IDS_PER_READ))
    taken = _random[-_ID_BYTES:]
    del _random[-_ID_BYTES:]
    return taken.hex()


def _forget_random() -> None:
    _random.clear()  # a forked child must not hand out its parent's next ids


os.register_at_fork(after_in_child=_forget_random)


def request_id_from(presented: str | None) -> str:
    """The client's ``X-Request-ID`` (at most 128 characters), or a new one."""
    return (presented or "")[:128] or new_request_id()


def request_id_of(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            return request_id_from(value.decode("latin-1"))
    return request_id_from(None)


class StampedSend:
    """``send`` that puts the request id on the response, replacing any the app set.

    A plain callable handing back send's awaitable: no coroutine of its own per body
    chunk, only the start message is looked at.
    """

    __slots__ = ("request_id", "send")

    def __init__(self, send: Send, request_id: str) -> None:
        self.send = send
        self.request_id = request_id.encode("latin-1")

    def __call__(self, message: Message) -> Awaitable[None]:
        if message["type"] == "http.response.start":
            headers = [h for h in message.get("headers", ()) if h[0].lower() != b"x-request-id"]
            headers.append((b"x-request-id", self.request_id))
            message["headers"] = headers
        return self.send(message)


class RequestIdMiddleware:
    """Propagates the client's ``X-Request-ID`` or makes one, and returns it (the proxied
    endpoints, which bypass this stack, do the same in ``gateway/front.py``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        # Calls the handler makes for the request (/tokenize) carry the id its client gets.
        scope[REQUEST_ID_SCOPE_KEY] = request_id  # type: ignore[typeddict-unknown-key]
        await self.app(scope, receive, StampedSend(send, request_id))
