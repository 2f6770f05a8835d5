"""A proxied request's answer as the relay reads it, whichever transport brought it.

The plain-HTTP body reads straight from its pooled connection and gives it back when
closed; the ``https://`` one wraps httpx's response behind the same interface.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import httpcore
import httpx

from gateway.upstream_connection import Connection

if TYPE_CHECKING:
    from gateway.upstream import UpstreamTransport


class PooledBody(httpx.AsyncByteStream):
    def __init__(self, pool: UpstreamTransport, conn: Connection, read_timeout: float | None):
        self._pool = pool
        self._conn = conn
        self._read_timeout = read_timeout
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        try:
            while True:
                if conn.chunks:
                    yield conn.take()
                elif conn.complete:
                    return
                else:
                    await conn.wait(self._read_timeout)
        except httpcore.ReadTimeout as exc:
            raise httpx.ReadTimeout(str(exc)) from exc
        except httpcore.RemoteProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc)) from exc
        except httpcore.ReadError as exc:
            raise httpx.ReadError(str(exc)) from exc

    def close_nowait(self) -> bool:
        """Gives the connection back (to the pool, or closed) at once; never waits."""
        if not self._released:
            self._released = True
            self._pool.release(self._conn)
        return True

    async def aclose(self) -> None:
        self.close_nowait()


class HttpxBody:
    """An ``httpx.Response``'s body (the ``https://`` path) behind the same interface."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._response.aiter_raw()

    def close_nowait(self) -> bool:
        return False  # httpx's close must be awaited

    async def aclose(self) -> None:
        await self._response.aclose()


class UpstreamResponse:
    """A proxied request's answer: status, raw headers, and the body as it arrives.

    Lighter than ``httpx.Response`` (no header parsing, no decoder and chunker
    generators around each body chunk), which the relay pays for per token.
    """

    __slots__ = ("_body", "raw_headers", "status_code")

    def __init__(
        self, status_code: int, raw_headers: list[tuple[bytes, bytes]], body: PooledBody | HttpxBody
    ) -> None:
        self.status_code = status_code
        self.raw_headers = raw_headers
        self._body = body

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return self._body.__aiter__()

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self._body])

    def close_nowait(self) -> bool:
        """Closes the body now when that needs no waiting (the plain-HTTP path)."""
        return self._body.close_nowait()

    async def aclose(self) -> None:
        await self._body.aclose()
