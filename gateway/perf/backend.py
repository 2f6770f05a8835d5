"""A fast OpenAI-shaped backend for the relay benchmark: raw asyncio protocol, no framework.

It answers ``POST /v1/chat/completions`` (streaming or not), ``GET /health`` and
``GET /v1/models`` with pre-built vLLM-format bytes, so that it costs a small
fraction of what the gateway does and the benchmark measures the gateway.
Each SSE event goes out in its own chunked-encoding chunk and its own socket
write, as an engine emits one token per step. Zero latency means one event per
event-loop turn per stream (streams interleave); pacing comes from the body:
``perf_ttft_ms`` and ``perf_itl_ms`` (unknown fields pass through the gateway).
``stream_options.include_usage`` is honoured, as vLLM does.

    python -m gateway.perf.backend --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from backends.sim import wire

MODEL = "Qwen/Qwen3-4B"
_IDENT = wire.Identity("chatcmpl-perf", 1_700_000_000)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


ROLE = _chunk(wire.chat_chunk(_IDENT, MODEL, {"role": "assistant", "content": ""}, None))
TOKEN = _chunk(wire.chat_chunk(_IDENT, MODEL, {"content": " knee"}, None))
LAST = _chunk(wire.chat_chunk(_IDENT, MODEL, {"content": " knee"}, "length"))
DONE = _chunk(wire.DONE) + b"0\r\n\r\n"
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def _usage_chunk(prompt: int, completion: int) -> bytes:
    return _chunk(wire.usage_chunk(_IDENT, MODEL, "chat.completion.chunk", prompt, completion))


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status.encode(),
        content_type,
        len(body),
        body,
    )


HEALTH = _response("200 OK", b'{"status":"ok"}')
MODELS = _response(
    "200 OK",
    wire.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0}]}),
)
NOT_FOUND = _response("404 Not Found", b'{"error":{"message":"not found"}}')


def completion_body(completion_tokens: int) -> bytes:
    return wire.dumps(
        {
            "id": _IDENT.id,
            "object": "chat.completion",
            "created": _IDENT.created,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " knee" * completion_tokens},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": wire.usage(1, completion_tokens),
        }
    )


class _Stream:
    """One streamed answer: ``left`` content events to go, then usage and [DONE]."""

    __slots__ = ("itl", "left", "total", "usage")

    def __init__(self, tokens: int, itl: float, usage: bool) -> None:
        self.left = self.total = tokens
        self.itl = itl
        self.usage = usage


class BackendProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.stream: _Stream | None = None
        self.timer: asyncio.TimerHandle | asyncio.Handle | None = None
        self.paused = False
        self.stalled = False  # an event was due while paused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.transport = None
        self.stream = None

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.stalled:
            self.stalled = False
            self._emit()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._serve()

    def _serve(self) -> None:
        buf = self.buf
        while self.stream is None and self.transport is not None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).lower()
            length = 0
            at = head.find(b"content-length:")
            if at >= 0:
                stop = head.find(b"\r\n", at)
                length = int(head[at + 15 : stop if stop >= 0 else len(head)])
            total = end + 4 + length
            if len(buf) < total:
                return
            body = bytes(buf[end + 4 : total])
            del buf[:total]
            self._handle(head, body)

    def _handle(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        line = head[: head.find(b"\r\n")] if b"\r\n" in head else head
        method, _, rest = line.partition(b" ")
        path = rest.partition(b" ")[0]
        if method == b"get":
            if path == b"/health":
                self.transport.write(HEALTH)
            elif path == b"/v1/models":
                self.transport.write(MODELS)
            else:
                self.transport.write(NOT_FOUND)
            return
        if path != b"/v1/chat/completions":
            self.transport.write(NOT_FOUND)
            return
        payload: dict[str, Any] = json.loads(body)
        # A router may pass the limit on under its newer name (sglang-router does).
        tokens = int(payload.get("max_tokens") or payload.get("max_completion_tokens") or 16)
        if not payload.get("stream"):
            self.transport.write(_response("200 OK", completion_body(tokens)))
            return
        options = payload.get("stream_options") or {}
        usage = isinstance(options, dict) and options.get("include_usage") is True
        itl = float(payload.get("perf_itl_ms") or 0) / 1000
        ttft = float(payload.get("perf_ttft_ms") or 0) / 1000
        self.stream = _Stream(tokens, itl, usage)
        self.transport.write(STREAM_HEAD + ROLE)
        self._schedule(ttft)

    def _schedule(self, delay: float) -> None:
        if delay > 0:
            self.timer = self.loop.call_later(delay, self._emit)
        else:
            self.timer = self.loop.call_soon(self._emit)

    def _emit(self) -> None:
        self.timer = None
        stream, transport = self.stream, self.transport
        if stream is None or transport is None:
            return
        if self.paused:
            self.stalled = True
            return
        stream.left -= 1
        if stream.left > 0:
            transport.write(TOKEN)
            self._schedule(stream.itl)
            return
        tail = LAST
        if stream.usage:
            tail += _usage_chunk(1, stream.total)
        transport.write(tail + DONE)
        self.stream = None
        if self.buf:
            self._serve()


async def serve(host: str, port: int, ready: asyncio.Event | None = None) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(BackendProtocol, host, port, backlog=4096)
    if ready is not None:
        ready.set()
    async with server:
        await server.serve_forever()


def run(coro: Any) -> Any:
    """Run ``coro`` on uvloop when it is installed, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        run(serve(args.host, args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
