"""CORS for browser clients, answered as vLLM answers it (Starlette's ``CORSMiddleware``).

Everything Starlette serves, preflights of every path included (``OPTIONS`` never
reaches the proxied handler), goes through that middleware itself, rebuilt when a
reload brings a new ``cors:`` block. The proxied ``POST``s skip Starlette's stack
(``gateway/front.py``), so the headers it puts on an actual response are computed
here too, and only for a request that names an ``Origin``: one without pays a dict
lookup.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import InvalidRequest, openai_error_response
from gateway.settings import CorsConfig

RawHeaders = list[tuple[bytes, bytes]]

_VARY_ORIGIN = (b"vary", b"Origin")
_ANY_ORIGIN = (b"access-control-allow-origin", b"*")
_CREDENTIALS = (b"access-control-allow-credentials", b"true")


class OriginRules:
    """What one ``cors:`` block adds to an actual response for a request's ``Origin``,
    as ``CORSMiddleware.send`` does: ``Vary: Origin`` always; the origin echoed when
    credentials are allowed or only some origins are, ``*`` when any is without them;
    nothing for an origin not allowed, which the browser then refuses."""

    __slots__ = ("any_origin", "credentials", "exposed", "origins")

    def __init__(self, config: CorsConfig) -> None:
        self.any_origin = "*" in config.allowed_origins
        self.origins = frozenset(config.allowed_origins)
        self.credentials = config.allow_credentials
        exposed = ", ".join(config.expose_headers).encode("latin-1")
        self.exposed = [(b"access-control-expose-headers", exposed)] if exposed else []

    def headers(self, origin: str) -> RawHeaders:
        added = [_VARY_ORIGIN, *self.exposed]
        if self.credentials:
            added.append(_CREDENTIALS)
        if self.any_origin and not self.credentials:
            added.append(_ANY_ORIGIN)
        elif self.any_origin or origin in self.origins:
            added.append((b"access-control-allow-origin", origin.encode("latin-1")))
        return added

    def for_refusal(self, origin: str) -> RawHeaders:
        """For an answer the HTTP protocol writes itself (``gateway/protocol.py``): the
        headers only for an allowed origin. A refused one gets none, where the app's answers
        get ``Vary`` and the exposed headers: the browser hides the answer either way, and
        these carry no freshness, so no cache keeps them for another origin."""
        if self.any_origin or origin in self.origins:
            return self.headers(origin)
        return []


def request_origin(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The first ``Origin`` among a request's raw headers (names in lower case, as uvicorn
    keeps them), as ``front.header_map`` takes it."""
    for name, value in headers:
        if name == b"origin":
            return value.decode("latin-1")
    return None


@functools.lru_cache(maxsize=8)
def origin_rules(config: CorsConfig) -> OriginRules:
    return OriginRules(config)


def with_cors(headers: Iterable[tuple[bytes, bytes]], added: RawHeaders) -> RawHeaders:
    """A proxied response's headers with the gateway's CORS answer in place of any the
    backend gave: it saw the same ``Origin``, but answered by its own policy, and a
    backend allowing every origin would undo a gateway that allows a few."""
    kept = [h for h in headers if not h[0].lower().startswith(b"access-control-")]
    if _varies_by_origin(kept):
        added = [h for h in added if h is not _VARY_ORIGIN]
    kept += added
    return kept


def _varies_by_origin(headers: RawHeaders) -> bool:
    for name, value in headers:
        if name.lower() == b"vary" and any(
            token.strip().lower() == b"origin" for token in value.split(b",")
        ):
            return True
    return False


class _Cors(CORSMiddleware):
    """Starlette's CORS, a refused preflight answered in the gateway's error shape."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        cors = {
            name: value
            for name, value in response.headers.items()
            if name not in ("content-length", "content-type")
        }
        reason = bytes(response.body).decode()  # "Disallowed CORS origin, method", ...
        return openai_error_response(InvalidRequest(reason, code="cors_disallowed", headers=cors))


class LiveCors:
    """Starlette's CORS middleware in front of ``app``, per the live settings.

    Outside Starlette's own stack, so that its 500 for an unexpected failure (answered
    by its outermost middleware) carries the headers too: a browser shown no
    ``Access-Control-Allow-Origin`` reports a CORS failure, not the error.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._config: CorsConfig | None = None
        self._middleware: ASGIApp = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        config = scope["state"]["runtime"].current.settings.cors
        if config is not self._config:  # the first request, or the first after a reload
            self._middleware = _Cors(
                self.app,
                allow_origins=config.allowed_origins,
                allow_methods=config.allowed_methods,
                allow_headers=config.allowed_headers,
                allow_credentials=config.allow_credentials,
                expose_headers=config.expose_headers,
            )
            self._config = config
        await self._middleware(scope, receive, send)
