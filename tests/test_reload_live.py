"""A reload reaches what was built at startup: the connection pool's bound, the timeouts
of ``POST /tokenize``, the intervals of the engine scraper and of the limit controllers;
and the gateway's own health probes never wait behind the traffic for a connection."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
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
from tests.test_ops_robustness import counts, start_ops_backend

QUICK_STOP = {"drain_timeout_s": 1}
QUIET_HEALTH = {"interval_s": 60}  # the startup round only, unless a reload wakes it
NO_BUDGET = {"token_budget": {"enabled": False}}


@pytest.fixture
def raw(tmp_path: Path) -> Iterator[Proc]:
    yield from served(start_raw_sse(tmp_path))


def static(limit: int) -> dict[str, Any]:
    return {"kind": "static", "initial": limit, "min": 1, "max": limit}


def sse(content: str) -> str:
    event = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}}],
    }
    return f"data: {json.dumps(event)}\n\n"


HEAD = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
CHUNKED = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(text: str) -> str:
    return f"{len(text.encode()):x}\r\n{text}\r\n"


def chat(script: list[list[Any]]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": True,
        "messages": [{"role": "user", "content": "x"}],
        "raw_script": script,
    }


def held_chat() -> dict[str, Any]:
    """A stream whose first event comes at once and the rest after a ``GET /poke``; its
    connection is kept alive for the next request."""
    first, rest = CHUNKED + chunk(sse("a")), chunk(sse("b")) + chunk("data: [DONE]\n\n")
    return chat([["send", first], ["await_poke"], ["send", rest + "0\r\n\r\n"]])


def reload(gw: Gateway, config: dict[str, Any]) -> None:
    gw.write_config(config)
    answer = httpx.post(gw.url + "/admin/reload", timeout=5).json()
    assert answer["ok"] is True, answer


def holds(condition: Callable[[], bool], failure: Callable[[], str], timeout: float) -> None:
    try:
        wait_until(condition, timeout)
    except TimeoutError:
        raise AssertionError(failure()) from None


class Streams:
    """Streamed chats sent from threads: which got their first event, how each ended."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.started: list[int] = []
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(8)
        self.sent: list[Future[tuple[int, str]]] = []

    def send(self, n: int) -> None:
        self.sent += [self.pool.submit(self._one, held_chat()) for _ in range(n)]

    def _one(self, body: dict[str, Any]) -> tuple[int, str]:
        url = self.gw.url + "/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=30) as response:
            if response.status_code != 200:
                return response.status_code, response.read().decode()
            parts = response.iter_raw()
            next(parts)
            with self.lock:
                self.started.append(1)
            return 200, b"".join(parts).decode()

    def ended(self) -> list[tuple[int, str]]:
        return [f.result() for f in self.sent if f.done()]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def poke(raw: Proc, times: int) -> None:
    for _ in range(times):  # answered once a held answer (or probe) took it
        assert httpx.get(raw.url + "/poke", timeout=10).status_code == 200


def test_raising_max_connections_lets_the_raised_limit_through(tmp_path: Path, raw: Proc) -> None:
    """B1: the transport kept its startup bound; two of four streams waited for a
    connection although the reload had raised both the limit and the bound to 4."""
    config: dict[str, Any] = {
        "listen": QUICK_STOP,
        "backends": [backend("b", raw.url, limit=static(2))],
        "upstream": {"max_connections": 2, "connect_timeout_s": 10, "max_attempts": 1},
        "health": QUIET_HEALTH,
        "routing": NO_BUDGET,
    }
    gw = start_gateway(tmp_path, config)
    streams = Streams(gw)
    try:
        reload(
            gw,
            {
                **config,
                "backends": [backend("b", raw.url, limit=static(4))],
                "upstream": {**config["upstream"], "max_connections": 4},
            },
        )
        streams.send(4)
        holds(
            lambda: len(streams.started) == 4,
            lambda: (
                f"{len(streams.started)} of 4 streams reached the backend "
                "after max_connections was raised from 2 to 4"
            ),
            timeout=5,
        )
        poke(raw, 4)
        wait_until(lambda: len(streams.ended()) == 4)
        assert [status for status, _ in streams.ended()] == [200] * 4
    finally:
        gw.proc.stop()
        streams.close()


