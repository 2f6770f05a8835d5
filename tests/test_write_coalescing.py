"""A response's head leaves with the bytes that follow it: one write, not two.

The gateway process's own count of write system calls (``/proc/PID/io``,
``syscw``) tells: a whole answer relayed costs the upstream request's write
and the client answer's, nothing more.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.protocol import HeadWithBody
from tests.procs import MODEL, Gateway, Proc, backend, start_gateway, start_sim
from tests.protocol_server import protocol_server

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/PID/io")

REQUESTS = 100


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_sim(tmp_path_factory.mktemp("sim"), ttft_ms=0, itl_ms=0)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, sim: Proc) -> Iterator[Gateway]:
    config = {
        "backends": [backend("sim-0", sim.url)],
        # Probes and scrapes write too: far apart, none lands among the counted requests.
        "health": {"interval_s": 60},
        "measurement": {"scrape_interval_s": 60},
    }
    gw = start_gateway(tmp_path_factory.mktemp("gw"), config)
    try:
        yield gw
    finally:
        gw.proc.stop()


def write_calls(pid: int) -> int:
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["syscw"])


def test_a_whole_answer_costs_two_writes_per_request(gateway: Gateway) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 200  # connected
        before = write_calls(gateway.proc.pid)
        for _ in range(REQUESTS):
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200
            assert response.json()["usage"]["completion_tokens"] == 4
        per_request = (write_calls(gateway.proc.pid) - before) / REQUESTS
    # Upstream request + client answer = 2; the head written apart made it 3. The slack
    # is for the background probes and scrapes in the same span.
    assert per_request < 2.5, per_request


class Owner:
    """What a head needs of its protocol: where to say it is held."""

    held_head: HeadWithBody | None = None


async def _pair() -> tuple[asyncio.Transport, asyncio.StreamReader, asyncio.Server, object]:
    accepted: asyncio.Future[asyncio.Transport] = asyncio.get_running_loop().create_future()

    class Server(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted.set_result(transport)  # type: ignore[arg-type]

    server = await asyncio.get_running_loop().create_server(Server, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return await accepted, reader, server, writer  # a writer collected closes the socket


@pytest.mark.anyio
async def test_a_head_nothing_follows_leaves_on_the_next_turn() -> None:
    transport, reader, server, _writer = await _pair()
    try:
        head = HeadWithBody(transport, asyncio.get_running_loop(), Owner())
        head.write(b"HTTP/1.1 200 OK\r\n\r\n")
        # A stream's first event may be seconds away: the head must not wait for it.
        assert await asyncio.wait_for(reader.readexactly(19), 5) == b"HTTP/1.1 200 OK\r\n\r\n"
        head.write(b"data: 1\n\n")
        assert await asyncio.wait_for(reader.readexactly(9), 5) == b"data: 1\n\n"
    finally:
        transport.close()
        server.close()


@pytest.mark.anyio
async def test_the_protocols_own_writes_come_after_a_held_head() -> None:
    transport, reader, server, _writer = await _pair()
    try:
        protocol = Owner()
        head = HeadWithBody(transport, asyncio.get_running_loop(), protocol)  # type: ignore[arg-type]
        head.write(b"head;")
        assert protocol.held_head is head
        # What GatewayProtocol does before a write of its own (a 400 for a bad pipelined
        # request read in the same turn, a close at shutdown):
        protocol.held_head.flush()
        transport.write(b"400;")
        assert protocol.held_head is None
        assert await asyncio.wait_for(reader.readexactly(9), 5) == b"head;400;"
    finally:
        transport.close()
        server.close()


@pytest.mark.anyio
async def test_head_and_body_arrive_whole_and_in_order_and_close_sends_the_head() -> None:
    transport, reader, server, _writer = await _pair()
    try:
        first = HeadWithBody(transport, asyncio.get_running_loop(), Owner())
        first.write(b"head;")
        first.write(b"body;")
        first.write(b"more;")
        assert await asyncio.wait_for(reader.readexactly(15), 5) == b"head;body;more;"
        second = HeadWithBody(transport, asyncio.get_running_loop(), Owner())
        second.write(b"last head")
        second.close()  # e.g. Connection: close right after the head
        assert await asyncio.wait_for(reader.read(), 5) == b"last head"
        assert second.is_closing()
        second.flush()  # the scheduled flush, after the close: nothing left to send
    finally:
        transport.close()
        server.close()


def test_a_head_held_when_the_connection_closes_is_dropped_quietly() -> None:
    """On uvloop (the gateway's loop) a write to a closed transport raises: the head's
    flush, a callback of its own, must not, or every client that leaves right after
    its answer's head logs an error."""
    uvloop = pytest.importorskip("uvloop")
    errors: list[dict[str, object]] = []

    async def scenario() -> bytes:
        asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
        transport, reader, server, _writer = await _pair()
        try:
            transport.close()  # the client is gone ...
            ended = await asyncio.wait_for(reader.read(), 5)
            head = HeadWithBody(transport, asyncio.get_running_loop(), Owner())
            head.write(b"head")  # ... when a head is written: held, flushed next turn
            await asyncio.sleep(0)  # that turn (ordering within the loop, not a wait)
            await asyncio.sleep(0)
            return ended
        finally:
            server.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(scenario()) == b""
    assert errors == []


@pytest.mark.anyio
@pytest.mark.parametrize("own_write", ["send_400_response", "shutdown", "keep_alive_timeout"])
async def test_the_gateway_protocol_sends_a_held_head_before_its_own_writes(
    own_write: str,
) -> None:
    """A real GatewayProtocol on a real connection: a response head is held when the
    protocol itself writes (a 400 for a bad pipelined request read in the same turn) or
    closes (shutdown, keep-alive timeout). The head must go first, never after or lost."""
    async with protocol_server(_never_called) as (protocol, reader, _):
        head = HeadWithBody(protocol.transport, asyncio.get_running_loop(), protocol)
        head.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")  # held, in this step:
        if own_write == "send_400_response":
            protocol.send_400_response("Invalid HTTP request received.")
        elif own_write == "shutdown":
            protocol.shutdown()
        else:
            protocol.timeout_keep_alive_handler()
        received = await asyncio.wait_for(reader.read(), 5)  # until the protocol closed
        assert received.startswith(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"), received
        if own_write == "send_400_response":
            assert b"400 Bad Request" in received


async def _never_called(scope: object, receive: object, send: object) -> None:
    raise AssertionError("no request is sent in this test")
