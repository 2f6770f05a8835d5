"""The floor: a byte-level TCP forwarder with no HTTP at all, pinned where the gateway runs.

Latency the gateway adds includes what any extra hop costs on this machine: two
more socket writes and reads per event, and waking an idle core. Measured
through this forwarder, that floor is subtracted out of the gateway's figures:
what remains is the gateway's own work.

    python -m gateway.perf.tcp_relay --port 8200 --upstream-port 8100
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable

from gateway.perf.backend import run


class _Pipe(asyncio.Protocol):
    """One direction's reader; writes what it reads to its peer's transport."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self.pending: list[bytes] = []
        self.attaching: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:
            self.pending.append(data)  # the upstream connection is not up yet

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


def _factory(host: str, port: int) -> Callable[[], _Pipe]:
    loop = asyncio.get_running_loop()

    def make() -> _Pipe:
        client = _Pipe()

        async def attach() -> None:
            _, upstream = await loop.create_connection(_Pipe, host, port)
            upstream.peer, client.peer = client, upstream
            for data in client.pending:
                upstream.transport.write(data)  # type: ignore[union-attr]
            client.pending.clear()

        client.attaching = loop.create_task(attach())  # referenced until it ran
        return client

    return make


async def serve(port: int, upstream_port: int, host: str = "127.0.0.1") -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_factory(host, upstream_port), host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream-port", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        run(serve(args.port, args.upstream_port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
