"""The answers the HTTP protocol writes itself (400 invalid HTTP, 431, the 408s of a head or
a body not received in time, the 500 of an app that failed before answering) carry the CORS
headers the app would have given the request's ``Origin`` when the live rules allow it, and
none otherwise: a browser shown no ``Access-Control-Allow-Origin`` sees a network error,
not the answer. Their status and body are those given without ``Origin``.

A real GatewayProtocol serves a small app on 127.0.0.1 in the test's own loop; the last
test runs a real gateway, reloaded between two ``cors:`` blocks.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from gateway.protocol import MAX_HEAD_BYTES, GatewayProtocol
from gateway.settings import CorsConfig, ListenConfig
from tests.procs import Proc, backend, served, start_gateway, start_sim
from tests.protocol_server import protocol_server
from tests.test_front_protocol_fixes import answers
from tests.test_reload_live import reload

APP = "https://app.example"
OTHER = "https://other.example"
TIMEOUT = 0.5  # head and body timeouts: the 408s come this long after the client stalls
LISTED = {"allowed_origins": [APP], "allow_credentials": True, "expose_headers": ["x-request-id"]}
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
PAD = b"x-pad: " + b"p" * 1000 + b"\r\n"
PADS = PAD * (MAX_HEAD_BYTES // len(PAD) + 3)  # headers past the limit, whole


async def app(scope: Any, receive: Any, send: Any) -> None:
    """Reads the body and answers 200; on ``/fail`` raises before answering."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/fail":
        raise RuntimeError("a bug")
    while (await receive()).get("more_body", False):
        pass
    headers = [(b"content-type", b"application/json"), (b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"{}"})


Send = Callable[[GatewayProtocol, asyncio.StreamWriter, bytes], None]


def _write(data: bytes) -> Send:
    return lambda _, writer, origin: writer.write(data.replace(b"{origin}", origin))


def _read_whole(data: bytes) -> Send:
    """Handed to the protocol as one read: where a head ends decides which check refuses it."""
    return lambda protocol, _, origin: protocol.data_received(data.replace(b"{origin}", origin))


# Each refusal: how it is brought about (``{origin}`` is the Origin line, or nothing), and
# its status and error code.
REFUSALS: dict[str, tuple[Send, int, str]] = {
    "400": (
        _write(HEAD + b"{origin}content-length: 3\r\ncontent-length: 2\r\n\r\nabc"),
        400,
        "invalid_http_request",
    ),
    "431 at the head's end": (
        _read_whole(HEAD + PADS + b"{origin}content-length: 0\r\n\r\n"),
        431,
        "request_header_fields_too_large",
    ),
    "431 of a head not ended": (
        _read_whole(HEAD + b"{origin}" + PADS),
        431,
        "request_header_fields_too_large",
    ),
    # The line after the Origin begins, so the parser has handed the Origin over.
    "408 head": (_write(HEAD + b"{origin}x-a: b\r\n"), 408, "request_timeout"),
    "408 body": (
        _write(HEAD + b"{origin}content-length: 1000\r\n\r\n" + b"x" * 10),
        408,
        "request_timeout",
    ),
    "500": (
        _write(b"POST /fail HTTP/1.1\r\nhost: x\r\n{origin}content-length: 0\r\n\r\n"),
        500,
        "internal_error",
    ),
}

ANY_ORIGIN = {
    "access-control-allow-origin": "*",
    "access-control-expose-headers": "retry-after, x-request-id",
    "vary": "Origin",
}
LISTED_ORIGIN = {
    "access-control-allow-origin": APP,
    "access-control-allow-credentials": "true",
    "access-control-expose-headers": "x-request-id",
    "vary": "Origin",
}
# cors block, Origin sent, the CORS headers expected on the refusal.
CASES = {
    "any origin": ({}, APP, ANY_ORIGIN),
    "a listed origin, credentials": (LISTED, APP, LISTED_ORIGIN),
    "an origin not listed": (LISTED, OTHER, {}),
    "no origin": ({}, None, {}),
}