def test_lowering_max_connections_cuts_nothing_and_then_holds(tmp_path: Path, raw: Proc) -> None:
    """B1, the other way: streams in flight across the reload finish (none is cut for
    the lower bound); afterwards the lower bound and the lower limits serve every request.
    The bound never falls below what admission lets through (check-config refuses that),
    so the connections over it are closed as they come back, not fought over."""
    config: dict[str, Any] = {
        "listen": QUICK_STOP,
        "backends": [
            backend("a", raw.url, limit=static(2)),
            backend("b", raw.url, limit=static(2)),
        ],
        "upstream": {"max_connections": 4, "connect_timeout_s": 1, "max_attempts": 1},
        "health": QUIET_HEALTH,
        "routing": NO_BUDGET,
    }
    gw = start_gateway(tmp_path, config)
    streams = Streams(gw)
    try:
        streams.send(4)
        wait_until(lambda: len(streams.started) == 4)
        lowered = {
            **config,
            "backends": [
                backend("a", raw.url, limit=static(1)),
                backend("b", raw.url, limit=static(1)),
            ],
            "upstream": {**config["upstream"], "max_connections": 2},
        }
        reload(gw, lowered)
        poke(raw, 4)
        wait_until(lambda: len(streams.ended()) == 4)
        assert [status for status, _ in streams.ended()] == [200] * 4  # none was cut

        streams.started.clear()
        streams.sent.clear()
        streams.send(4)
        wait_until(lambda: len(streams.started) == 2)
        poke(raw, 2)
        wait_until(lambda: len(streams.started) == 4)
        poke(raw, 2)
        wait_until(lambda: len(streams.ended()) == 4)
        assert [status for status, _ in streams.ended()] == [200] * 4
    finally:
        gw.proc.stop()
        streams.close()


def test_health_probes_get_a_connection_while_traffic_holds_every_one(
    tmp_path: Path, raw: Proc
) -> None:
    """B2: probes shared the traffic's pool. With both connections streaming, the probe a
    reload starts (to a path that answers once poked) never reached the backend: it
    waited for a connection, and a healthy, busy backend would have been marked DOWN."""
    config: dict[str, Any] = {
        "listen": QUICK_STOP,
        "backends": [backend("b", raw.url, limit=static(2))],
        "upstream": {"max_connections": 2, "max_attempts": 1},
        "health": {"interval_s": 60, "timeout_s": 10},
        "routing": NO_BUDGET,
    }
    gw = start_gateway(tmp_path, config)
    hung = chat([["send", HEAD + sse("a")], ["hang"]])
    try:
        with ExitStack() as stack, httpx.Client(timeout=10) as client:
            held = []  # an iterator let go would close its stream
            for _ in range(2):
                response = stack.enter_context(
                    client.stream("POST", gw.url + "/v1/chat/completions", json=hung)
                )
                assert response.status_code == 200
                held.append(response.iter_raw())
                next(held[-1])  # on the backend: its connection is in use
            assert gw.state()["backends"][0]["in_flight"] == 2
            reload(gw, {**config, "health": {**config["health"], "path": "/health?await_poke"}})
            try:
                httpx.get(raw.url + "/poke", timeout=3)
            except httpx.TimeoutException:
                raise AssertionError(
                    "no health probe reached the backend while streams held the pool"
                ) from None
            holds(
                lambda: gw.state()["backends"][0]["healthy"],
                lambda: f"backend marked down while busy: {gw.state()['backends']}",
                timeout=5,
            )
    finally:
        gw.proc.stop()


