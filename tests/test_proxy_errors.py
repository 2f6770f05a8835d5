"""Every refusal is an OpenAI-style error with the right status, over raw HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.procs import (
    MODEL,
    Gateway,
    Proc,
    backend,
    free_port,
    start_gateway,
    start_sim,
    wait_until,
)
from tests.test_proxy_wire import sim_running


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert {"message", "type", "param", "code"} <= set(body["error"])
    assert body["error"]["message"]
    return body["error"]


def post(gateway: Gateway, path: str, **kwargs) -> httpx.Response:
    return httpx.post(gateway.url + path, timeout=10, **kwargs)


def test_malformed_json_is_400(gateway: Gateway) -> None:
    response = post(
        gateway,
        "/v1/chat/completions",
        content=b'{"model": ',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    assert error_of(response)["type"] == "invalid_request_error"


def test_non_object_json_is_400(gateway: Gateway) -> None:
    response = post(gateway, "/v1/chat/completions", json=[1, 2])
    assert response.status_code == 400


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "model"),
        ("/v1/chat/completions", {"model": MODEL}, "messages"),
        ("/v1/completions", {"model": MODEL}, "prompt"),
        ("/v1/embeddings", {"model": MODEL}, "input"),
    ],
)
def test_missing_required_parameter_is_400_naming_it(
    gateway: Gateway, path: str, body: dict, param: str
) -> None:
    response = post(gateway, path, json=body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == param
    assert param in error["message"]


def test_unknown_model_is_404_model_not_found(gateway: Gateway) -> None:
    response = post(
        gateway,
        "/v1/chat/completions",
        json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
    )
    assert response.status_code == 404
    assert error_of(response)["code"] == "model_not_found"


def test_body_over_limit_is_413(tmp_path: Path, gateway: Gateway) -> None:
    big = {"model": MODEL, "prompt": "x" * (17 * 1024 * 1024)}
    response = post(gateway, "/v1/completions", json=big)
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"


def test_unknown_route_is_openai_404(gateway: Gateway) -> None:
    response = httpx.get(gateway.url + "/v1/nothing", timeout=5)
    assert response.status_code == 404
    error_of(response)


def test_backend_errors_pass_through_with_their_status(gateway: Gateway) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}
    response = post(gateway, "/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert error_of(response)["param"] == "max_tokens"


def test_no_healthy_backend_is_503(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    gw = start_gateway(
        tmp_path, {"backends": [backend("dead", dead)], "health": {"interval_s": 30}}
    )
    try:
        ready = httpx.get(gw.url + "/ready", timeout=5)
        assert ready.status_code == 503
        response = post(
            gw,
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        )
        assert response.status_code == 503
        assert error_of(response)["code"] == "no_healthy_backend"
        assert httpx.get(gw.url + "/health", timeout=5).status_code == 200
    finally:
        gw.proc.stop()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings", "/tokenize"])
def test_json_nested_too_deeply_is_400_not_a_crash(gateway: Gateway, path: str) -> None:
    # json's decoder recurses per level: past the interpreter's limit it raised out of
    # the handler, and uvicorn answered a plain-text 500.
    response = post(
        gateway, path, content=b"[" * 5000, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert error_of(response)["code"] == "invalid_json"


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_other_methods_on_a_proxied_path_are_405_naming_post(gateway: Gateway, method: str) -> None:
    response = httpx.request(method, gateway.url + "/v1/chat/completions", timeout=10)
    assert response.status_code == 405
    assert error_of(response)["code"] == "method_not_allowed"
    assert "POST" in response.headers["allow"]


def test_tokenize_refuses_a_body_over_the_limit_like_the_proxied_paths(gateway: Gateway) -> None:
    big = {"model": MODEL, "prompt": "x" * (17 * 1024 * 1024)}
    response = post(gateway, "/tokenize", json=big)
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        # pydantic's first error for a message no branch of vLLM's union reads
        ([1], "body.messages.0.ChatCompletionDeveloperMessageParam"),
        ([{"role": "user", "content": "lone \\ud800 surrogate"}], "messages"),
    ],
    ids=["message-not-an-object", "lone-surrogate"],
)
def test_a_prompt_the_engine_cannot_read_is_its_400_not_a_500(
    gateway: Gateway, messages: list, param: str
) -> None:
    # The simulator answered these with a bare text/plain 500, which the gateway retried
    # on the other replica; vLLM answers 400 JSON, and so does the simulator now.
    body = b'{"model": "%s", "messages": %s}' % (
        MODEL.encode(),
        json.dumps(messages).replace("\\\\u", "\\u").encode(),
    )
    response = post(gateway, "/v1/chat/completions", content=body)
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")
    assert error_of(response)["param"] == param


def test_the_simulator_reads_output_bounds_and_n_as_vllm_does(gateway: Gateway) -> None:
    # It generated max_tokens over max_completion_tokens, 256 tokens for max_tokens 0, and
    # one choice where n were asked (then refused n > 1; now serves it as vLLM does).
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "ignore_eos": True}
    both = post(
        gateway, "/v1/chat/completions", json={**chat, "max_tokens": 5, "max_completion_tokens": 2}
    )
    assert both.status_code == 200
    assert both.json()["usage"]["completion_tokens"] == 2
    zero = post(gateway, "/v1/chat/completions", json={**chat, "max_tokens": 0})
    assert zero.status_code == 400 and error_of(zero)["param"] == "max_tokens"
    several = post(gateway, "/v1/chat/completions", json={**chat, "n": 2, "max_tokens": 2})
    assert several.status_code == 200, several.text
    assert [c["index"] for c in several.json()["choices"]] == [0, 1]
    assert several.json()["usage"]["completion_tokens"] == 4


def test_the_simulator_reads_include_usage_as_vllm_does(sims: list[Proc]) -> None:
    # It read only a JSON true: "true" and 1, which vLLM reads as true, got no usage
    # chunk, and options vLLM refuses were served.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
    for flag in ("true", 1, "YES"):
        body = {**chat, "max_tokens": 2, "stream_options": {"include_usage": flag}}
        response = httpx.post(sims[0].url + "/v1/chat/completions", json=body, timeout=10)
        assert response.status_code == 200
        assert '"completion_tokens":2' in response.text, flag
    # vLLM 0.32 names the field as its pydantic validation error does.
    for options, param in (
        ("yes", "body.stream_options"),
        ({"include_usage": "maybe"}, "body.stream_options.include_usage"),
        ([1], "body.stream_options"),
    ):
        body = {**chat, "max_tokens": 2, "stream_options": options}
        response = httpx.post(sims[0].url + "/v1/chat/completions", json=body, timeout=10)
        assert response.status_code == 400, options
        assert error_of(response)["param"] == param


def test_the_simulators_tokenize_takes_the_served_model_when_none_is_named(
    sims: list[Proc],
) -> None:
    # vLLM makes `model` optional on /tokenize; the simulator answered 404 "`None`".
    response = httpx.post(sims[0].url + "/tokenize", json={"prompt": "abcdefgh"}, timeout=10)
    assert response.status_code == 200
    assert response.json()["count"] == 2  # 4 UTF-8 bytes a token


def test_a_fixed_latency_simulator_lets_a_client_leave_mid_stream_quietly(tmp_path: Path) -> None:
    # Closing its token generator from the disconnect watcher while the stream was inside
    # it raised "aclose(): asynchronous generator is already running": one ERROR and a
    # traceback per client that left, in the gateway's log when the sim is embedded.
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=20)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
        for _ in range(3):
            with httpx.stream(
                "POST", sim.url + "/v1/chat/completions", json={**body, "max_tokens": 500}
            ) as stream:
                next(stream.iter_bytes())  # under way; then the client leaves
        wait_until(lambda: sim_running(sim) == 0)
    finally:
        sim.stop()
    assert "Exception in ASGI application" not in sim.output()
    assert "already running" not in sim.output()
