"""Proxied requests at the edges a black-box hunt found, each against a real gateway.

The backend is :mod:`tests.raw_sse_backend`, whose every answer is the script its
request carries, so a test sends the exact bytes a backend could send: a usage with
a count that is no number, a 204, hop-by-hop headers named in ``Connection``, a stall.
What the gateway forwards upstream is read back from :mod:`tests.echo_backend`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import (
    Gateway,
    Proc,
    served,
    start_gateway,
    start_raw_sse,
    wait_until,
)
from tests.raw_sse_backend import MODEL
from tests.test_proxy_upstream_request import MODEL as ECHO_MODEL
from tests.test_proxy_upstream_request import echo_backend, fields_of, start_echo
from tests.test_proxy_wire import idle, metric_sum, new_id, record_of
from tests.test_relay_edge_cases import DONE, STREAM, body, chunked_stream, event, usage

CHAT = "/v1/chat/completions"
# Probes that never come back on their own: only the reload's probe round matters.
QUIET_HEALTH = {"interval_s": 60, "failure_threshold": 1000}
STATIC_1 = {"kind": "static", "initial": 1, "min": 1, "max": 1}


def raw_backend(name: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "url": url, "pool": "short", "models": [MODEL], **extra}


def whole_answer(payload: bytes, status: str = "200 OK", fields: str = "") -> str:
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{fields}"
    return head + f"content-length: {len(payload)}\r\n\r\n" + payload.decode()


def post(gw: Gateway, request: dict[str, Any], request_id: str, **headers: str) -> httpx.Response:
    return httpx.post(
        gw.url + CHAT,
        json=request,
        headers={"x-request-id": request_id, **headers},
        timeout=10,
    )


def streamed(gw: Gateway, content: bytes, request_id: str) -> tuple[int, bytes]:
    """Status and every byte of a streamed answer to the raw request body ``content``."""
    headers = {"content-type": "application/json", "x-request-id": request_id}
    with httpx.stream("POST", gw.url + CHAT, content=content, headers=headers, timeout=10) as r:
        return r.status_code, b"".join(r.iter_raw())


# --- fixtures ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("proxy_edges")


@pytest.fixture(scope="module")
def raw(module_tmp: Path) -> Iterator[Proc]:
    yield from served(start_raw_sse(module_tmp))


@pytest.fixture(scope="module")
def echo(module_tmp: Path) -> Iterator[Proc]:
    yield from served(start_echo(module_tmp))


@pytest.fixture(scope="module")
def gw(module_tmp: Path, raw: Proc, echo: Proc) -> Iterator[Gateway]:
    config = {
        "backends": [raw_backend("raw", raw.url), echo_backend(echo.url)],
        "health": QUIET_HEALTH,
        "upstream": {"read_timeout_s": 2, "max_attempts": 1},
    }
    gateway = start_gateway(module_tmp, config)
    try:
        yield gateway
    finally:
        gateway.proc.stop()


# --- 1. a usage whose token count is no number -------------------------------------

ODD_USAGE = {"prompt_tokens": [3], "completion_tokens": 2, "total_tokens": 5}


def test_a_whole_answer_with_an_odd_usage_reaches_the_client_unchanged(gw: Gateway) -> None:
    """The backend's 200 is the client's, whatever its usage says (before the fix: 500
    internal_error in its place); the request is recorded ok, without tokens."""
    answer = {
        "id": "c1",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
        "usage": ODD_USAGE,
    }
    payload = json.dumps(answer).encode()
    request_id = new_id("odd-usage")
    response = post(gw, body([["send", whole_answer(payload)]], stream=False), request_id)
    assert response.status_code == 200, response.text
    assert response.content == payload
    record = record_of(gw, request_id)
    assert record["status"] == "ok"
    assert (record["prompt_tokens"], record["completion_tokens"]) == (None, None)


@pytest.mark.parametrize("asked", [True, False], ids=["asked", "strip"])
def test_a_stream_with_an_odd_usage_chunk_reaches_the_client_whole(
    gw: Gateway, asked: bool
) -> None:
    """Before the fix the usage chunk's count raised in the meter: the stream was cut
    with neither ``[DONE]`` nor the last chunk."""
    odd_usage = event(choices=[], usage=ODD_USAGE)
    request_id = new_id("odd-usage-stream")
    request = body(chunked_stream(*STREAM, odd_usage, DONE), asked=asked)
    status, data = streamed(gw, json.dumps(request).encode(), request_id)
    assert status == 200
    # The usage chunk is the gateway's own when the client did not ask for it.
    assert data == b"".join([*STREAM, odd_usage, DONE] if asked else [*STREAM, DONE])
    record = record_of(gw, request_id)
    assert record["status"] == "ok"
    assert (record["prompt_tokens"], record["completion_tokens"]) == (None, None)


# --- 3. a lone surrogate escape in a body the gateway re-encodes ------------------


@pytest.mark.parametrize("options", [{"include_usage": False}, None], ids=["no-usage", "null"])
def test_a_lone_surrogate_escape_survives_stream_options(
    gw: Gateway, options: dict[str, bool] | None
) -> None:
    """``"\\ud800"`` is valid JSON; with ``stream_options`` the gateway re-encodes the
    body to ask for usage, and before the fix that encoding raised: 500 internal_error."""
    request = {
        **body(chunked_stream(*STREAM, usage(), DONE)),
        "messages": [{"role": "user", "content": "a\ud800b"}],
        "stream_options": options,
    }
    content = json.dumps(request).encode()  # ASCII: the surrogate stays a JSON escape
    assert b"\\ud800" in content
    request_id = new_id("surrogate")
    status, data = streamed(gw, content, request_id)
    assert status == 200, data
    assert data == b"".join([*STREAM, DONE])
    assert record_of(gw, request_id)["status"] == "ok"


# --- 4. headers a Connection header names -------------------------------------------


def test_headers_named_in_connection_go_no_further(gw: Gateway) -> None:
    """RFC 9110 §7.6.1: a header ``Connection`` lists is for that one hop. Before the
    fix the gateway forwarded it, to the backend and to the client alike."""
    to_backend = httpx.post(
        gw.url + CHAT,
        json={"model": ECHO_MODEL, "messages": [{"role": "user", "content": "hi"}]},
        headers={"connection": "keep-alive, X-Foo", "x-foo": "secret", "x-bar": "kept"},
        timeout=10,
    )
    assert to_backend.status_code == 200, to_backend.text
    received = dict(fields_of(to_backend.json()))
    assert "x-foo" not in received
    assert received["x-bar"] == "kept"

    fields = "connection: keep-alive, x-secret\r\nx-secret: 1\r\nx-other: 2\r\n"
    script = [["send", whole_answer(b"{}", fields=fields)]]
    to_client = post(gw, body(script, stream=False), new_id("hop"))
    assert to_client.status_code == 200
    assert "x-secret" not in to_client.headers
    assert to_client.headers["x-other"] == "2"


# --- 5. a backend's 204 -------------------------------------------------------------


def test_a_backends_204_is_relayed_without_a_content_length(gw: Gateway) -> None:
    """RFC 9110 §8.6 forbids ``content-length`` on a 204; before the fix the gateway
    added ``content-length: 0``."""
    script = [["send", "HTTP/1.1 204 No Content\r\nx-answer: none\r\n\r\n"]]
    response = post(gw, body(script, stream=False), new_id("no-content"))
    assert response.status_code == 204
    assert response.headers["x-answer"] == "none"  # the backend's answer, not another
    assert "content-length" not in response.headers
    assert response.content == b""


def test_nothing_is_left_taken(gw: Gateway) -> None:
    assert idle(gw)


# --- 2. a retry that finds no capacity ---------------------------------------------


def test_a_retry_without_capacity_is_answered_with_the_upstream_timeout(
    tmp_path: Path, raw: Proc
) -> None:
    """Two replicas of one permit each, both taken. The first request's backend stalls
    (read timeout 1 s); its retry finds the other replica still busy, past the queue
    deadline (0.3 s) counted from the request's arrival. Before the fix that retry was
    answered 429 queue_timeout, unrecorded though the request had reached a backend."""
    config = {
        # Two replicas on one raw backend: each request's script decides its stall.
        "backends": [raw_backend(f"r{i}", raw.url, limit=STATIC_1) for i in range(2)],
        "pools": {"short": {"max_queue_wait_s": 0.3}},
        "health": QUIET_HEALTH,
        "upstream": {"read_timeout_s": 1.0},
    }
    gw = start_gateway(tmp_path, config)
    try:
        rejected_before = metric_sum(gw.url, "kneecap_rejected_requests_total")
        stalls_at_once = body([["hang"]], stream=False)
        # The second holds its replica past the first one's timeout: its head comes
        # 0.5 s late, and its body then stalls for the read timeout.
        head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 9\r\n\r\n{"
        stalls_later = body([["pause", 0.5], ["send", head], ["hang"]], stream=False)
        ids = [new_id("retry-first"), new_id("retry-second")]
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(post, gw, stalls_at_once, ids[0])
            wait_until(lambda: sum(b["in_flight"] for b in gw.state()["backends"]) == 1)
            second = pool.submit(post, gw, stalls_later, ids[1])
            responses = [first.result(), second.result()]
        for response in responses:
            assert response.status_code == 504, response.text
            assert response.json()["error"]["code"] == "upstream_timeout"
        assert [record_of(gw, i)["status"] for i in ids] == ["upstream_timeout"] * 2
        assert metric_sum(gw.url, "kneecap_rejected_requests_total") == rejected_before
        assert idle(gw)
    finally:
        gw.proc.stop()


# --- 6. a request right after a reload renamed the only backend ---------------------


def test_a_request_waits_for_the_first_probe_of_a_renamed_backend(
    tmp_path: Path, raw: Proc
) -> None:
    """The renamed backend is a new replica, unknown until the probe round the reload
    starts has answered. The health path the reload sets answers only when poked, so
    the request surely comes inside that window; it must wait for the verdict, then be served
    (before the fix: 503 no_healthy_backend at once)."""
    config = {"backends": [raw_backend("before", raw.url)], "health": QUIET_HEALTH}
    gw = start_gateway(tmp_path, config)
    try:
        # The startup probe answers unpoked; from the reload on, probes wait for a poke.
        held_health = {**QUIET_HEALTH, "path": "/health?await_poke", "timeout_s": 10}
        gw.write_config(
            {**config, "backends": [raw_backend("after", raw.url)], "health": held_health}
        )
        assert httpx.post(gw.url + "/admin/reload", timeout=5).json()["ok"] is True
        assert [(b["name"], b["healthy"]) for b in gw.state()["backends"]] == [("after", False)]

        answer = json.dumps({"id": "c1", "object": "chat.completion", "choices": []}).encode()
        request = body([["send", whole_answer(answer)]], stream=False)
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(post, gw, request, new_id("renamed"))
            # Answered at once (the bug), or waiting in the queue for the probe's verdict.
            wait_until(lambda: sent.done() or gw.state()["pools"]["short"]["queue_depth"] == 1)
            assert httpx.get(raw.url + "/poke", timeout=10).status_code == 200  # probe answers
            response = sent.result()
        assert response.status_code == 200, response.text
        assert response.content == answer
        assert response.headers["x-kneecap-backend"] == "after"
    finally:
        gw.proc.stop()
