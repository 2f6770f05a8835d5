"""``estimator: backend``: the engine's own ``/tokenize`` count, within a deadline, and
never an answer that is no count.

A real server on 127.0.0.1 answers as scripted: slowly, a byte at a time, or with
figures no engine reports."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from gateway.tokens import tokenize_on_backend

pytestmark = pytest.mark.anyio

PAYLOAD = {"model": "m", "prompt": "hello there"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def _serve(answer: Callable[[asyncio.StreamWriter], object]) -> AsyncIterator[str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        try:
            await answer(writer)  # type: ignore[misc]
        except ConnectionError:
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _json_answer(body: object) -> Callable[[asyncio.StreamWriter], object]:
    data = json.dumps(body).encode()

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(data), data)
        )
        await writer.drain()

    return answer


async def _trickle(writer: asyncio.StreamWriter) -> None:
    """A valid answer, one byte every 0.2 s: each read within any per-read timeout."""
    data = json.dumps({"count": 3, "max_model_len": 4096}).encode()
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(data))
    for byte in data:
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(0.2)  # the pace of the misbehaving backend, not a wait for a test


async def test_a_backend_dripping_its_answer_is_given_up_at_the_deadline() -> None:
    async with _serve(_trickle) as url:
        async with httpx.AsyncClient() as client:
            started = time.monotonic()
            counted = await tokenize_on_backend(client, url, PAYLOAD, headers={}, timeout_s=0.5)
            took = time.monotonic() - started
    assert counted is None  # the caller falls back to the character estimate
    # The whole answer takes ~7 s; before the fix the call waited all of it.
    assert took < 3.0, took


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ({"count": 12, "max_model_len": 4096}, (12, 4096)),
        ({"count": -50000, "max_model_len": 4096}, None),
        ({"count": True}, None),
        ({"count": 12, "max_model_len": 0}, (12, None)),
        ({"count": 12, "max_model_len": -1}, (12, None)),
    ],
)
async def test_figures_no_engine_reports_are_not_trusted(
    answer: dict[str, object], expected: tuple[int, int | None] | None
) -> None:
    async with _serve(_json_answer(answer)) as url:
        async with httpx.AsyncClient() as client:
            counted = await tokenize_on_backend(client, url, PAYLOAD, headers={}, timeout_s=5)
    got = None if counted is None else (counted.count, counted.max_model_len)
    assert got == expected