def test_tokenize_uses_the_reloaded_read_timeout(tmp_path: Path, raw: Proc) -> None:
    """B4: ``POST /tokenize`` kept the startup read timeout (here 30 s): a backend that never
    answers held it that long although the reload had set 0.3 s."""
    config: dict[str, Any] = {
        "listen": QUICK_STOP,
        "backends": [backend("b", raw.url)],
        "upstream": {"read_timeout_s": 30},
        "health": QUIET_HEALTH,
    }
    gw = start_gateway(tmp_path, config)
    try:
        reload(gw, {**config, "upstream": {"read_timeout_s": 0.3}})
        body = {"model": MODEL, "prompt": "hi", "raw_script": [["hang"]]}
        try:
            response = httpx.post(gw.url + "/tokenize", json=body, timeout=10)
        except httpx.TimeoutException:
            raise AssertionError("/tokenize still waited with the startup read timeout") from None
        assert response.status_code == 502, response.text
        assert "ReadTimeout" in response.json()["error"]["message"]
    finally:
        gw.proc.stop()


def engine_figures(gw: Gateway) -> Any:
    return gw.state()["backends"][0]["engine"]


def test_a_shortened_scrape_interval_applies_at_once(tmp_path: Path) -> None:
    """B5: the scraper slept out the old interval (60 s) before reading the new one."""
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    config: dict[str, Any] = {
        "listen": QUICK_STOP,
        "backends": [backend("s", sim.url)],
        "measurement": {"scrape_interval_s": 60, "scrape_staleness_s": 0.5},
    }
    gw = start_gateway(tmp_path, config)
    try:
        wait_until(lambda: engine_figures(gw) is None)  # the startup scrape went stale
        reload(gw, {**config, "measurement": {**config["measurement"], "scrape_interval_s": 0.1}})
        holds(
            lambda: engine_figures(gw) is not None,
            lambda: "no scrape since the reload shortened the interval from 60 s to 0.1 s",
            timeout=5,
        )
    finally:
        gw.proc.stop()
        sim.stop()


def test_a_shortened_control_interval_applies_at_once(tmp_path: Path, raw: Proc) -> None:
    """B6: the limit controllers' loop slept out the old interval (60 s). Observable: a
    gradient controller leaves its min-RTT window (limit at min, 3) for the remembered
    limit (8) at its first tick after enough TTFTs."""
    limit = {"kind": "gradient", "initial": 8, "min": 3, "max": 16, "min_rtt_window_s": 0}
    config: dict[str, Any] = {
        "listen": QUICK_STOP,
        "backends": [backend("b", raw.url)],
        "admission": {"control_interval_s": 60, "limit": limit},
        "health": QUIET_HEALTH,
        "routing": NO_BUDGET,
    }
    gw = start_gateway(tmp_path, config)
    try:
        assert gw.state()["backends"][0]["limit"] == 3
        reload(gw, {**config, "admission": {**config["admission"], "control_interval_s": 0.1}})
        answer = chat(
            [["send", HEAD + sse("a")], ["send", sse("b") + "data: [DONE]\n\n"], ["close"]]
        )
        for _ in range(8):
            response = httpx.post(gw.url + "/v1/chat/completions", json=answer, timeout=10)
            assert response.status_code == 200, response.text
        holds(
            lambda: gw.state()["backends"][0]["limit"] == 8,
            lambda: (
                f"limit {gw.state()['backends'][0]['limit']}: no control tick since the "
                "reload shortened the interval from 60 s to 0.1 s"
            ),
            timeout=5,
        )
    finally:
        gw.proc.stop()


