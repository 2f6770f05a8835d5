"""Admission through the real HTTP path: limits hold, the queue waits or sheds cleanly."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import (
    MODEL,
    Gateway,
    Proc,
    backend,
    start_gateway,
    start_raw_sse,
    start_sim,
    wait_until,
)
from tests.test_reload_live import HEAD, chat, held_chat, sse

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
STATIC_1 = {"kind": "static", "initial": 1, "min": 1, "max": 1}


@pytest.fixture
def slow_sim(tmp_path: Path) -> Iterator[Proc]:
    sim = start_sim(tmp_path, ttft_ms=5, itl_ms=20)
    try:
        yield sim
    finally:
        sim.stop()


def gateway_with(tmp_path: Path, sim: Proc, limit: dict, **pool: object) -> Gateway:
    config = {
        "backends": [backend("s", sim.url, limit=limit)],
        "pools": {"short": {"max_queue_depth": 8, "max_queue_wait_s": 30, **pool}},
    }
    return start_gateway(tmp_path, config)


def is_token(line: str) -> bool:
    return '"content":"' in line and '"content":""' not in line


def stream_in_background(
    gw: Gateway, tokens: int, results: list, headers: dict | None = None
) -> threading.Thread:
    def run() -> None:
        body = {**CHAT, "stream": True, "max_tokens": tokens}
        with httpx.stream(
            "POST", gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
        ) as r:
            results.append((r.status_code, sum(1 for line in r.iter_lines() if is_token(line))))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def pool_state(gw: Gateway) -> dict:
    return gw.state()["pools"]["short"]


def test_limit_holds_and_queued_requests_complete(tmp_path: Path, slow_sim: Proc) -> None:
    gw = gateway_with(tmp_path, slow_sim, {"kind": "static", "initial": 2, "min": 1, "max": 2})
    results: list = []
    peak = [0]
    stop = threading.Event()

    def watch() -> None:  # the engine's own view of what runs
        while not stop.is_set():
            text = httpx.get(slow_sim.url + "/metrics", timeout=5).text
            line = next(
                line for line in text.splitlines() if line.startswith("vllm:num_requests_running")
            )
            peak[0] = max(peak[0], int(float(line.rsplit(" ", 1)[1])))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        threads = [stream_in_background(gw, 10, results) for _ in range(6)]
        wait_until(lambda: pool_state(gw)["queue_depth"] >= 1)
        for t in threads:
            t.join(30)
    finally:
        stop.set()
        watcher.join(10)
        gw.proc.stop()
    assert results == [(200, 10)] * 6
    assert peak[0] == 2


def test_full_queue_and_deadline_shed_with_429_and_retry_after(
    tmp_path: Path, slow_sim: Proc
) -> None:
    gw = gateway_with(tmp_path, slow_sim, STATIC_1, max_queue_depth=1)
    results: list = []
    try:
        busy = stream_in_background(gw, 100, results)  # ~2 s
        wait_until(lambda: gw.state()["backends"][0]["in_flight"] == 1)
        timed_out = httpx.post(
            gw.url + "/v1/chat/completions",
            json=CHAT,
            headers={"x-kneecap-max-queue-wait": "0.1"},
            timeout=10,
        )
        assert timed_out.status_code == 429
        assert timed_out.json()["error"]["code"] == "queue_timeout"
        assert 1 <= int(timed_out.headers["retry-after"]) <= 60
        queued = stream_in_background(gw, 1, results)
        wait_until(lambda: pool_state(gw)["queue_depth"] == 1)
        full = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert full.status_code == 429
        assert full.json()["error"]["code"] == "queue_full"
        assert 1 <= int(full.headers["retry-after"]) <= 60
        queued.join(30)
        metrics = httpx.get(gw.url + "/metrics", timeout=5).text
        assert 'kneecap_rejected_requests_total{pool="short",reason="queue_full"} 1.0' in metrics
        assert 'kneecap_rejected_requests_total{pool="short",reason="queue_timeout"} 1.0' in metrics
        busy.join(30)
        assert sorted(results) == [(200, 1), (200, 100)]
        assert gw.state()["pools"]["short"] == {"queue_depth": 0, "leased": 0}
    finally:
        gw.proc.stop()


def test_bad_admission_headers_are_400(tmp_path: Path, slow_sim: Proc) -> None:
    gw = gateway_with(tmp_path, slow_sim, STATIC_1)
    try:
        for header, value in (
            ("x-kneecap-priority", "urgent"),
            ("x-kneecap-max-queue-wait", "soon"),
        ):
            response = httpx.post(
                gw.url + "/v1/chat/completions", json=CHAT, headers={header: value}, timeout=10
            )
            assert response.status_code == 400
            assert header in response.json()["error"]["message"]
        assert gw.state()["pools"]["short"]["leased"] == 0
    finally:
        gw.proc.stop()


def test_openai_sdk_retries_a_429_on_its_own(tmp_path: Path, slow_sim: Proc) -> None:
    gw = gateway_with(tmp_path, slow_sim, STATIC_1, max_queue_depth=0)
    results: list = []
    try:
        busy = stream_in_background(gw, 30, results)  # ~0.6 s
        wait_until(lambda: gw.state()["backends"][0]["in_flight"] == 1)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=3)
        reply = client.chat.completions.create(**CHAT, max_tokens=2)
        assert reply.choices[0].message.content
        metrics = httpx.get(gw.url + "/metrics", timeout=5).text
        shed = 'kneecap_rejected_requests_total{pool="short",reason="queue_full"} '
        line = next(line for line in metrics.splitlines() if line.startswith(shed))
        assert float(line.rsplit(" ", 1)[1]) >= 1  # the SDK was refused, then retried by itself
        busy.join(30)
    finally:
        gw.proc.stop()


def test_waiter_that_disconnects_leaves_the_queue(tmp_path: Path, slow_sim: Proc) -> None:
    gw = gateway_with(tmp_path, slow_sim, STATIC_1)
    results: list = []
    try:
        busy = stream_in_background(gw, 250, results)  # ~5 s
        wait_until(lambda: gw.state()["backends"][0]["in_flight"] == 1)
        # Response headers only come after admission: this client gives up while queued.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                gw.url + "/v1/chat/completions", json=CHAT, timeout=httpx.Timeout(5, read=0.5)
            )
        wait_until(lambda: pool_state(gw)["queue_depth"] == 0)
        assert busy.is_alive()  # left the queue by itself, not because capacity freed
        busy.join(30)
        assert results == [(200, 250)]
        assert pool_state(gw) == {"queue_depth": 0, "leased": 0}
    finally:
        gw.proc.stop()


def test_control_endpoints_are_never_queued(tmp_path: Path, slow_sim: Proc) -> None:
    gw = gateway_with(tmp_path, slow_sim, STATIC_1)
    results: list = []
    try:
        threads = [stream_in_background(gw, 50, results) for _ in range(4)]
        wait_until(lambda: pool_state(gw)["queue_depth"] == 3)
        for path in ("/health", "/ready", "/metrics", "/v1/models", "/admin/state"):
            assert httpx.get(gw.url + path, timeout=2).status_code == 200
        for t in threads:
            t.join(30)
        assert len(results) == 4
    finally:
        gw.proc.stop()


def test_reload_raises_the_limit_without_losing_queued_requests(
    tmp_path: Path, slow_sim: Proc
) -> None:
    gw = gateway_with(tmp_path, slow_sim, STATIC_1)
    results: list = []
    try:
        threads = [stream_in_background(gw, 250, results) for _ in range(4)]  # ~5 s each
        wait_until(lambda: pool_state(gw)["queue_depth"] == 3)
        config = dict(gw.config)
        config["backends"] = [
            backend("s", slow_sim.url, limit={"kind": "static", "initial": 4, "min": 1, "max": 4})
        ]
        gw.write_config(config)
        assert httpx.post(gw.url + "/admin/reload", timeout=5).json()["ok"]
        wait_until(lambda: gw.state()["backends"][0]["in_flight"] == 4)
        assert pool_state(gw)["queue_depth"] == 0
        for t in threads:
            t.join(30)
        assert results == [(200, 250)] * 4
    finally:
        gw.proc.stop()


def test_a_request_for_an_idle_backend_does_not_wait_behind_one_for_a_busy_one(
    tmp_path: Path,
) -> None:
    # One pool, two backends serving different models. A request for the second model
    # waited behind a queued one for the first, busy, model, and was shed at its deadline
    # while its own backend was idle.
    other = "meta-llama/Llama-3.1-8B"
    busy = start_sim(tmp_path, ttft_ms=2, itl_ms=20)
    idle = start_sim(tmp_path, ttft_ms=2, itl_ms=2, model=other)
    gw = start_gateway(
        tmp_path,
        {
            "backends": [
                backend("busy", busy.url, limit=STATIC_1),
                {**backend("idle", idle.url), "models": [other]},
            ]
        },
    )
    long_stream = {**CHAT, "stream": True, "max_tokens": 200, "ignore_eos": True}  # ~4 s
    url = gw.url + "/v1/chat/completions"
    threads = [
        threading.Thread(target=lambda: httpx.post(url, json=long_stream, timeout=30))
        for _ in range(2)
    ]
    try:
        threads[0].start()
        wait_until(lambda: gw.state()["backends"][0]["in_flight"] == 1)
        threads[1].start()  # queues for the busy backend
        wait_until(lambda: gw.state()["pools"]["short"]["queue_depth"] == 1)
        answer = httpx.post(
            url,
            json={"model": other, "messages": CHAT["messages"], "max_tokens": 2},
            headers={"x-kneecap-max-queue-wait": "0.5"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kneecap-backend"] == "idle"
        assert gw.state()["pools"]["short"]["queue_depth"] == 1  # the other still waits
    finally:
        for t in threads:
            t.join(30)
        gw.proc.stop()
        busy.stop()
        idle.stop()


def test_a_batch_key_cannot_make_itself_interactive(tmp_path: Path) -> None:
    raw = start_raw_sse(tmp_path)  # its held stream keeps the one permit until poked
    config = {
        "backends": [backend("s", raw.url, limit=STATIC_1)],
        "pools": {"short": {"max_queue_depth": 8, "max_queue_wait_s": 30}},
        "auth": {"api_keys": ["sk-team", {"key": "sk-nightly", "priority": "batch"}]},
    }
    gw = start_gateway(tmp_path, config)
    team = {"authorization": "Bearer sk-team"}
    quick = chat([["send", HEAD + sse("a") + "data: [DONE]\n\n"], ["close"]])

    def queued(priority: str) -> float:
        text = httpx.get(gw.url + "/metrics", timeout=5).text
        prefix = f'kneecap_queue_depth{{pool="short",priority="{priority}"}} '
        line = next(line for line in text.splitlines() if line.startswith(prefix))
        return float(line[len(prefix) :])

    def post(body: dict, headers: dict) -> int:
        url = gw.url + "/v1/chat/completions"
        return httpx.post(url, json=body, headers=headers, timeout=30).status_code

    try:
        with ThreadPoolExecutor(3) as clients:
            holder = clients.submit(post, held_chat(), team)
            wait_until(lambda: gw.state()["backends"][0]["in_flight"] == 1)
            claims = {"authorization": "Bearer sk-nightly", "x-kneecap-priority": "interactive"}
            waiter = clients.submit(post, quick, claims)
            wait_until(lambda: pool_state(gw)["queue_depth"] == 1)
            # The operator made this key batch: its header may not lift it over others.
            assert (queued("batch"), queued("interactive")) == (1.0, 0.0)
            yields = clients.submit(post, quick, {**team, "x-kneecap-priority": "batch"})
            wait_until(lambda: pool_state(gw)["queue_depth"] == 2)  # a client may yield
            assert (queued("batch"), queued("interactive")) == (2.0, 0.0)
            assert httpx.get(raw.url + "/poke", timeout=10).status_code == 200
            assert [f.result(timeout=30) for f in (holder, waiter, yields)] == [200, 200, 200]
    finally:
        gw.proc.stop()
        raw.stop()
