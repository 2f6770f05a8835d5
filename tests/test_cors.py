"""CORS for browser clients, as vLLM answers it: preflights on every path, the headers
on every actual answer (proxied, streamed, refused, or Starlette's), nothing for a
request without ``Origin``, and the live ``cors:`` block after a reload."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.procs import (
    MODEL,
    Gateway,
    Proc,
    backend,
    served,
    start_gateway,
    start_raw_sse,
    start_sim,
    wait_until,
)
from tests.test_reload_live import held_chat, reload

KEY = "sk-cors"
AUTH = {"authorization": f"Bearer {KEY}"}
APP = "https://app.example"
OTHER = "https://other.example"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
PROXIED = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
STATIC_1 = {"kind": "static", "initial": 1, "min": 1, "max": 1}
# By default a browser script may read a 429's Retry-After and the request id.
EXPOSED = {"access-control-expose-headers": "retry-after, x-request-id"}


def cors_of(response: httpx.Response) -> dict[str, str]:
    return {
        name: value
        for name, value in response.headers.items()
        if name.startswith("access-control-") or name == "vary"
    }


def preflight(url: str, origin: str = APP, method: str = "POST", **headers: str) -> httpx.Response:
    asked = {"origin": origin, "access-control-request-method": method, **headers}
    return httpx.options(url, headers=asked, timeout=5)


def chat(gw: Gateway, headers: dict[str, str], **body: Any) -> httpx.Response:
    url = gw.url + "/v1/chat/completions"
    return httpx.post(url, json={**CHAT, **body}, headers=headers, timeout=10)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    yield from served(start_sim(tmp_path_factory.mktemp("cors-sim"), ttft_ms=5, itl_ms=2))


def keyed(sim: Proc, cors: dict[str, Any] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {"backends": [backend("s", sim.url)], "auth": {"api_keys": [KEY]}}
    return {**config, "cors": cors} if cors is not None else config


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, sim: Proc) -> Iterator[Gateway]:
    """vLLM's defaults: every origin, method and header; no credentials."""
    gateway = start_gateway(tmp_path_factory.mktemp("cors-gw"), keyed(sim))
    try:
        yield gateway
    finally:
        gateway.proc.stop()


@pytest.mark.parametrize(
    "path", [*PROXIED, "/v1/models", "/tokenize", "/health", "/admin/state", "/nowhere"]
)
def test_a_preflight_is_answered_on_every_path_without_a_key(gw: Gateway, path: str) -> None:
    asked = "authorization, content-type, x-kneecap-priority"
    answer = preflight(gw.url + path, **{"access-control-request-headers": asked})
    # No key sent to a keyed gateway: answered all the same, never the handler's 401.
    assert answer.status_code == 200, answer.text
    assert answer.headers["access-control-allow-origin"] == "*"
    assert "POST" in answer.headers["access-control-allow-methods"].split(", ")
    assert answer.headers["access-control-allow-headers"] == asked
    assert answer.headers["vary"].startswith("Origin")


def test_a_preflight_is_not_counted_as_a_request(gw: Gateway) -> None:
    def seen() -> int:
        return len(httpx.get(gw.url + "/admin/requests", timeout=5).json()["requests"])

    assert chat(gw, AUTH).status_code == 200
    wait_until(lambda: seen() > 0)
    before = seen()
    for path in PROXIED:
        assert preflight(gw.url + path).status_code == 200
    assert chat(gw, AUTH).status_code == 200
    wait_until(lambda: seen() > before)
    assert seen() == before + 1


def test_a_streamed_answer_carries_the_headers(gw: Gateway) -> None:
    client = openai.OpenAI(
        base_url=gw.url + "/v1", api_key=KEY, default_headers={"Origin": APP}, max_retries=0
    )
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5, stream=True
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.headers["access-control-allow-origin"] == "*"
    assert raw.headers["vary"] == "Origin"
    assert raw.headers["x-request-id"]
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text


@pytest.mark.parametrize(
    ("method", "path", "headers", "body", "status"),
    [
        ("POST", "/v1/chat/completions", {}, CHAT, 401),
        ("POST", "/v1/embeddings", AUTH, {"model": MODEL}, 400),
        ("POST", "/v1/chat/completions", AUTH, {**CHAT, "model": "nobody"}, 404),
        ("GET", "/v1/models", {}, None, 401),
        ("GET", "/nowhere", AUTH, None, 404),
        ("DELETE", "/v1/chat/completions", AUTH, None, 405),
    ],
    ids=["proxied-401", "proxied-400", "proxied-404", "models-401", "unknown-404", "405"],
)
def test_an_error_carries_the_headers(
    gw: Gateway, method: str, path: str, headers: dict, body: Any, status: int
) -> None:
    answer = httpx.request(
        method, gw.url + path, json=body, headers={**headers, "origin": APP}, timeout=10
    )
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["message"]
    assert answer.headers["access-control-allow-origin"] == "*"
    assert answer.headers["vary"] == "Origin"


def test_without_origin_a_proxied_answer_has_no_cors_headers(gw: Gateway) -> None:
    answers = [chat(gw, AUTH), chat(gw, AUTH, stream=True), chat(gw, {})]
    assert [a.status_code for a in answers] == [200, 200, 401]
    assert [cors_of(a) for a in answers] == [{}, {}, {}]
    # Starlette's own routes say their answer varies by origin (it may be cached).
    models = httpx.get(gw.url + "/v1/models", headers=AUTH, timeout=5)
    assert cors_of(models) == {"vary": "Origin"}


