"""The gateway's HTTP/1.1 front (``gateway/protocol.py``) against clients that stall,
trickle, pipeline, send malformed heads or ask for an upgrade.

Where the split of the bytes between reads is what matters, a real GatewayProtocol
serves a small app on 127.0.0.1 and the test hands it its reads itself; the rest runs
real gateway processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from gateway.protocol import MAX_HEAD_BYTES, GatewayProtocol
from gateway.settings import ListenConfig
from tests.procs import (
    MODEL,
    Gateway,
    Proc,
    backend,
    start_gateway,
    start_process,
    start_sim,
    wait_until,
)
from tests.protocol_server import protocol_server

STATIC_1 = {"kind": "static", "initial": 1, "min": 1, "max": 1}


# -- a real GatewayProtocol in this process ------------------------------------------


async def _answers_its_body(scope: Any, receive: Any, send: Any) -> None:
    """Reads the whole body; answers how long it was."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.dumps({"body_bytes": size}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def front(
    listen: ListenConfig | None = None,
) -> AsyncIterator[tuple[GatewayProtocol, asyncio.StreamReader, Any]]:
    # What the gateway's lifespan hands its protocols: the runtime, its live settings.
    settings = SimpleNamespace(listen=listen or ListenConfig.model_validate({}))
    app_state = {"runtime": SimpleNamespace(current=SimpleNamespace(settings=settings))}
    async with protocol_server(_answers_its_body, app_state) as connected:
        yield connected


def post(body: bytes, headers: bytes = b"", *, close: bool = False) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n%s%s\r\n%s"
        % (len(body), headers, b"connection: close\r\n" if close else b"", body)
    )


def answers(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Each answer on a connection: status, headers, body (content-length framed)."""
    found = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        line, *fields = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (f.split(":", 1) for f in fields)}
        length = int(headers.get("content-length", "0"))
        found.append((int(line.split()[1]), headers, rest[:length]))
        raw = rest[length:]
    return found


CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.mark.anyio
async def test_a_pipelined_head_read_with_the_tail_of_a_large_body_is_not_refused() -> None:
    """The earlier request's body bytes in the read where the next head begins are not the
    head's: a 100-byte head must not be refused 431 (and its connection closed, the earlier
    request unanswered) because it arrived with 300 KB of the body before it."""
    large = post(b"a" * 300_000)
    small = post(CHAT, close=True)
    async with front() as (protocol, reader, _):
        protocol.data_received(large + small[:20])  # one read: a body, then a head begins
        protocol.data_received(small[20:])  # the head ends in the next
        got = answers(await asyncio.wait_for(reader.read(), 10))
    assert [(status, json.loads(body)) for status, _, body in got] == [
        (200, {"body_bytes": 300_000}),
        (200, {"body_bytes": len(CHAT)}),
    ]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("headers", "status"),
    [
        (13_000, 431),  # 91 KB sent, 39 KB of names and values
        (9_000, 200),  # 63 KB sent: under the limit, as sent
    ],
)
async def test_a_heads_separators_count_towards_its_limit(headers: int, status: int) -> None:
    """Many short headers: their ": " and CRLFs are most of the head. A head is measured as
    sent, so 91 KB of them is refused and 63 KB is not."""
    head = post(CHAT, b"xy: z\r\n" * headers, close=True)
    sent = head.index(b"\r\n\r\n") + 4
    assert (sent > MAX_HEAD_BYTES) == (status == 431)
    async with front() as (_, reader, writer):
        writer.write(head)
        got = answers(await asyncio.wait_for(reader.read(), 10))
    assert [answer[0] for answer in got] == [status]
    if status == 431:
        assert json.loads(got[0][2])["error"]["code"] == "request_header_fields_too_large"


@pytest.mark.anyio
@pytest.mark.parametrize(("size", "status"), [(MAX_HEAD_BYTES, 200), (MAX_HEAD_BYTES + 1, 431)])
async def test_a_head_of_one_byte_over_the_limit_in_one_read_is_refused(
    size: int, status: int
) -> None:
    """Counted from -1 in the read it began in, a head one byte over went unmeasured."""
    start = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-pad: "
    end = b"\r\ncontent-length: 0\r\n\r\n"
    head = start + b"p" * (size - len(start) - len(end)) + end
    assert len(head) == size
    async with front() as (_, reader, writer):
        writer.write(head)
        got = answers(await asyncio.wait_for(reader.read(), 10))
    assert [answer[0] for answer in got] == [status]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n"
        b"content-length: 3\r\n\r\n%s" % (len(CHAT), CHAT),
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-a: a\rb\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(CHAT), CHAT),
    ],
    ids=["two content-lengths", "bare CR in a header"],
)
async def test_malformed_http_is_answered_an_openai_shaped_400(request_bytes: bytes) -> None:
    async with front() as (_, reader, writer):
        writer.write(request_bytes)
        got = answers(await asyncio.wait_for(reader.read(), 10))
    assert len(got) == 1
    status, headers, body = got[0]
    assert (status, headers["content-type"]) == (400, "application/json"), got
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_http_request")
    assert error["message"].startswith("Invalid HTTP request")


H2C = (
    b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n"
    b"http2-settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n"
)


@pytest.mark.anyio
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_an_h2c_upgrade_is_ignored_and_its_body_read(framing: str) -> None:
    """``curl --http2`` asks to upgrade a POST to h2c. The upgrade is ignored (RFC 9110
    §7.8), and the request is served as HTTP/1.1 with its body, as is the next one."""
    if framing == "chunked":
        upgrade = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
            + H2C
            + b"\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(CHAT), CHAT)
        )
    else:
        upgrade = post(CHAT, H2C)
    async with front() as (_, reader, writer):
        writer.write(upgrade + post(b"[1]", close=True))  # a second request behind it
        got = answers(await asyncio.wait_for(reader.read(), 10))
    assert [(status, json.loads(body)) for status, _, body in got] == [
        (200, {"body_bytes": len(CHAT)}),
        (200, {"body_bytes": 3}),
    ]


@pytest.mark.anyio
async def test_a_client_that_drains_again_gets_a_new_send_timeout() -> None:
    """Each stall is timed afresh: a client that read (the transport resumed writing) is
    not cut at the first stall's deadline, only ``send_timeout_s`` after the next stall."""
    timeout = 1.0
    loop = asyncio.get_running_loop()
    async with front(ListenConfig.model_validate({"send_timeout_s": timeout})) as (
        protocol,
        reader,
        _,
    ):
        first = loop.time()
        protocol.pause_writing()  # as the transport does when the client's buffers are full
        await asyncio.sleep(0.3)  # the scenario's timeline: the client reads 0.3 s later
        protocol.resume_writing()
        protocol.pause_writing()
        second = loop.time()
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(reader.read(), 10) == b""  # cut, nothing sent
        cut = loop.time()
    assert cut - second >= timeout * 0.95  # the second stall's deadline...
    assert cut - first >= timeout * 1.25  # ...not the first's


