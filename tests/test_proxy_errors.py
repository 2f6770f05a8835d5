"""Every refusal is an OpenAI-style error with the right status, over raw HTTP."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.procs import MODEL, Gateway, backend, free_port, start_gateway


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
