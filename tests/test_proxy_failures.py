"""Failure handling: client disconnect, dead backends, health ejection and readmission."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import (
    MODEL,
    backend,
    start_gateway,
    start_raw_sse,
    start_sim,
    wait_until,
)
from tests.raw_sse_backend import MODEL as RAW_MODEL
from tests.test_ops_robustness import start_ops_backend

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}


def engine_metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match, f"{name} not in {url}/metrics"
    return float(match.group(1))


def test_client_disconnect_cancels_the_upstream_request(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=50)
    gw = start_gateway(tmp_path, {"backends": [backend("s", sim.url)]})
    try:
        body = {**CHAT, "stream": True, "max_tokens": 2000}  # ~100 s if left alone
        with httpx.stream(
            "POST", gw.url + "/v1/chat/completions", json=body, timeout=10
        ) as response:
            lines = response.iter_lines()
            assert next(
                line for line in lines if '"content":"' in line and '"content":""' not in line
            )
            assert engine_metric(sim.url, "vllm:num_requests_running") == 1
            closed_at = time.monotonic()
        wait_until(
            lambda: engine_metric(sim.url, "kneecap_sim_cancelled_requests_total") == 1,
            timeout=5,
            interval=0.005,
        )
        elapsed = time.monotonic() - closed_at
        assert engine_metric(sim.url, "vllm:num_requests_running") == 0
        print(f"upstream observed the cancellation {elapsed * 1000:.1f} ms after the client closed")
        assert elapsed < 1.0
        state = gw.state()
        assert state["backends"][0]["in_flight"] == 0
    finally:
        gw.proc.stop()
        sim.stop()


def test_dead_backend_is_retried_on_another(tmp_path: Path) -> None:
    alive = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    doomed = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    config = {
        "backends": [backend("doomed", doomed.url), backend("alive", alive.url)],
        "health": {"interval_s": 60, "failure_threshold": 1000},
    }
    gw = start_gateway(tmp_path, config)
    try:
        assert all(b["healthy"] for b in gw.state()["backends"])
        doomed.kill()  # the gateway still believes it healthy
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        for _ in range(6):
            raw = client.chat.completions.with_raw_response.create(**CHAT, max_tokens=2)
            assert raw.headers["x-kneecap-backend"] == "alive"
            assert raw.parse().choices[0].message.content
    finally:
        gw.proc.stop()
        alive.stop()


def test_consecutive_failures_eject_passively(tmp_path: Path) -> None:
    alive = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    doomed = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    config = {
        "backends": [backend("doomed", doomed.url), backend("alive", alive.url)],
        "health": {"interval_s": 60, "failure_threshold": 2},
        # Deterministic routing: every request tries `doomed` (first on ties) before `alive`;
        # the default router draws among equals and might try it only once in four.
        "routing": {"policy": "least_loaded"},
    }
    gw = start_gateway(tmp_path, config)
    try:
        doomed.kill()
        for _ in range(4):
            assert (
                httpx.post(
                    gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1}, timeout=10
                ).status_code
                == 200
            )
        states = {b["name"]: b["healthy"] for b in gw.state()["backends"]}
        assert states == {"doomed": False, "alive": True}
    finally:
        gw.proc.stop()
        alive.stop()


def test_health_checks_eject_and_readmit(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    port = int(sim.url.rsplit(":", 1)[1])
    gw = start_gateway(
        tmp_path, {"backends": [backend("s", sim.url)], "health": {"interval_s": 0.1}}
    )
    try:
        assert httpx.get(gw.url + "/ready", timeout=5).status_code == 200
        sim.kill()
        wait_until(lambda: httpx.get(gw.url + "/ready", timeout=5).status_code == 503)
        refused = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert refused.status_code == 503
        sim = start_sim(tmp_path, port=port, ttft_ms=1, itl_ms=1)
        wait_until(lambda: httpx.get(gw.url + "/ready", timeout=5).status_code == 200)
        assert (
            httpx.post(
                gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=10
            ).status_code
            == 200
        )
    finally:
        gw.proc.stop()
        sim.stop()


def test_backend_dying_mid_stream_ends_with_an_error_event(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=20)
    gw = start_gateway(
        tmp_path, {"backends": [backend("s", sim.url)], "health": {"interval_s": 60}}
    )
    try:
        body = {**CHAT, "stream": True, "max_tokens": 500}
        events = []
        with httpx.stream(
            "POST", gw.url + "/v1/chat/completions", json=body, timeout=10
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 3:
                        sim.kill()
        assert len(events) < 500
        assert events[-1].startswith('data: {"error"')
        assert gw.state()["backends"][0]["in_flight"] == 0
    finally:
        gw.proc.stop()


def test_sdk_raises_when_the_backend_dies_mid_stream(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=20)
    gw = start_gateway(
        tmp_path, {"backends": [backend("s", sim.url)], "health": {"interval_s": 60}}
    )
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(**CHAT, stream=True, max_tokens=500)
        received = 0
        with pytest.raises(openai.APIError, match="mid-stream"):
            for _ in stream:
                received += 1
                if received == 3:
                    sim.kill()
        assert received < 500
    finally:
        gw.proc.stop()


def test_stalled_upstream_is_cut_by_the_read_timeout(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=3000)  # stalls 3 s between tokens
    config = {"backends": [backend("s", sim.url)], "upstream": {"read_timeout_s": 0.3}}
    gw = start_gateway(tmp_path, config)
    try:
        body = {**CHAT, "stream": True, "max_tokens": 5}
        started = time.monotonic()
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=10) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert time.monotonic() - started < 3  # cut before the next token would have come
        assert events[-1].startswith('data: {"error"')
        assert "ReadTimeout" in events[-1]
        metrics = httpx.get(gw.url + "/metrics", timeout=5).text
        assert 'status="upstream_timeout"} 1.0' in metrics
        assert gw.state()["backends"][0]["in_flight"] == 0
    finally:
        gw.proc.stop()
        sim.stop()


def test_a_backend_failing_every_request_is_ejected_with_no_attempt_left(tmp_path: Path) -> None:
    # Up by its /health, 500 to every request: with one attempt per request each 500 is
    # relayed as it is (no replica left to try), and still counts against the backend.
    # A healthy one beside it: passive ejection never takes a pool's last backend.
    broken = start_ops_backend(tmp_path, post_status=500)
    alive = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    config = {
        "backends": [backend("broken", broken.url), backend("alive", alive.url)],
        "health": {"interval_s": 60, "failure_threshold": 2},
        "upstream": {"max_attempts": 1},
        "routing": {"policy": "least_loaded"},  # deterministic: `broken` first on ties
    }
    gw = start_gateway(tmp_path, config)
    try:
        for _ in range(2):
            answer = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10)
            assert answer.status_code == 500
            assert answer.json() == {"error": {"message": "engine failed"}}  # the engine's own
        states = {b["name"]: b["healthy"] for b in gw.state()["backends"]}
        assert states == {"broken": False, "alive": True}
        answer = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert (answer.status_code, answer.headers["x-kneecap-backend"]) == (200, "alive")
    finally:
        gw.proc.stop()
        broken.stop()
        alive.stop()


CUT_WHOLE = 'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"id"'
SSE_HEAD = (
    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
FIRST_EVENT = 'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_backend_that_cuts_every_answer_is_ejected(tmp_path: Path, stream: bool) -> None:
    """Its heads arrive, its bodies never end: each request fails after its head. Before,
    the head counted as a success (the failure count back to 0) and the backend was never
    ejected."""
    raw = start_raw_sse(tmp_path)
    spare = start_raw_sse(tmp_path)  # passive ejection never takes a pool's last backend
    config = {
        "backends": [
            backend("cutter", raw.url, models=[RAW_MODEL]),
            backend("spare", spare.url, models=[RAW_MODEL]),
        ],
        "health": {"interval_s": 60, "failure_threshold": 2},
        "upstream": {"max_attempts": 1},
        "routing": {"policy": "least_loaded"},  # deterministic: `cutter` first on ties
    }
    gw = start_gateway(tmp_path, config)
    try:
        if stream:
            event = f"{len(FIRST_EVENT):x}\r\n{FIRST_EVENT}\r\n"
            script = [["send", SSE_HEAD + event], ["reset"]]
        else:
            script = [["send", CUT_WHOLE], ["close"]]
        body = {"model": RAW_MODEL, "messages": CHAT["messages"], "stream": stream}
        for _ in range(2):
            answer = httpx.post(
                gw.url + "/v1/chat/completions", json={**body, "raw_script": script}, timeout=10
            )
            if stream:  # the head went out: the cut is told in the stream's last event
                assert answer.status_code == 200 and '"upstream_error"' in answer.text
            else:
                assert answer.status_code == 502
        # Both went to it (threshold 2): ejected, the spare still in.
        assert [b["healthy"] for b in gw.state()["backends"]] == [False, True]
    finally:
        gw.proc.stop()
        raw.stop()
        spare.stop()