def test_a_full_queue_s_429_carries_the_headers(tmp_path: Path) -> None:
    raw = start_raw_sse(tmp_path)  # its held stream keeps the one permit until poked
    config = {
        "backends": [backend("s", raw.url, limit=STATIC_1)],
        "pools": {"short": {"max_queue_depth": 0}},
        "cors": {"allowed_origins": [APP]},
    }
    gw = start_gateway(tmp_path, config)
    try:
        with ThreadPoolExecutor(1) as clients:
            url = gw.url + "/v1/chat/completions"
            holder = clients.submit(httpx.post, url, json=held_chat(), timeout=30)
            wait_until(lambda: gw.state()["backends"][0]["in_flight"] == 1)
            full = httpx.post(url, json=CHAT, headers={"origin": APP}, timeout=10)
            assert httpx.get(raw.url + "/poke", timeout=10).status_code == 200
            assert holder.result(timeout=30).status_code == 200
        assert full.status_code == 429
        assert full.json()["error"]["code"] == "queue_full"
        assert cors_of(full) == {"access-control-allow-origin": APP, "vary": "Origin", **EXPOSED}
        assert full.headers["retry-after"]
    finally:
        gw.proc.stop()
        raw.stop()


# (cors block, origin) -> what every actual answer carries, proxied or Starlette's.
EXPECTED: list[tuple[dict[str, Any], dict[str, dict[str, str]]]] = [
    (
        {},
        {
            o: {"access-control-allow-origin": "*", "vary": "Origin", **EXPOSED}
            for o in (APP, OTHER)
        },
    ),
    (
        {"allowed_origins": [APP]},
        {
            APP: {"access-control-allow-origin": APP, "vary": "Origin", **EXPOSED},
            OTHER: {"vary": "Origin", **EXPOSED},
        },
    ),
    (
        {"allow_credentials": True, "expose_headers": []},
        {
            o: {
                "access-control-allow-origin": o,
                "access-control-allow-credentials": "true",
                "vary": "Origin",
            }
            for o in (APP, OTHER)
        },
    ),
    (
        {"allowed_origins": [APP], "allow_credentials": True, "expose_headers": ["retry-after"]},
        {
            APP: {
                "access-control-allow-origin": APP,
                "access-control-allow-credentials": "true",
                "access-control-expose-headers": "retry-after",
                "vary": "Origin",
            },
            OTHER: {
                "access-control-allow-credentials": "true",
                "access-control-expose-headers": "retry-after",
                "vary": "Origin",
            },
        },
    ),
]


def test_each_reloaded_cors_block_answers_alike_on_proxied_and_starlette_paths(
    tmp_path: Path, sim: Proc
) -> None:
    """No restart between the blocks: each reload's answers are its block's own."""
    gw = start_gateway(tmp_path, keyed(sim, {"allowed_origins": [OTHER]}))
    try:
        for cors, expected in EXPECTED:
            reload(gw, keyed(sim, cors))
            for origin, headers in expected.items():
                proxied = chat(gw, {**AUTH, "origin": origin})
                streamed = chat(gw, {**AUTH, "origin": origin}, stream=True)
                models = httpx.get(gw.url + "/v1/models", headers={**AUTH, "origin": origin})
                assert [proxied.status_code, streamed.status_code, models.status_code] == [200] * 3
                assert cors_of(proxied) == cors_of(streamed) == cors_of(models) == headers, cors
                allowed = "access-control-allow-origin" in headers
                answer = preflight(gw.url + "/v1/chat/completions", origin)
                assert answer.status_code == (200 if allowed else 400), (cors, origin)
    finally:
        gw.proc.stop()


def test_a_refused_preflight_says_why_in_the_openai_shape(tmp_path: Path, sim: Proc) -> None:
    cors = {"allowed_origins": [APP], "allowed_methods": ["POST"], "allowed_headers": ["x-a"]}
    gw = start_gateway(tmp_path, keyed(sim, cors))
    url = gw.url + "/v1/chat/completions"
    try:
        ok = preflight(url, **{"access-control-request-headers": "X-A, content-type"})
        assert ok.status_code == 200, ok.text
        assert ok.headers["access-control-allow-origin"] == APP
        refusals = {
            "origin": preflight(url, OTHER),
            "method": preflight(url, method="DELETE"),
            "headers": preflight(url, **{"access-control-request-headers": "x-b"}),
        }
        for failure, answer in refusals.items():
            assert answer.status_code == 400
            assert answer.headers["content-type"] == "application/json"
            assert answer.json() == {
                "error": {
                    "message": f"Disallowed CORS {failure}",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "cors_disallowed",
                }
            }
            assert answer.headers["vary"].startswith("Origin")
    finally:
        gw.proc.stop()


def test_a_backend_s_own_cors_headers_never_reach_the_client(tmp_path: Path) -> None:
    """The backend saw the browser's ``Origin`` too: its allowing every origin must not
    undo a gateway that allows one."""
    raw = start_raw_sse(tmp_path)
    gw = start_gateway(
        tmp_path, {"backends": [backend("s", raw.url)], "cors": {"allowed_origins": [APP]}}
    )
    body = json.dumps({"object": "chat.completion", "choices": []})
    head = (
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        "access-control-allow-origin: *\r\naccess-control-allow-credentials: true\r\n"
        "access-control-expose-headers: x-secret\r\nvary: Accept-Encoding, origin\r\n"
    )
    script = [["send", f"{head}content-length: {len(body)}\r\n\r\n{body}"]]
    try:
        answers = {}
        for origin in (APP, OTHER):
            answer = chat(gw, {"origin": origin}, raw_script=script)
            assert answer.status_code == 200, answer.text
            answers[origin] = cors_of(answer)
        assert answers == {
            APP: {"access-control-allow-origin": APP, "vary": "Accept-Encoding, origin", **EXPOSED},
            OTHER: {"vary": "Accept-Encoding, origin", **EXPOSED},
        }
    finally:
        gw.proc.stop()
        raw.stop()
