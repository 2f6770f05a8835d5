"""A backend that answers every POST with what it received: request line, headers, body.

Run as ``python -m tests.echo_backend --port P``; the tests read what the
gateway actually sent upstream, byte for byte, instead of trusting a mock.

A body with ``"echo_stall": true`` gets the head and the first bytes of its answer, and
never the rest: a backend caught in the middle of an answer. ``GET /stalled`` says how
many answers are stalled so. ``GET /seen/PATH`` gives the last echo of a POST to ``/PATH``,
for calls whose answer the test never sees (the gateway's own ``/tokenize``).
"""

from __future__ import annotations

import argparse
import asyncio
import json

MODELS = b'{"object":"list","data":[{"id":"echo","object":"model"}]}'


class Echo(asyncio.Protocol):
    stalled = 0  # answers begun and never finished, over every connection
    seen: dict[str, bytes] = {}  # path -> the last POST's echo, over every connection

    def __init__(self) -> None:
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, _, rest = self.buffer.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            fields = [tuple(part.strip() for part in line.split(":", 1)) for line in lines[1:]]
            length = next((int(v) for n, v in fields if n.lower() == "content-length"), 0)
            if len(rest) < length:
                return
            body, self.buffer = rest[:length], rest[length:]
            self._answer(lines[0], fields, body)

    def _answer(self, request_line: str, fields: list[tuple[str, ...]], body: bytes) -> None:
        if request_line.startswith("GET /v1/models"):
            payload = MODELS
        elif request_line.startswith("GET /stalled"):
            payload = json.dumps({"stalled": Echo.stalled}).encode()
        elif b'"echo_stall": true' in body or b'"echo_stall":true' in body:
            assert self.transport is not None
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: 1000\r\n\r\n{"
            )
            Echo.stalled += 1
            return
        elif request_line.startswith("GET /seen/"):
            path = "/" + request_line.split()[1].removeprefix("/seen/")
            payload = Echo.seen.get(path, b"{}")
        elif request_line.startswith("GET "):
            payload = b"{}"
        else:
            echoed = {
                "request_line": request_line,
                "headers": [list(pair) for pair in fields],
                "body": body.decode("utf-8"),
            }
            payload = json.dumps(echoed).encode()
            Echo.seen[request_line.split()[1]] = payload
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(payload), payload)
        )


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Echo, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
