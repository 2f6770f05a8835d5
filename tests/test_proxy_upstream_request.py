"""What the backend receives: the gateway's upstream request, read back by an echo backend."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from gateway.proxy_finish import usage_of
from gateway.proxy_request import ProxyRequest, prepare_stream
from tests.procs import Proc, free_port, start_gateway, start_process

MODEL = "echo"


def start_echo(tmp: Path) -> Proc:
    port = free_port()
    return start_process(
        ["--port", str(port)],
        f"http://127.0.0.1:{port}",
        "/health",
        tmp / f"echo-{port}.log",  # several may share a directory
        module="tests.echo_backend",
    )


def echo_backend(url: str, **extra: object) -> dict[str, object]:
    return {"name": "echo", "url": url, "pool": "short", "models": [MODEL], **extra}


def fields_of(echoed: dict) -> list[tuple[str, str]]:
    return [(name.lower(), value) for name, value in echoed["headers"]]


CLIENT_HEADERS = {
    "authorization": "Bearer client-secret",
    "x-custom": "kept as is",
    "accept-encoding": "gzip, br",
    "content-type": "application/json; charset=utf-8",
    "x-request-id": "req-42",
    "connection": "keep-alive",
}


def test_backend_gets_client_headers_minus_the_gateways_business(tmp_path: Path) -> None:
    echo = start_echo(tmp_path)
    gw = start_gateway(tmp_path, {"backends": [echo_backend(echo.url, api_key="backend-key")]})
    try:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "é"}]})
        response = httpx.post(
            gw.url + "/v1/chat/completions",
            content=body.encode(),
            headers=CLIENT_HEADERS,
            timeout=10,
        )
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "req-42"
        echoed = response.json()
        fields = fields_of(echoed)
        names = [name for name, _ in fields]
        assert echoed["request_line"] == "POST /v1/chat/completions HTTP/1.1"
        assert echoed["body"] == body  # non-streamed: forwarded untouched
        assert ("x-custom", "kept as is") in fields
        assert ("authorization", "Bearer backend-key") in fields  # never the client's key
        assert ("accept-encoding", "identity") in fields
        assert ("content-type", "application/json") in fields
        assert ("x-request-id", "req-42") in fields
        assert ("host", echo.url.removeprefix("http://")) in fields
        assert ("content-length", str(len(body.encode()))) in fields
        for name in ("authorization", "accept-encoding", "content-type", "x-request-id", "host"):
            assert names.count(name) == 1, name
        assert "connection" not in names
    finally:
        gw.proc.stop()
        echo.stop()


@pytest.mark.parametrize("forward", [True, False])
def test_client_key_is_forwarded_only_when_configured(tmp_path: Path, forward: bool) -> None:
    echo = start_echo(tmp_path)
    config = {"backends": [echo_backend(echo.url)], "auth": {"forward_client_key": forward}}
    gw = start_gateway(tmp_path, config)
    try:
        response = httpx.post(
            gw.url + "/v1/completions",
            json={"model": MODEL, "prompt": "x"},
            headers={"authorization": "Bearer client-secret"},
            timeout=10,
        )
        assert response.status_code == 200
        auth = [v for n, v in fields_of(response.json()) if n == "authorization"]
        assert auth == (["Bearer client-secret"] if forward else [])
    finally:
        gw.proc.stop()
        echo.stop()


def prepared(payload: dict, body: bytes | None = None, endpoint: str = "/v1/chat/completions"):
    request = ProxyRequest(
        endpoint=endpoint,
        payload=payload,
        body=body if body is not None else json.dumps(payload).encode(),
        headers={},
        raw_headers=[],
        request_id="r",
        started=0.0,
    )
    strip = prepare_stream(request)
    return strip, request.body


def test_usage_is_asked_for_without_touching_the_rest_of_the_body() -> None:
    payload = {"model": "m", "messages": [{"role": "user", "content": "ü \\n"}], "stream": True}
    body = json.dumps(payload, ensure_ascii=False).encode() + b"\n"
    strip, sent = prepared(payload, body)
    assert strip is True
    assert sent.startswith(body.rstrip()[:-1])  # the client's bytes, then the added key
    assert json.loads(sent) == {**payload, "stream_options": {"include_usage": True}}


def test_clients_other_stream_options_are_kept_but_continuous_usage_stays_off() -> None:
    # vLLM honours continuous_usage_stats only with include_usage: forwarded as is beside
    # the gateway's include_usage, it would put usage on every chunk the client gets.
    options = {"continuous_usage_stats": True, "x_engine_option": 1}
    payload = {"model": "m", "prompt": "x", "stream_options": options}
    strip, sent = prepared(payload, endpoint="/v1/completions")
    assert strip is True
    forwarded = json.loads(sent)["stream_options"]
    assert forwarded == {**options, "continuous_usage_stats": False, "include_usage": True}


def test_null_stream_options_are_replaced() -> None:
    strip, sent = prepared({"model": "m", "prompt": "x", "stream_options": None})
    assert strip is True
    assert json.loads(sent)["stream_options"] == {"include_usage": True}


def test_stream_options_the_engine_would_refuse_go_up_untouched() -> None:
    """Not an object: the engine's own 400 is the client's answer, not a stream the
    gateway made valid by replacing them."""
    payload = {"model": "m", "prompt": "x", "stream_options": "not-an-object"}
    body = json.dumps(payload).encode()
    assert prepared(payload, body) == (False, body)


def test_client_asking_for_usage_and_embeddings_are_left_alone() -> None:
    payload = {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}
    body = json.dumps(payload).encode()
    assert prepared(payload, body) == (False, body)
    embedding = {"model": "m", "input": "x"}
    body = json.dumps(embedding).encode()
    assert prepared(embedding, body, "/v1/embeddings") == (False, body)


def completion(content: str, usage: object, **extra: object) -> bytes:
    body = {"id": "c", "choices": [{"message": {"content": content}}], **extra, "usage": usage}
    return json.dumps(body).encode()


USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


@pytest.mark.parametrize(
    "body",
    [
        completion("plain", USAGE),
        completion('the model wrote "usage": {"prompt_tokens": 99} itself', USAGE),
        completion("x", USAGE)[:-1] + b', "extra": {"usage": "not an object"}}',  # nested, later
        json.dumps({"usage": USAGE, "choices": []}, indent=2).encode(),  # usage first, spaced
    ],
)
def test_usage_is_read_from_non_streamed_bodies(body: bytes) -> None:
    usage = usage_of(body)
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (7, 3)


@pytest.mark.parametrize("body", [b"not json", completion("x", None), b'{"usage": [1, 2]}'])
def test_bodies_without_usable_usage_give_none(body: bytes) -> None:
    assert usage_of(body) is None
