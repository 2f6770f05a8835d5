"""A backend whose answer to each POST is a script the request itself carries.

Run as ``python -m tests.raw_sse_backend --port P``. The request body's ``raw_script``
lists steps, run in order on the request's connection:

- ``["send", text]``: write ``text`` (latin-1: any bytes) as is; the script writes the
  status line, the headers and the framing itself, so any answer can be made;
- ``["pause", seconds]``: pace the answer, as an engine between tokens;
- ``["await_poke"]``: wait until ``GET /poke`` arrives (answered once the wait ended),
  so a test goes on when its client has seen what it needed, not after a guessed time;
- ``["hang"]``: answer no more on this connection;
- ``["close"]``: close the connection (FIN); ``["reset"]``: abort it (RST).

A script that ends otherwise leaves the connection open for the next request.

A GET whose query is ``?await_poke`` (``/health?await_poke``) is answered only once a
``GET /poke`` arrived: a health probe that takes as long as the test wants.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import struct
from typing import Any

MODEL = "raw"
_MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()


def _answer(body: bytes, content_type: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        content_type,
        len(body),
        body,
    )


class RawBackend:
    def __init__(self) -> None:
        self.pokes = asyncio.Queue[asyncio.Future[None]]()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *fields = head.decode("latin-1").split("\r\n")
                length = next(
                    (
                        int(f.split(":", 1)[1])
                        for f in fields
                        if f.lower().startswith("content-length:")
                    ),
                    0,
                )
                body = await reader.readexactly(length)
                if line.startswith("GET /poke"):
                    await self._poked(writer)
                elif line.startswith("GET ") and line.split(" ")[1].endswith("?await_poke"):
                    (await self.pokes.get()).set_result(None)
                    writer.write(_answer(b"{}"))
                elif line.startswith("GET /v1/models"):
                    writer.write(_answer(_MODELS))
                elif line.startswith("GET "):
                    writer.write(_answer(b"{}"))
                elif not await self._run(json.loads(body).get("raw_script", []), writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def _poked(self, writer: asyncio.StreamWriter) -> None:
        done = asyncio.get_running_loop().create_future()
        await self.pokes.put(done)
        await done
        writer.write(_answer(b"{}"))

    async def _run(self, script: list[list[Any]], writer: asyncio.StreamWriter) -> bool:
        """Runs ``script``; False when it ended the connection."""
        for step, *args in script:
            if step == "send":
                writer.write(args[0].encode("latin-1"))
                await writer.drain()
            elif step == "pause":
                await asyncio.sleep(args[0])
            elif step == "await_poke":
                (await self.pokes.get()).set_result(None)
            elif step == "hang":
                await asyncio.Event().wait()
            elif step == "close":
                writer.close()
                return False
            elif step == "reset":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return False
        return True


async def serve(port: int) -> None:
    backend = RawBackend()
    server = await asyncio.start_server(backend.serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
