"""A real :class:`GatewayProtocol` on a real loopback connection, in the test's own loop.

For tests that must reach the protocol object itself (feed it reads, call its own
writes): the test gets the protocol, and a reader and writer on the client side.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from gateway.protocol import GatewayProtocol


@contextlib.asynccontextmanager
async def protocol_server(
    app: Any, app_state: dict[str, Any] | None = None
) -> AsyncIterator[tuple[GatewayProtocol, asyncio.StreamReader, asyncio.StreamWriter]]:
    config = uvicorn.Config(app=app, http=GatewayProtocol, log_level="critical")
    config.load()
    state = ServerState()
    made: asyncio.Future[GatewayProtocol] = asyncio.get_running_loop().create_future()

    def factory() -> GatewayProtocol:
        protocol = GatewayProtocol(config=config, server_state=state, app_state=app_state or {})
        if not made.done():
            made.set_result(protocol)
        return protocol

    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield await asyncio.wait_for(made, 5), reader, writer
    finally:
        writer.close()
        server.close()
