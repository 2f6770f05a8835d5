"""The load generator's HTTP client against a real ``kneecap sim`` process and raw sockets.

The simulator runs the calibrated profile twenty times faster than real time;
the client reads its stream on the simulator's clock (times x 20), as
``kneecap bench --speed 20`` does, and must see the tokens, the usage and the
timing the engine produced.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import httpx
import pytest

from backends.sim.base import GenerationRequest, TokenEvent
from backends.sim.profiles import get_profile
from backends.sim.virtual import VirtualEngine
from gateway.bench.client import error_message, stream_request
from gateway.bench.h1 import Client, TransportError
from tests.polling import eventually
from tests.procs import MODEL, Proc, free_port, start_sim

pytestmark = pytest.mark.anyio
PROFILE = "qwen3-4b/l40s/bf16/vllm"
SPEED = 20.0


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_sim(tmp_path_factory.mktemp("h1"), profile=PROFILE, speed=SPEED)
    try:
        yield proc
    finally:
        proc.stop()


def virtual_times(prompt: int, out: int) -> list[float]:
    """When the engine emits each token of one request on an idle engine, in engine seconds."""
    engine = VirtualEngine(get_profile(PROFILE))
    times: list[float] = []

    class Listener:
        def on_token(self, now: float, event: TokenEvent) -> None:
            times.append(now)

    engine.submit(GenerationRequest("v", prompt, out, ignore_eos=True), Listener())
    engine.run_until_idle()
    return times


def chat_body(content: str, max_tokens: int, model: str = MODEL) -> dict[str, object]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def test_a_stream_from_the_real_sim_is_parsed_and_timed_on_its_clock(sim: Proc) -> None:
    client = Client(sim.url)
    clock = asyncio.get_running_loop().time  # any monotonic clock; scaled like --speed
    delivered: list[float] = []
    try:
        record = await stream_request(
            client,
            "/v1/chat/completions",
            chat_body("x" * 4000, 40),  # 1000 tokens + the chat template's 7
            prompt_tokens=1007,
            on_tokens=delivered.append,
            clock=lambda: clock() * SPEED,
        )
    finally:
        await client.aclose()
    assert record.error is None
    assert (record.prompt_tokens, record.output_tokens) == (1007, 40)  # from the usage chunk
    assert sum(delivered) == 40 and len(record.itls) == 39  # one SSE event per token
    times = virtual_times(1007, 40)
    assert record.ttft is not None and record.e2e is not None
    # Never sooner than the modelled GPU allows, and not lost either (a busy machine
    # may add a few milliseconds of wall time, twenty times that on this clock).
    assert 0.95 * times[0] <= record.ttft < times[0] + 1.0
    assert 0.95 * times[-1] <= record.e2e < times[-1] + 2.0
    # The stream ends when [DONE] is read, and it comes with the last token.
    assert sum(record.itls) == pytest.approx(record.e2e - record.ttft, abs=0.01)


async def test_completions_and_error_bodies(sim: Proc) -> None:
    client = Client(sim.url + "/ignored/path/is/not/the/origin")
    try:
        body = {"model": MODEL, "prompt": "y" * 400, "max_tokens": 5, "stream": True}
        record = await stream_request(client, "/v1/completions", body, prompt_tokens=100)
        assert record.error is None and record.output_tokens == 5  # no usage: events counted
        reply = await client.request("POST", "/v1/chat/completions", b'{"model": "nope"}', print)
        assert reply.status == 404  # an error body is read whole, never handed to the sink
        assert error_message(reply.status, reply.body) == (
            "HTTP 404: The model `nope` does not exist."
        )
        models = await client.request("GET", "/v1/models")
        assert models.status == 200 and MODEL.encode() in models.body
    finally:
        await client.aclose()


async def test_cancelling_a_stream_closes_its_connection_and_frees_the_sequence(
    sim: Proc,
) -> None:
    def cancelled() -> float:
        text = httpx.get(sim.url + "/metrics").text
        line = next(x for x in text.splitlines() if x.startswith("kneecap_sim_cancelled"))
        return float(line.rsplit(" ", 1)[1])

    before = cancelled()
    client = Client(sim.url)
    first = asyncio.Event()
    try:
        path = "/v1/chat/completions"
        body = chat_body("z" * 400, 5000)
        task = asyncio.create_task(
            stream_request(client, path, body, prompt_tokens=107, on_tokens=lambda n: first.set())
        )
        await asyncio.wait_for(first.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await client.aclose()
    # The server notices the closed connection.
    await eventually(lambda: cancelled() != before, "the sequence was not cancelled")


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def raw_server(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


@pytest.fixture
async def answer_once_then_close() -> AsyncIterator[tuple[str, list[int]]]:
    """Answers one request per connection (keep-alive in form) and then hangs up."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    server, url = await raw_server(handle)
    async with server:
        yield url, connections


async def test_a_kept_alive_connection_the_server_closed_is_replaced(
    answer_once_then_close: tuple[str, list[int]],
) -> None:
    url, connections = answer_once_then_close
    client = Client(url)
    try:
        for _ in range(3):
            reply = await client.request("GET", "/")
            assert (reply.status, reply.body) == (200, b"ok")
    finally:
        await client.aclose()
    assert len(connections) == 3


async def test_preconnected_connections_carry_a_burst() -> None:
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    server, url = await raw_server(handle)
    async with server:
        client = Client(url)
        try:
            await client.preconnect(4)
            await eventually(lambda: len(connections) >= 4, "preconnect opened too few")
            assert len(connections) == 4
            replies = await asyncio.gather(*(client.request("GET", "/") for _ in range(4)))
            assert all(r.body == b"ok" for r in replies)
            assert len(connections) == 4  # no new connection for the burst
        finally:
            await client.aclose()


async def test_refused_stalled_and_garbled_targets_fail_with_one_line() -> None:
    refused = Client(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(TransportError, match=r"^connection refused or unreachable$"):
        await refused.request("GET", "/")

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await reader.read()  # then nothing, until the client gives up and closes

    async def garble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()

    for handler, message in ((stall, "timed out: no data for 0.2 s"), (garble, "invalid HTTP")):
        server, url = await raw_server(handler)
        async with server:
            client = Client(url, stall_timeout_s=0.2)
            chunks: list[bytes] = []
            with pytest.raises(TransportError, match=message):
                await client.request("GET", "/", sink=chunks.append)
            await client.aclose()
        if handler is stall:
            assert chunks == [b"hello"]  # what came before the stall was handed on