def test_a_re_addressed_backend_gets_connections_held_idle_by_its_old_address(
    tmp_path: Path, raw: Proc
) -> None:
    """Idle keep-alive connections to an address no longer configured held their slots:
    in the probes' pool (two per backend) the moved backend's first probe found none and
    it was marked down; in the traffic's (max_connections 2) a request to the new address
    waited until the pool timeout (504). Now an idle connection makes room."""
    moved = start_raw_sse(tmp_path)
    config: dict[str, Any] = {
        "listen": QUICK_STOP,
        "backends": [backend("b", raw.url, limit=static(2))],
        "upstream": {"max_connections": 2, "connect_timeout_s": 1, "max_attempts": 1},
        "health": QUIET_HEALTH,
        "routing": NO_BUDGET,
    }
    gw = start_gateway(tmp_path, config)
    streams = Streams(gw)
    try:
        streams.send(2)
        wait_until(lambda: len(streams.started) == 2)
        poke(raw, 2)  # both connections go back to the pool, idle, kept alive
        wait_until(lambda: len(streams.ended()) == 2)
        reload(gw, {**config, "backends": [backend("b", moved.url, limit=static(2))]})
        holds(
            lambda: (
                [(b["url"], b["healthy"]) for b in gw.state()["backends"]] == [(moved.url, True)]
            ),
            lambda: f"the moved backend is not found healthy: {gw.state()['backends']}",
            timeout=10,
        )
        streams.sent.clear()
        streams.send(1)
        wait_until(lambda: len(streams.started) == 3 or len(streams.ended()) == 1)
        if len(streams.started) == 3:
            poke(moved, 1)
        wait_until(lambda: len(streams.ended()) == 1)
        assert [status for status, _ in streams.ended()] == [200], streams.ended()
    finally:
        gw.proc.stop()
        streams.close()
        moved.stop()


def test_a_reload_while_a_prompt_is_counted_plans_it_on_the_pools_there_are_now(
    tmp_path: Path,
) -> None:
    """The backend's /tokenize answers after a reload moved the backend from pool `p1`
    to pool `p2` and removed `p1`: the request goes to `p2` (before: planned on the old
    snapshot, onto a pool with no queue any more, and answered 500)."""
    engine = start_ops_backend(tmp_path, post_delay_s=1.0)
    first: dict[str, Any] = {
        "listen": QUICK_STOP,
        "backends": [backend("b", engine.url, pool="p1", models=[MODEL])],
        "pools": {"p1": {}},
        "health": QUIET_HEALTH,
        "routing": {"estimator": {"mode": "backend", "tokenize_timeout_s": 10}},
    }
    gw = start_gateway(tmp_path, first)
    try:
        with ThreadPoolExecutor(1) as pool:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
            answer = pool.submit(httpx.post, gw.url + "/v1/completions", json=body, timeout=30)
            wait_until(lambda: counts(engine)["posts"] >= 1)  # its /tokenize is under way
            second = {
                **first,
                "backends": [backend("b", engine.url, pool="p2", models=[MODEL])],
                "pools": {"p2": {}},
            }
            reload(gw, second)
            response = answer.result(timeout=30)
        assert response.status_code == 200, response.text
        assert response.headers["x-kneecap-backend"] == "b"
    finally:
        gw.proc.stop()
        engine.stop()


def test_a_removed_pool_leaves_the_admin_state_without_a_scrape(tmp_path: Path, raw: Proc) -> None:
    """A reload removes pool `short` while a stream holds a lease in it; once that stream
    ends the pool goes at the next control tick. Before, only a /metrics scrape (or another
    reload) dropped it, so with no Prometheus it stayed listed for good."""
    first: dict[str, Any] = {
        "listen": QUICK_STOP,
        "backends": [backend("s", raw.url, pool="short"), backend("l", raw.url, pool="long")],
        "pools": {"short": {"max_prompt_tokens": 8192}, "long": {"min_prompt_tokens": 8192}},
        "health": QUIET_HEALTH,
        "admission": {"control_interval_s": 0.2},
    }
    gw = start_gateway(tmp_path, first)
    try:
        with ThreadPoolExecutor(1) as clients:
            url = gw.url + "/v1/chat/completions"
            held = clients.submit(httpx.post, url, json=held_chat(), timeout=30)
            wait_until(lambda: gw.state()["pools"]["short"]["leased"] == 1)
            second = {
                **first,
                "backends": [backend("l", raw.url, pool="long")],
                "pools": {"long": {}},
            }
            reload(gw, second)
            assert "short" in gw.state()["pools"]  # its stream still runs
            poke(raw, 1)
            assert held.result(timeout=30).status_code == 200
        wait_until(lambda: set(gw.state()["pools"]) == {"long"}, timeout=5)
    finally:
        gw.proc.stop()
