"""What /metrics and /admin/state claim about backends matches what is true of them.

Real processes on 127.0.0.1: an engine that dies must not leave its KV-cache figure
behind, and a backend a reload removes must stay visible, counting the requests it
finishes, until it has drained; then its series go.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.procs import (
    Gateway,
    backend,
    free_port,
    start_gateway,
    start_raw_sse,
    start_sim,
    wait_until,
)

KV = "kneecap_engine_kv_cache_usage_ratio"


def exposition(url: str) -> str:
    """One scrape: each one refreshes the gauges (and may drop drained series)."""
    return httpx.get(url + "/metrics", timeout=5).text


def samples_in(text: str, name: str) -> dict[str, float]:
    """The samples of ``name`` in an exposition: label text -> value."""
    pattern = rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$"
    return {m.group(1) or "": float(m.group(2)) for m in re.finditer(pattern, text, re.M)}


def value_in(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples whose labels include ``labels``; None when there is none."""
    found = [
        v
        for found_labels, v in samples_in(text, name).items()
        if all(f'{k}="{val}"' in found_labels for k, val in labels.items())
    ]
    return sum(found) if found else None


def samples(url: str, name: str) -> dict[str, float]:
    return samples_in(exposition(url), name)


def value(url: str, name: str, **labels: str) -> float | None:
    return value_in(exposition(url), name, **labels)


def engine_of(gw: Gateway, name: str) -> Any:
    return next(b["engine"] for b in gw.state()["backends"] if b["name"] == name)


def test_a_dead_engines_kv_cache_usage_goes_and_comes_back_with_it(tmp_path: Path) -> None:
    # The gauge kept the last figure scraped before the engine died, while /admin/state
    # said the engine figures were gone and running/waiting had fallen back.
    port = free_port()
    sim = start_sim(tmp_path, port=port, ttft_ms=2, itl_ms=2)
    config = {
        "backends": [backend("e", sim.url)],
        "health": {"interval_s": 0.2, "failure_threshold": 1000},
        "measurement": {"scrape_interval_s": 0.1, "scrape_staleness_s": 0.5},
    }
    gw = start_gateway(tmp_path, config)
    try:
        wait_until(lambda: engine_of(gw, "e") is not None)
        wait_until(lambda: value(gw.url, KV, backend="e") is not None)
        sim.stop(signal.SIGKILL)
        wait_until(lambda: engine_of(gw, "e") is None)  # stale: the engine said nothing since
        assert value(gw.url, KV, backend="e") is None, samples(gw.url, KV)
        assert value(gw.url, "kneecap_engine_requests_running", backend="e") == 0
        sim = start_sim(tmp_path, port=port, ttft_ms=2, itl_ms=2)  # it reports again
        wait_until(lambda: value(gw.url, KV, backend="e") is not None)
    finally:
        gw.proc.stop()
        sim.stop()


