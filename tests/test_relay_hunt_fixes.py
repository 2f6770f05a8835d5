"""What a backend or a client may send that the relay took for something else: a chunked
answer's trailer read as headers, a whole JSON answer to ``stream: true`` relayed
unmetered (its usage lost), and a pipelined request's wait behind the answer before it
booked as the gateway's own time and taken off its queue deadline."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import (
    Gateway,
    Proc,
    scripted_config,
    served,
    served_gateway,
    start_gateway,
    start_raw_sse,
    start_sim,
)
from tests.raw_sse_backend import MODEL
from tests.test_proxy_wire import RawConnection, new_id, post_bytes, record_of
from tests.test_relay_edge_cases import CHAT, body

STATIC_1 = {"kind": "static", "initial": 1, "min": 1, "max": 1}


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("relay-hunt")


@pytest.fixture(scope="module")
def raw(module_tmp: Path) -> Iterator[Proc]:
    yield from served(start_raw_sse(module_tmp))


@pytest.fixture(scope="module")
def gw(module_tmp: Path, raw: Proc) -> Iterator[Gateway]:
    backends = [
        {"name": "raw", "url": raw.url, "pool": "short", "models": [MODEL], "limit": STATIC_1},
        # The same process under another model name: a request that holds none of the
        # other's permits.
        {"name": "other", "url": raw.url, "pool": "short", "models": ["other"]},
    ]
    pools = {"short": {"max_queue_depth": 8, "max_queue_wait_s": 1.0}}
    yield from served_gateway(module_tmp, scripted_config(raw, backends=backends, pools=pools))


def _completion(prompt: int = 3, completion: int = 1) -> bytes:
    answer = {
        "id": "c",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    return json.dumps(answer).encode()


def _script(head: str, payload: bytes) -> list[list[Any]]:
    return [["send", head + payload.decode()]]


def _json_head(payload: bytes) -> str:
    return (
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    )


# --- trailers ---------------------------------------------------------------------


def test_a_chunked_answers_trailer_is_no_header_of_the_answer(gw: Gateway) -> None:
    payload = _completion()
    head = (
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
        "trailer: x-upstream-trailer\r\n\r\n"
    )
    framed = b"%x\r\n%s\r\n0\r\nx-upstream-trailer: leaked\r\ncontent-type: text/plain\r\n\r\n"
    script = _script(head, framed % (len(payload), payload))
    answer = httpx.post(gw.url + CHAT, json=body(script, stream=False), timeout=10)
    assert answer.status_code == 200
    assert answer.json()["usage"]["prompt_tokens"] == 3
    assert "x-upstream-trailer" not in answer.headers
    assert answer.headers.get_list("content-type") == ["application/json"]


# --- a whole JSON answer to stream: true ------------------------------------------


def test_a_whole_json_answer_to_a_stream_request_keeps_its_usage(gw: Gateway) -> None:
    payload = _completion(prompt=11, completion=4)
    head = _json_head(payload)
    request_id = new_id("whole-json")
    answer = httpx.post(
        gw.url + CHAT,
        json=body(_script(head, payload)),
        headers={"x-request-id": request_id},
        timeout=10,
    )
    assert answer.status_code == 200
    assert answer.content == payload
    assert answer.headers["content-length"] == str(len(payload))
    record = record_of(gw, request_id)
    assert (record["status"], record["prompt_tokens"], record["completion_tokens"]) == ("ok", 11, 4)
    assert record["ttft_s"] is None


def test_embeddings_asked_to_stream_keep_their_usage(tmp_path: Path) -> None:
    """vLLM ignores ``stream`` on /v1/embeddings and answers whole, as the simulator does."""
    sim = start_sim(tmp_path, ttft_ms=20, itl_ms=5, model="m")
    try:
        config = {
            "backends": [{"name": "s1", "url": sim.url, "pool": "short", "models": ["m"]}],
            "health": {"interval_s": 30, "failure_threshold": 1000},
        }
        gateway = start_gateway(tmp_path, config)
        try:
            request_id = new_id("embed-stream")
            answer = httpx.post(
                gateway.url + "/v1/embeddings",
                json={"model": "m", "input": "hello world", "stream": True},
                headers={"x-request-id": request_id},
                timeout=10,
            )
            assert answer.status_code == 200
            counted = answer.json()["usage"]["prompt_tokens"]
            assert counted > 0
            assert record_of(gateway, request_id)["prompt_tokens"] == counted
        finally:
            gateway.proc.stop()
    finally:
        sim.stop()


# --- pipelining -------------------------------------------------------------------


def _chat(model: str, script: list[list[Any]], stream: bool = False) -> bytes:
    request = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "raw_script": script,
    }
    return json.dumps(request).encode()


def _slow_answer(seconds: float) -> list[list[Any]]:
    payload = _completion()
    head = _json_head(payload)
    return [["pause", seconds], *_script(head, payload)]


def test_a_pipelined_requests_wait_is_neither_overhead_nor_queue_time(
    gw: Gateway, raw: Proc
) -> None:
    """Request A (another backend) takes 1.3 s; B, pipelined behind it on the same
    connection, then queues for ``raw``, whose one permit C holds until the test pokes
    it. B's queue deadline (1 s) runs from when it could start, not from its receipt:
    it is admitted once C ends. Its overhead is the gateway's own, not A's 1.3 s; its
    e2e still runs from receipt."""
    payload = _completion()
    head = _json_head(payload)
    held = [["await_poke"], *_script(head, payload)]
    ids = {name: new_id(f"pipe-{name}") for name in "abc"}
    holder = RawConnection(gw)
    pipelined = RawConnection(gw)
    try:
        holder.send(post_bytes(CHAT, _chat(MODEL, held), {"x-request-id": ids["c"]}))
        pipelined.send(
            post_bytes(CHAT, _chat("other", _slow_answer(1.3)), {"x-request-id": ids["a"]})
            + post_bytes(CHAT, _chat(MODEL, _script(head, payload)), {"x-request-id": ids["b"]})
        )
        [first] = pipelined.responses(1)
        assert first["status"] == 200
        # A is answered: B queues now. C ends at once, well within B's deadline.
        assert httpx.get(raw.url + "/poke", timeout=10).status_code == 200
        [held_answer] = holder.responses(1)
        [second] = pipelined.responses(1)
    finally:
        holder.close()
        pipelined.close()
    assert held_answer["status"] == 200
    assert second["status"] == 200, second["body"]
    assert second["headers"]["x-request-id"] == ids["b"]
    record = record_of(gw, ids["b"])
    assert record["overhead_s"] < 0.3, record
    assert record["e2e_s"] > 1.3  # from receipt: the client's view
    assert record["upstream_s"] > 1.3  # receipt → written, the pipelining wait included
