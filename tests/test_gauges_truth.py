"""What /metrics and /admin/state claim about backends matches what is true of them.

Real processes on 127.0.0.1: an engine that dies must not leave its KV-cache figure
behind, and a backend a reload removes must stay visible, counting the requests it
finishes, until it has drained; then its series go.
"""

from __future__ import annotations

import json
import re
import signal
import threading
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


def raw_backend(name: str, url: str, model: str) -> dict[str, Any]:
    limit = {"kind": "static", "initial": 8, "min": 1, "max": 8}
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

    def stream_one() -> None:
        url = gw.url + "/v1/chat/completions"
        with httpx.stream("POST", url, json=held_stream(), timeout=30) as r:
            r.read()
            done.append(r.status_code)

    thread = threading.Thread(target=stream_one)
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

    def stream_one() -> None:
        url = gw.url + "/v1/chat/completions"
        with httpx.stream("POST", url, json=held_stream(), timeout=30) as r:
            r.read()
            done.append(r.status_code)

    thread = threading.Thread(target=stream_one)
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
