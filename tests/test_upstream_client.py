"""The gateway's shared upstream client never carries one caller's cookies to another."""

from __future__ import annotations

import asyncio

import pytest

from gateway.app import build_client
from gateway.settings import build_settings

pytestmark = pytest.mark.anyio


class CookieEcho(asyncio.Protocol):
    """Answers every request with a Set-Cookie and the Cookie header it received."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
            cookie = b""
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"cookie":
                    cookie = value.strip()
            body = b"cookie=" + cookie
            self.transport.write(  # type: ignore[attr-defined]
                b"HTTP/1.1 200 OK\r\nset-cookie: session=secret; Path=/\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )


async def test_backend_cookies_are_not_replayed() -> None:
    server = await asyncio.get_running_loop().create_server(CookieEcho, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        client = build_client(build_settings({}))
        async with client:
            first = await client.get(f"http://127.0.0.1:{port}/")
            assert first.headers["set-cookie"].startswith("session=")
            second = await client.get(f"http://127.0.0.1:{port}/")
            assert second.text == "cookie="
            assert len(client.cookies) == 0
