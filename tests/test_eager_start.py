"""A request's task starts in the loop turn that read it (``gateway/eager.py``).

The continuation must behave as the task would have: the same task and context in the
first step as after it, results and errors through the task, and a cancel that comes
before the task's first scheduled step reaching the coroutine where it waits.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import sys
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from gateway.eager import start_eagerly
from gateway.protocol import GatewayProtocol
from tests.protocol_server import protocol_server

marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker", default="outside")


def inside_a_read() -> bool:
    """Whether a protocol's ``data_received`` is on the calling stack."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "data_received":
            return True
        frame = frame.f_back
    return False


def from_a_callback(start: Any) -> asyncio.Future[Any]:
    """Runs ``start()`` from a plain loop callback, as a protocol's read is run."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def callback() -> None:
        try:
            done.set_result(start())
        except BaseException as exc:  # handed to the test
            done.set_exception(exc)

    loop.call_soon(callback)
    return done


@pytest.mark.anyio
async def test_the_first_step_runs_at_once_as_the_task_in_its_context() -> None:
    loop = asyncio.get_running_loop()
    seen: list[tuple[str, Any, str]] = []
    later: asyncio.Future[str] = loop.create_future()

    async def handler() -> str:
        marker.set("inside")
        seen.append(("first", asyncio.current_task(), marker.get()))
        value = await later
        seen.append(("rest", asyncio.current_task(), marker.get()))
        return value

    def start() -> asyncio.Task[str]:
        task = start_eagerly(loop, handler())
        assert [s[0] for s in seen] == ["first"]  # before start_eagerly returned
        return task

    task = await from_a_callback(start)
    assert marker.get() == "outside"  # the step ran in the task's context, not the caller's
    later.set_result("answer")
    assert await task == "answer"
    assert [(name, current is task, value) for name, current, value in seen] == [
        ("first", True, "inside"),
        ("rest", True, "inside"),
    ]


@pytest.mark.anyio
async def test_what_ends_in_its_first_step_ends_the_task() -> None:
    loop = asyncio.get_running_loop()

    async def returns() -> int:
        return 7

    async def raises() -> None:
        raise LookupError("in the first step")

    done = await from_a_callback(lambda: start_eagerly(loop, returns()))
    failed = await from_a_callback(lambda: start_eagerly(loop, raises()))
    assert await done == 7
    with pytest.raises(LookupError, match="in the first step"):
        await failed


@pytest.mark.anyio
async def test_a_cancel_before_the_tasks_first_step_reaches_the_coroutine() -> None:
    loop = asyncio.get_running_loop()
    cleaned: list[str] = []
    never: asyncio.Future[None] = loop.create_future()

    async def handler() -> None:
        try:
            await never
        finally:
            cleaned.append("released")

    def start_and_cancel() -> asyncio.Task[None]:
        task = start_eagerly(loop, handler())
        task.cancel()  # in the same loop turn: its first scheduled step has not run
        return task

    task = await from_a_callback(start_and_cancel)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == ["released"]
    assert task.cancelled()
    assert never.cancelled()  # as Task.cancel() cancels what its task waits on


@pytest.mark.anyio
async def test_a_cancel_while_it_waits_later_reaches_the_coroutine() -> None:
    loop = asyncio.get_running_loop()
    first: asyncio.Future[None] = loop.create_future()
    second_wait: asyncio.Future[None] = loop.create_future()

    async def handler() -> str:
        await first
        second_wait.set_result(None)
        try:
            await loop.create_future()
        except asyncio.CancelledError:
            return "handled"
        return "not reached"

    task = await from_a_callback(lambda: start_eagerly(loop, handler()))
    first.set_result(None)
    await second_wait
    task.cancel()
    assert await task == "handled"


@pytest.mark.anyio
async def test_a_whole_request_is_handled_within_the_read_that_brought_it() -> None:
    """The app's first step runs inside the protocol's ``data_received``: for a request
    read whole, nothing else the loop has due runs before its handler."""
    calls: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        in_read = inside_a_read()
        message = await receive()
        calls.append({"in_read": in_read, "body": message["body"]})
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    body = json.dumps({"model": "m"}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body)
    async with protocol_server(app) as (_, reader, writer):
        writer.write(head + body)  # one read
        await writer.drain()
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
    assert calls == [{"in_read": True, "body": body}]


@pytest.mark.anyio
async def test_of_requests_read_in_one_turn_only_the_first_starts_there() -> None:
    """A burst read in one turn of the loop runs its handlers back to back, as before:
    started each inside its own read, they cost ~20 % more CPU per request at saturation
    (non-streaming bench, alternated slices), the code of each handler evicting the next's."""
    in_read: dict[str, bool] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        in_read[scope["path"]] = inside_a_read()
        await receive()
        headers = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})

    config = uvicorn.Config(app=app, http=GatewayProtocol, log_level="critical")
    config.load()
    state = ServerState()
    protocols: list[GatewayProtocol] = []
    loop = asyncio.get_running_loop()
    both_connected = loop.create_future()

    class Counted(GatewayProtocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            protocols.append(self)
            if len(protocols) == 2:
                both_connected.set_result(None)

    def factory() -> GatewayProtocol:
        return Counted(config=config, server_state=state, app_state={})

    server = await loop.create_server(factory, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    clients = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    try:
        await asyncio.wait_for(both_connected, 5)
        request = b"POST /%s HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"

        def one_turn() -> None:  # two reads handled in one turn, as a burst is
            protocols[0].data_received(request % b"first")
            protocols[1].data_received(request % b"second")

        await from_a_callback(one_turn)
        for reader, _ in clients:
            assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        await from_a_callback(lambda: protocols[1].data_received(request % b"later"))
        assert (await clients[1][0].readuntil(b"ok")).startswith(b"HTTP/1.1 200")
    finally:
        for _, writer in clients:
            writer.close()
        server.close()
    assert in_read == {"/first": True, "/second": False, "/later": True}