def cors_in(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.startswith("access-control-") or k == "vary"}


async def refused(refusal: str, cors: dict[str, Any], origin: str | None) -> bytes:
    listen = ListenConfig.model_validate({"head_timeout_s": TIMEOUT, "body_timeout_s": TIMEOUT})
    # What the gateway's lifespan hands its protocols: the runtime, its live settings.
    settings = SimpleNamespace(listen=listen, cors=CorsConfig.model_validate(cors))
    app_state = {"runtime": SimpleNamespace(current=SimpleNamespace(settings=settings))}
    send = REFUSALS[refusal][0]
    line = b"origin: %s\r\n" % origin.encode() if origin is not None else b""
    async with protocol_server(app, app_state) as (protocol, reader, writer):
        send(protocol, writer, line)
        return await asyncio.wait_for(reader.read(), 10)  # to the close


@pytest.mark.anyio
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("refusal", REFUSALS)
async def test_the_protocol_s_own_answers_carry_the_cors_headers_of_an_allowed_origin(
    refusal: str, case: str
) -> None:
    cors, origin, expected = CASES[case]
    raw = await refused(refusal, cors, origin)
    got = answers(raw)
    assert len(got) == 1, raw
    status, headers, body = got[0]
    assert cors_in(headers) == expected, raw
    _, want_status, code = REFUSALS[refusal]
    assert (status, json.loads(body)["error"]["code"]) == (want_status, code), raw
    # Nothing else changed: the same head, but for the CORS lines, as without Origin.
    rest = {k: v for k, v in headers.items() if k not in expected}
    assert rest == {
        "content-type": "application/json",
        "content-length": str(len(body)),
        "connection": "close",
    }, raw
    if origin is not None:
        plain = answers(await refused(refusal, cors, None))
        assert [(s, b) for s, _, b in plain] == [(status, body)]


# -- a real gateway ------------------------------------------------------------------


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    yield from served(start_sim(tmp_path_factory.mktemp("cors-sim"), ttft_ms=5, itl_ms=2))


def _exchange(url: str, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(data)
        raw = b""
        while chunk := sock.recv(65536):  # to the close; a socket timeout fails the test
            raw += chunk
    return raw


OVER_THE_WIRE = {
    "400": HEAD + b"{origin}content-length: 3\r\ncontent-length: 2\r\n\r\nabc",
    "408 head": HEAD + b"{origin}x-a: b\r\n",
    "408 body": HEAD + b"{origin}content-length: 1000\r\n\r\n" + b"x" * 10,
}


def test_a_gateway_s_own_refusals_follow_its_live_cors_block(tmp_path: Path, sim: Proc) -> None:
    """Refused by the first block, then allowed, with credentials, by the reloaded one: the
    refusals' CORS headers are then those the app gives an answer of its own (a 400 for a
    body that is not JSON)."""
    config: dict[str, Any] = {
        "backends": [backend("s", sim.url)],
        "listen": {"head_timeout_s": TIMEOUT, "body_timeout_s": TIMEOUT},
        "cors": {"allowed_origins": [OTHER]},
    }
    gw = start_gateway(tmp_path, config)
    try:
        for cors, allowed in [(config["cors"], False), (LISTED, True)]:
            reload(gw, {**gw.config, "cors": cors})
            own = httpx.post(
                gw.url + "/v1/chat/completions", content=b"{", headers={"origin": APP}, timeout=10
            )
            assert own.status_code == 400, own.text
            expected = cors_in(dict(own.headers)) if allowed else {}
            assert ("access-control-allow-origin" in expected) == allowed
            for name, data in OVER_THE_WIRE.items():
                raw = _exchange(gw.url, data.replace(b"{origin}", b"origin: %s\r\n" % APP.encode()))
                got = answers(raw)
                assert [status for status, _, _ in got] == [int(name[:3])], raw
                assert cors_in(got[0][1]) == expected, (cors, name, raw)
    finally:
        gw.proc.stop()
