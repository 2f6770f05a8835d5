"""Live reload under streaming traffic, invalid reloads, and auth."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import MODEL, backend, free_port, start_gateway, start_sim, wait_until

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}


def test_reload_under_streaming_traffic_fails_no_request(tmp_path: Path) -> None:
    first = start_sim(tmp_path, ttft_ms=2, itl_ms=5)
    second = start_sim(tmp_path, ttft_ms=2, itl_ms=5)
    gw = start_gateway(
        tmp_path, {"backends": [backend("a", first.url)], "health": {"interval_s": 0.2}}
    )
    stop = threading.Event()
    failures: list[str] = []
    completed = [0]
    lock = threading.Lock()

    def client_loop() -> None:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        while not stop.is_set():
            try:
                stream = client.chat.completions.create(**CHAT, stream=True, max_tokens=20)
                tokens = sum(1 for c in stream if c.choices and c.choices[0].delta.content)
                if tokens != 20:
                    failures.append(f"short stream: {tokens}")
            except Exception as exc:
                failures.append(repr(exc))
            with lock:
                completed[0] += 1

    threads = [threading.Thread(target=client_loop) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: completed[0] >= 10)
        # Add a backend by admin endpoint, then swap the first out by SIGHUP.
        gw.write_config(
            {**gw.config, "backends": [backend("a", first.url), backend("b", second.url)]}
        )
        assert httpx.post(gw.url + "/admin/reload", timeout=5).json()["ok"] is True
        wait_until(lambda: any(b["name"] == "b" and b["healthy"] for b in gw.state()["backends"]))
        mark = completed[0]
        wait_until(lambda: completed[0] >= mark + 10)
        gw.write_config({**gw.config, "backends": [backend("b", second.url)]})
        os.kill(gw.proc.pid, signal.SIGHUP)
        wait_until(lambda: [b["name"] for b in gw.state()["backends"]] == ["b"])
        mark = completed[0]
        wait_until(lambda: completed[0] >= mark + 10)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        gw.proc.stop()
        first.stop()
        second.stop()
    assert failures == []
    assert completed[0] >= 30


def test_invalid_reload_keeps_the_old_config(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    gw = start_gateway(tmp_path, {"backends": [backend("a", sim.url)]})
    try:
        gw.config_path.write_text("backends: [{name: a, url: 'not a url'}]\n")
        response = httpx.post(gw.url + "/admin/reload", timeout=5)
        assert response.status_code == 400
        body = response.json()
        assert body["ok"] is False and "backends.0" in body["message"]
        gw.config_path.write_text("backends: [unclosed\n")
        assert "invalid YAML" in httpx.post(gw.url + "/admin/reload", timeout=5).json()["message"]
        ok = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=10)
        assert ok.status_code == 200
        assert [b["name"] for b in gw.state()["backends"]] == ["a"]
    finally:
        gw.proc.stop()
        sim.stop()


def test_a_reload_naming_a_port_no_url_can_have_is_refused_whole(tmp_path: Path) -> None:
    """``http://host:80000`` passed the check for a scheme, then raised in the reload's
    checks after the new config had been swapped in: a 500, the bad config live, the
    reload counted neither way."""
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    gw = start_gateway(tmp_path, {"backends": [backend("a", sim.url)]})
    try:
        for url in ("http://127.0.0.1:80000", "http://127.0.0.1:8000x", "http://[::1"):
            gw.write_config({**gw.config, "backends": [backend("b", url)]})
            response = httpx.post(gw.url + "/admin/reload", timeout=5)
            assert response.status_code == 400, response.text
            assert "backends.0.url" in response.json()["message"]
        assert [b["name"] for b in gw.state()["backends"]] == ["a"]
        ok = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=10)
        assert ok.status_code == 200
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'kneecap_config_reloads_total{result="error"} 3.0' in metrics
    finally:
        gw.proc.stop()
        sim.stop()


def test_a_reload_says_which_changes_wait_for_a_restart(tmp_path: Path) -> None:
    """The listening address is read at startup: a reload that moves it applies the rest
    and says the address waits (before: "config applied", nothing logged, nothing bound).
    The same holds after a second reload: it is the running process that is compared."""
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    gw = start_gateway(tmp_path, {"backends": [backend("a", sim.url)]})
    try:
        moved = {**gw.config, "listen": {**gw.config["listen"], "port": free_port()}}
        moved["health"] = {"interval_s": 0.5}
        for _ in range(2):
            gw.write_config(moved)
            body = httpx.post(gw.url + "/admin/reload", timeout=5).json()
            assert body["ok"] is True
            assert "not applied until a restart: listen.port" in body["message"], body
        assert "listen.port take effect only at a restart" in gw.proc.log.read_text()
        ok = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=10)
        assert ok.status_code == 200  # still where it started
    finally:
        gw.proc.stop()
        sim.stop()


def test_client_keys_and_admin_token(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    config = {
        "backends": [backend("a", sim.url)],
        "auth": {"api_keys": ["k-one"], "api_keys_env": "EXTRA_KEYS", "admin_token": "adm"},
    }
    gw = start_gateway(tmp_path, config, env={"EXTRA_KEYS": "k-two, k-three"})
    try:
        url = gw.url + "/v1/chat/completions"
        body = {**CHAT, "max_tokens": 1}
        missing = httpx.post(url, json=body, timeout=5)
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        assert (
            httpx.post(
                url, json=body, headers={"authorization": "Bearer wrong"}, timeout=5
            ).status_code
            == 401
        )
        for key in ("k-one", "k-three"):
            assert (
                httpx.post(
                    url, json=body, headers={"authorization": f"Bearer {key}"}, timeout=5
                ).status_code
                == 200
            )
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="k-two", max_retries=0)
        assert client.models.list().data[0].id == MODEL
        try:
            openai.OpenAI(base_url=gw.url + "/v1", api_key="bad", max_retries=0).models.list()
            raise AssertionError("a bad key was accepted")
        except openai.AuthenticationError:
            pass
        assert httpx.get(gw.url + "/admin/state", timeout=5).status_code == 401
        assert (
            httpx.get(
                gw.url + "/admin/state", headers={"authorization": "Bearer k-one"}, timeout=5
            ).status_code
            == 401
        )
        assert (
            httpx.post(
                gw.url + "/admin/reload", headers={"authorization": "Bearer adm"}, timeout=5
            ).status_code
            == 200
        )
        assert httpx.get(gw.url + "/health", timeout=5).status_code == 200  # never gated
    finally:
        gw.proc.stop()
        sim.stop()


def test_watched_config_file_reloads_itself(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    gw = start_gateway(tmp_path, {"backends": [backend("a", sim.url)], "watch_config": True})
    try:
        gw.write_config({**gw.config, "backends": [backend("renamed", sim.url)]})
        wait_until(lambda: [b["name"] for b in gw.state()["backends"]] == ["renamed"])
        ok = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1}, timeout=10)
        assert ok.headers["x-kneecap-backend"] == "renamed"
    finally:
        gw.proc.stop()
        sim.stop()


def test_a_backend_added_back_while_draining_keeps_its_in_flight_count(tmp_path: Path) -> None:
    # Removed, a replica drains; added back before that ends, it used to start at 0 in
    # flight and admit a whole new limit beside the streams still on the engine.
    sim = start_sim(tmp_path, ttft_ms=2, itl_ms=20)
    static_2 = {"kind": "static", "initial": 2, "min": 1, "max": 2}
    with_a = {"backends": [backend("a", sim.url, limit=static_2)], "health": {"interval_s": 5}}
    gw = start_gateway(tmp_path, with_a)

    def stream_one() -> None:
        body = {**CHAT, "stream": True, "max_tokens": 150}
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
            r.read()

    threads = [threading.Thread(target=stream_one) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: gw.state()["backends"][0]["in_flight"] == 2)
        for config in ({**with_a, "backends": []}, with_a):
            gw.write_config(config)
            assert httpx.post(gw.url + "/admin/reload", timeout=5).json()["ok"] is True
        (a,) = gw.state()["backends"]
        assert a["in_flight"] == 2, a
        for t in threads:
            t.join(30)
        wait_until(lambda: gw.state()["backends"][0]["in_flight"] == 0)
    finally:
        gw.proc.stop()
        sim.stop()


def test_a_pool_removed_by_a_reload_leaves_the_state_and_the_metrics(tmp_path: Path) -> None:
    # Its queue and series stayed forever: /admin/state and the dashboard's queue panel
    # kept showing a pool that no longer existed.
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    gw = start_gateway(tmp_path, {"backends": [backend("a", sim.url)]})  # pools short, long
    try:
        assert set(gw.state()["pools"]) == {"short", "long"}
        gw.write_config({**gw.config, "pools": {"short": {}}})
        assert httpx.post(gw.url + "/admin/reload", timeout=5).json()["ok"] is True
        assert set(gw.state()["pools"]) == {"short"}
        metrics = httpx.get(gw.url + "/metrics", timeout=5).text
        assert 'pool="short"' in metrics
        assert 'pool="long"' not in metrics
    finally:
        gw.proc.stop()
        sim.stop()


def test_watch_config_turned_on_by_a_reload_takes_effect(tmp_path: Path) -> None:
    # The watcher used to be started, or not, once at startup from the first config.
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    gw = start_gateway(tmp_path, {"backends": [backend("a", sim.url)]})
    try:
        gw.write_config({**gw.config, "watch_config": True})
        assert httpx.post(gw.url + "/admin/reload", timeout=5).json()["ok"] is True
        gw.write_config({**gw.config, "backends": [backend("renamed", sim.url)]})
        wait_until(lambda: [b["name"] for b in gw.state()["backends"]] == ["renamed"])
    finally:
        gw.proc.stop()
        sim.stop()


def test_models_are_discovered_and_listed_as_a_union(tmp_path: Path) -> None:
    qwen = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    llama = start_sim(tmp_path, ttft_ms=1, itl_ms=1, model="meta-llama/Llama-3.1-8B")
    config = {
        "backends": [
            {"name": "q", "url": qwen.url},  # no models: discovered from /v1/models
            {"name": "l", "url": llama.url, "pool": "long"},
        ]
    }
    gw = start_gateway(tmp_path, config)
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        assert sorted(m.id for m in client.models.list().data) == sorted(
            [MODEL, "meta-llama/Llama-3.1-8B"]
        )
        reply = client.chat.completions.with_raw_response.create(
            model="meta-llama/Llama-3.1-8B", messages=CHAT["messages"], max_tokens=1
        )
        assert reply.headers["x-kneecap-backend"] == "l"
        llama.kill()
        wait_until(lambda: [m.id for m in client.models.list().data] == [MODEL], timeout=20)
    finally:
        gw.proc.stop()
        qwen.stop()


@pytest.mark.parametrize("change", ["rename", "respell_url"])
def test_requests_queued_across_a_reload_that_replaces_their_backend_are_served(
    tmp_path: Path, change: str
) -> None:
    # A renamed backend, or one whose URL is spelled differently, is a new replica, not
    # probed yet at the reload. The queues were woken at once and found no healthy
    # backend: every queued request, and fresh ones, got 503 no_healthy_backend.
    sim = start_sim(tmp_path, ttft_ms=2, itl_ms=5)
    static_1 = {"kind": "static", "initial": 1, "min": 1, "max": 1}
    gw = start_gateway(
        tmp_path,
        {"backends": [backend("a", sim.url, limit=static_1)], "health": {"interval_s": 5}},
    )
    statuses: list[int] = []

    def stream_one() -> None:
        body = {**CHAT, "stream": True, "max_tokens": 60}
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
            text = "".join(r.iter_text())
            statuses.append(r.status_code if text.endswith("data: [DONE]\n\n") else -1)

    threads = [threading.Thread(target=stream_one) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: gw.state()["pools"]["short"]["queue_depth"] == 3)
        url = sim.url if change == "rename" else sim.url.replace("127.0.0.1", "localhost")
        name = "b" if change == "rename" else "a"
        gw.write_config({**gw.config, "backends": [backend(name, url, limit=static_1)]})
        assert httpx.post(gw.url + "/admin/reload", timeout=5).json()["ok"] is True
        fresh = httpx.post(
            gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=30
        )
        for t in threads:
            t.join(30)
    finally:
        gw.proc.stop()
        sim.stop()
    assert fresh.status_code == 200, fresh.text
    assert statuses == [200] * 4