def held_stream() -> dict[str, Any]:
    """A streamed chat whose answer waits for a ``GET /poke`` of the raw backend."""
    events = [
        {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
    ]
    frames = [f"data: {json.dumps({'object': 'chat.completion.chunk', **e})}\n\n" for e in events]
    head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
    script = [["send", head + frames[0]], ["await_poke"]]
    script += [["send", "".join(frames[1:]) + "data: [DONE]\n\n"], ["close"]]
    return {
        "model": "gone",
        "stream": True,
        "messages": [{"role": "user", "content": "x"}],
        "raw_script": script,
    }


def held_stream_thread(gw: Gateway, done: list[int]) -> threading.Thread:
    """A thread (not started) streaming one :func:`held_stream`; its status goes to ``done``."""

    def stream_one() -> None:
        url = gw.url + "/v1/chat/completions"
        with httpx.stream("POST", url, json=held_stream(), timeout=30) as r:
            r.read()
            done.append(r.status_code)

    return threading.Thread(target=stream_one)


def plain_answer() -> dict[str, Any]:
    body = json.dumps(
        {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "k"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
    )
    head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    script = [["send", f"{head}content-length: {len(body)}\r\n\r\n{body}"]]
    return {"model": "gone", "messages": [{"role": "user", "content": "x"}], "raw_script": script}


def raw_backend(name: str, url: str, model: str, limit_to: int = 8) -> dict[str, Any]:
    limit = {"kind": "static", "initial": limit_to, "min": 1, "max": limit_to}
    return {
        "name": name,
        "url": url,
        "pool": "short",
        "models": [model],
        "engine": "openai",
        "limit": limit,
    }


def test_a_removed_backend_stays_in_view_and_counted_until_it_has_drained(
    tmp_path: Path,
) -> None:
    # Removed by a reload, a backend vanished from /admin/state and from the in-flight
    # gauge at once, and the requests it finished while draining were never counted.
    keep, gone = start_raw_sse(tmp_path), start_raw_sse(tmp_path)
    config = {
        "backends": [raw_backend("keep", keep.url, "kept"), raw_backend("b", gone.url, "gone")],
        "health": {"interval_s": 5},
    }
    gw = start_gateway(tmp_path, config)
    statuses: list[int] = []

    def stream_one() -> None:
        url = gw.url + "/v1/chat/completions"
        with httpx.stream("POST", url, json=held_stream(), timeout=30) as r:
            text = "".join(r.iter_text())
            statuses.append(r.status_code if text.endswith("data: [DONE]\n\n") else -1)

    def poke() -> None:
        assert httpx.get(gone.url + "/poke", timeout=10).status_code == 200

    def ok_on_b() -> float | None:
        return value(gw.url, "kneecap_requests_total", backend="b", status="ok")

    threads = [threading.Thread(target=stream_one) for _ in range(2)]
    try:
        before = httpx.post(gw.url + "/v1/chat/completions", json=plain_answer(), timeout=10)
        assert before.headers["x-kneecap-backend"] == "b"
        wait_until(lambda: ok_on_b() == 1)
        for t in threads:
            t.start()
        wait_until(lambda: gw.state()["pools"]["short"]["leased"] == 2)

        gw.write_config({**config, "backends": config["backends"][:1]})
        assert httpx.post(gw.url + "/admin/reload", timeout=5).json()["ok"] is True

        assert value(gw.url, "kneecap_inflight_requests") == 2  # the pool's leases
        assert value(gw.url, "kneecap_inflight_requests", backend="b") == 2
        assert value(gw.url, "kneecap_backend_up", backend="b") == 0  # takes no new request
        assert ok_on_b() == 1  # what it served before the reload still counts
        listed = {b["name"]: (b["in_flight"], b.get("draining")) for b in gw.state()["backends"]}
        assert listed == {"keep": (0, False), "b": (2, True)}, listed

        poke()
        wait_until(lambda: ok_on_b() == 2)  # finished while draining: counted on its series
        wait_until(lambda: value(gw.url, "kneecap_inflight_requests", backend="b") == 1)
        poke()
        for t in threads:
            t.join(30)
        assert statuses == [200, 200]
        # The first exposition after the drain shows it drained, its last request counted...
        wait_until(lambda: gw.state()["pools"]["short"]["leased"] == 0)
        drained = exposition(gw.url)
        assert value_in(drained, "kneecap_inflight_requests", backend="b") == 0
        assert value_in(drained, "kneecap_requests_total", backend="b", status="ok") == 3
        assert value_in(drained, "kneecap_prompt_tokens_total", backend="b") == 9
        assert [b["name"] for b in gw.state()["backends"]] == ["keep"]
        # ...and the next has no series of it left.
        after = [line for line in exposition(gw.url).splitlines() if 'backend="b"' in line]
        assert after == []
    finally:
        for t in threads:
            t.join(1)
        gw.proc.stop()
        keep.stop()
        gone.stop()


def test_a_backend_removed_and_added_back_while_draining_keeps_one_series_set(
    tmp_path: Path,
) -> None:
    raw = start_raw_sse(tmp_path)
    config = {"backends": [raw_backend("b", raw.url, "gone")], "health": {"interval_s": 5}}
    gw = start_gateway(tmp_path, config)
    done: list[int] = []

    thread = held_stream_thread(gw, done)
    try:
        assert httpx.post(gw.url + "/v1/chat/completions", json=plain_answer(), timeout=10)
        thread.start()
        wait_until(lambda: gw.state()["pools"]["short"]["leased"] == 1)
        for backends in ([], config["backends"]):
            gw.write_config({**config, "backends": backends})
            assert httpx.post(gw.url + "/admin/reload", timeout=5).json()["ok"] is True
        listed = [(b["name"], b["in_flight"], b.get("draining")) for b in gw.state()["backends"]]
        assert samples(gw.url, "kneecap_inflight_requests") == {'{backend="b",pool="short"}': 1.0}
        assert httpx.get(raw.url + "/poke", timeout=10).status_code == 200
        thread.join(30)
        assert done == [200]
        ok = samples(gw.url, "kneecap_requests_total")
        assert list(ok.values()) == [2.0], ok  # one series: before and after the reloads
        assert value(gw.url, "kneecap_requests_total", backend="b") == 2  # and it stays
        assert listed == [("b", 1, False)]  # added back: live again, not draining
    finally:
        thread.join(1)
        gw.proc.stop()
        raw.stop()


def test_a_backend_moved_to_another_pool_keeps_counting_its_requests(tmp_path: Path) -> None:
    # A move dropped every series of the backend at once: the requests it served before
    # were lost from its counters, and one still in flight started them again from zero.
    raw = start_raw_sse(tmp_path)
    pools = {"short": {"max_prompt_tokens": 4096}, "long": {"min_prompt_tokens": 4096}}
    config = {
        "backends": [raw_backend("b", raw.url, "gone")],
        "pools": pools,
        "health": {"interval_s": 5},
    }
    gw = start_gateway(tmp_path, config)
    done: list[int] = []

    thread = held_stream_thread(gw, done)
    try:
        assert httpx.post(gw.url + "/v1/chat/completions", json=plain_answer(), timeout=10)
        thread.start()
        wait_until(lambda: gw.state()["pools"]["short"]["leased"] == 1)
        moved = {**config["backends"][0], "pool": "long"}
        gw.write_config({**config, "backends": [moved]})
        assert httpx.post(gw.url + "/admin/reload", timeout=5).json()["ok"] is True
        assert samples(gw.url, "kneecap_inflight_requests") == {'{backend="b",pool="long"}': 1.0}
        assert value(gw.url, "kneecap_requests_total", backend="b", pool="short") == 1
        assert httpx.get(raw.url + "/poke", timeout=10).status_code == 200
        thread.join(30)
        assert done == [200]
        # Routed to the short pool, it is counted there, after the one served before.
        wait_until(lambda: value(gw.url, "kneecap_requests_total", backend="b", pool="short") == 2)
        assert value(gw.url, "kneecap_prompt_tokens_total", backend="b", pool="short") == 6
    finally:
        thread.join(1)
        gw.proc.stop()
        raw.stop()


def b_series(text: str) -> list[str]:
    """The samples of backend ``b`` in an exposition."""
    return [line for line in text.splitlines() if 'backend="b"' in line]


def failing_chat() -> dict[str, Any]:
    """A chat the raw backend answers 503 once ``GET /poke`` arrives: the gateway retries
    it elsewhere (or relays the 503 when no backend is left to try)."""
    error = '{"error":{"message":"overloaded","type":"server_error","code":503}}'
    head = "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    answer = f"{head}content-length: {len(error)}\r\n\r\n{error}"
    return {**plain_answer(), "raw_script": [["await_poke"], ["send", answer]]}


def held_plain() -> dict[str, Any]:
    """A plain chat answered once ``GET /poke`` arrives."""
    answer = plain_answer()
    return {**answer, "raw_script": [["await_poke"], *answer["raw_script"]]}


def post_raw(url: str, body: dict[str, Any]) -> socket.socket:
    """POST ``body`` on a bare socket, so the test decides when the client leaves."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    )
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(head.encode() + payload)
    return sock


class RetryOffRemovedBackend:
    """Backends a and b, limit 1 each, both answering from their request's script. H holds
    a; R is sent to b, b is removed by a reload, b fails R, and R waits in a's queue to
    retry there: b has drained, but R has yet to be counted on it."""

    def __init__(self, tmp_path: Path) -> None:
        self.a, self.b = start_raw_sse(tmp_path), start_raw_sse(tmp_path)
        self.config = {
            "backends": [raw_backend("a", self.a.url, "gone", limit_to=1)],
            "health": {"interval_s": 5},
        }
        self.gw = start_gateway(tmp_path, self.config)
        self.h = threading.Thread(target=self.post, args=(held_plain(),))

    def post(self, body: dict[str, Any]) -> int:
        return httpx.post(self.gw.url + "/v1/chat/completions", json=body, timeout=30).status_code

    def reload(self, backends: list[dict[str, Any]]) -> None:
        self.gw.write_config({**self.config, "backends": backends})
        assert httpx.post(self.gw.url + "/admin/reload", timeout=5).json()["ok"] is True

    def queue_r(self, send_r: Callable[[], object]) -> None:
        """Up to R waiting in a's queue; ``send_r`` sends R, a :func:`failing_chat`."""
        state = self.gw.state
        self.h.start()
        wait_until(lambda: state()["pools"]["short"]["leased"] == 1)  # a is full
        self.reload([*self.config["backends"], raw_backend("b", self.b.url, "gone", 1)])
        wait_until(lambda: any(b["name"] == "b" and b["healthy"] for b in state()["backends"]))
        send_r()
        wait_until(lambda: [b["in_flight"] for b in state()["backends"]] == [1, 1])
        self.reload(self.config["backends"])  # b removed: it drains
        assert httpx.get(self.b.url + "/poke", timeout=10).status_code == 200  # b fails R
        wait_until(lambda: state()["pools"]["short"]["queue_depth"] == 1)  # R waits for a

    def stop(self) -> None:
        if self.h.is_alive():
            httpx.get(self.a.url + "/poke", timeout=10)
            self.h.join(10)
        self.gw.proc.stop()
        self.a.stop()
        self.b.stop()


def test_a_request_counted_on_a_backend_shown_drained_is_still_exposed(tmp_path: Path) -> None:
    # Shown drained, a backend's series went at the next exposition, which first counted
    # a request that had failed over from it and ended meanwhile: never exposed.
    setup = RetryOffRemovedBackend(tmp_path)
    client: list[socket.socket] = []
    try:
        setup.queue_r(lambda: client.append(post_raw(setup.gw.url, failing_chat())))
        drained = exposition(setup.gw.url)
        assert value_in(drained, "kneecap_inflight_requests", backend="b") == 0
        assert value_in(drained, "kneecap_requests_total", backend="b") is None
        client[0].close()  # R leaves while it waits: counted on b, the backend that had it

        def r_counted() -> bool:
            recent = httpx.get(setup.gw.url + "/admin/requests", timeout=5).json()["requests"]
            return [(q["backend"], q["status"]) for q in recent] == [("b", "client_closed")]

        wait_until(r_counted)
        shown = exposition(setup.gw.url)
        assert value_in(shown, "kneecap_requests_total", backend="b", status="client_closed") == 1
        assert b_series(exposition(setup.gw.url)) == []  # and then it goes
    finally:
        for sock in client:
            sock.close()
        setup.stop()


def test_a_retry_counted_after_its_backend_went_leaves_no_series_behind(tmp_path: Path) -> None:
    # A retry is counted when it goes out, which can be after the backend it left was
    # removed and its series went: the retry count re-created a series nothing removed.
    setup = RetryOffRemovedBackend(tmp_path)
    done: list[int] = []
    r = threading.Thread(target=lambda: done.append(setup.post(failing_chat())))
    try:
        setup.queue_r(r.start)
        assert value(setup.gw.url, "kneecap_upstream_retries_total", backend="b") == 0
        assert b_series(exposition(setup.gw.url)) == []  # shown drained, then gone
        poke_a = setup.a.url + "/poke"
        assert httpx.get(poke_a, timeout=10).status_code == 200  # H ends: R retries on a
        assert httpx.get(poke_a, timeout=10).status_code == 200  # R is on a: a fails it too
        r.join(30)
        assert done == [503]  # no backend left to try: a's answer is relayed
        shown = exposition(setup.gw.url)
        assert value_in(shown, "kneecap_upstream_retries_total", backend="b") == 1
        assert b_series(exposition(setup.gw.url)) == []
    finally:
        setup.stop()
        if r.is_alive():
            r.join(10)


def test_a_re_addressed_backends_draining_replica_outlives_later_reloads(tmp_path: Path) -> None:
    # A second reload (any) forgot the replica a first one re-addressed while it still held
    # a request: gone from /admin/state and from the in-flight gauge, and its series went
    # while that request ran once the backend was removed.
    first, second = start_raw_sse(tmp_path), start_raw_sse(tmp_path)
    config = {"backends": [raw_backend("b", first.url, "gone")], "health": {"interval_s": 5}}
    gw = start_gateway(tmp_path, config)
    done: list[int] = []

    def reload(backends: list[dict[str, Any]]) -> list[tuple[str, int, bool]]:
        gw.write_config({**config, "backends": backends})
        assert httpx.post(gw.url + "/admin/reload", timeout=5).json()["ok"] is True
        return [(b["name"], b["in_flight"], b["draining"]) for b in gw.state()["backends"]]

    thread = held_stream_thread(gw, done)
    moved = [raw_backend("b", second.url, "gone")]
    try:
        thread.start()
        wait_until(lambda: gw.state()["pools"]["short"]["leased"] == 1)
        assert reload(moved) == [("b", 0, False), ("b", 1, True)]
        assert reload(moved) == [("b", 0, False), ("b", 1, True)]  # an unrelated reload
        assert value(gw.url, "kneecap_inflight_requests", backend="b") == 1
        # Back at its first URL, it gets the replica that still drains there.
        assert reload(config["backends"]) == [("b", 1, False)]
        assert reload([]) == [("b", 1, True)]  # removed: its series stay while it drains
        assert value(gw.url, "kneecap_inflight_requests", backend="b") == 1
        assert httpx.get(first.url + "/poke", timeout=10).status_code == 200
        thread.join(30)
        assert done == [200]
        wait_until(lambda: gw.state()["pools"]["short"]["leased"] == 0)
        drained = exposition(gw.url)
        assert value_in(drained, "kneecap_requests_total", backend="b", status="ok") == 1
        assert b_series(exposition(gw.url)) == []
    finally:
        thread.join(1)
        gw.proc.stop()
        first.stop()
        second.stop()