# -- real gateway processes ----------------------------------------------------------


@pytest.fixture(scope="module")
def echo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    port = _free_port()
    proc = start_process(
        ["--port", str(port)],
        f"http://127.0.0.1:{port}",
        "/health",
        tmp_path_factory.mktemp("echo") / "echo.log",
        module="tests.echo_backend",
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, echo: Proc) -> Iterator[Gateway]:
    config = {"backends": [backend("echo", echo.url)], "listen": {"head_timeout_s": 1}}
    gw = start_gateway(tmp_path_factory.mktemp("gw"), config)
    try:
        yield gw
    finally:
        gw.proc.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _connect(url: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5)


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_an_h2c_upgrade_post_reaches_the_backend_with_its_body(gateway: Gateway) -> None:
    with _connect(gateway.url) as sock:
        sock.sendall(post(CHAT, H2C, close=True))
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    (status, _, body), *_ = answers(raw)
    assert status == 200, raw
    assert CHAT.decode() in json.loads(body)["body"]  # what the backend received


def test_a_connection_that_never_sends_a_byte_is_closed(gateway: Gateway) -> None:
    """uvicorn's keep-alive timeout (5 s) counts from the connection's start too: idle
    connections cannot pile up until the gateway runs out of file descriptors."""
    with _connect(gateway.url) as sock:
        sock.settimeout(0.1)
        started = time.monotonic()
        wait_until(lambda: _closed_by_peer(sock), timeout=15)
        assert time.monotonic() - started >= 4  # the keep-alive timeout, not at once


def test_a_head_that_trickles_in_is_cut_at_head_timeout(gateway: Gateway) -> None:
    """A head whose bytes keep coming, one header now and then, each read well within
    any idle timeout, is answered 408 once ``listen.head_timeout_s`` (1 s here) passed."""
    with _connect(gateway.url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        sock.settimeout(0.1)
        raw = b""
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                sock.sendall(b"x-a: b\r\n")  # the trickle itself, not a wait
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if not chunk:
                break
            raw += chunk
    got = answers(raw)
    assert [answer[0] for answer in got] == [408], raw
    assert json.loads(got[0][2])["error"]["code"] == "request_timeout"


def test_a_client_that_stops_reading_releases_its_permit_after_send_timeout(
    tmp_path: Path,
) -> None:
    """A streaming client that keeps its socket open and reads no more would hold its
    backend's one permit for good; after ``listen.send_timeout_s`` without draining its
    connection is cut, its request counted ``client_closed``, and the next client served."""
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=0.2)
    config = {
        "backends": [backend("sim", sim.url, limit=STATIC_1)],
        "pools": {"short": {"max_queue_wait_s": 20}},
        "listen": {"send_timeout_s": 1},
    }
    gw = start_gateway(tmp_path, config)
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills fast
    try:
        stalled.connect(("127.0.0.1", int(gw.url.rsplit(":", 1)[1])))
        long_stream = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 20_000,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 5,
        }
        stalled.sendall(post(json.dumps(long_stream).encode()))
        assert stalled.recv(100).startswith(b"HTTP/1.1 200")  # then reads no more
        next_one = httpx.post(
            gw.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=40,
        )
        assert next_one.status_code == 200, next_one.text
        wait_until(lambda: gw.state()["backends"][0]["in_flight"] == 0)

        def stalled_one_counted() -> list[str]:
            recent = httpx.get(gw.url + "/admin/requests", timeout=5).json()["requests"]
            return [r["status"] for r in recent if r["stream"]]

        wait_until(lambda: stalled_one_counted() == ["client_closed"])
    finally:
        stalled.close()
        gw.proc.stop()
        sim.stop()
