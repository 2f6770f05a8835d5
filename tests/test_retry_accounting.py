"""What a retried request leaves in the metrics: retries counted when they go out, a
request that reached a backend counted once whatever ends it, and the time of a failed
attempt kept out of the queue wait and out of the gateway's own overhead.

Real gateways in front of :mod:`tests.raw_sse_backend` (a failure is the script the
request carries, so every raw backend fails it alike) and, where the retry must
succeed, a simulator, which ignores the script.
"""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import Gateway, Proc, served, start_gateway, start_raw_sse, start_sim, wait_until
from tests.raw_sse_backend import MODEL
from tests.test_proxy_wire import (
    RawConnection,
    chat_body,
    idle,
    metric_sum,
    new_id,
    post_bytes,
    record_of,
    requests_total,
)

CHAT = "/v1/chat/completions"
STATIC_1 = {"kind": "static", "initial": 1, "min": 1, "max": 1}
SSE_HEAD = (
    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}\n\n'
DONE = b"data: [DONE]\n\n"


def chunk(piece: bytes) -> list[str]:
    return ["send", (b"%x\r\n%s\r\n" % (len(piece), piece)).decode("latin-1")]


def error_answer(status: int, reason: str) -> list[str]:
    body = json.dumps({"error": {"message": "boom", "code": status}})
    head = f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
    return ["send", f"{head}content-length: {len(body)}\r\n\r\n{body}"]


# A stream that holds its backend's only permit until the backend is poked.
HOLD = [["send", SSE_HEAD], chunk(ROLE), ["await_poke"], chunk(DONE), ["send", "0\r\n\r\n"]]
FAILS = [error_answer(500, "Internal Server Error")]


def retries(gw: Gateway) -> float:
    return metric_sum(gw.url, "kneecap_upstream_retries_total")


def raw_entry(name: str, proc: Proc) -> dict[str, Any]:
    return {"name": name, "url": proc.url, "pool": "short", "models": [MODEL], "limit": STATIC_1}


# --- a retry that must queue for the only other backend ----------------------------


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("retry")


@pytest.fixture(scope="module")
def raws(module_tmp: Path) -> Iterator[dict[str, Proc]]:
    procs = {"a": start_raw_sse(module_tmp)}
    try:
        procs["b"] = start_raw_sse(module_tmp)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def pair(module_tmp: Path, raws: dict[str, Proc]) -> Iterator[Gateway]:
    config = {
        "backends": [raw_entry(name, proc) for name, proc in raws.items()],
        "pools": {"short": {"max_queue_wait_s": 30}},
        "health": {"interval_s": 30, "failure_threshold": 1000},
        # Deterministic: the failing request goes to the idle backend, its retry to the held.
        "routing": {"policy": "least_loaded"},
    }
    gateway = start_gateway(module_tmp, config)
    try:
        yield gateway
    finally:
        gateway.proc.stop()


class Held:
    """One backend's only permit, held by a stream until :meth:`release`."""

    def __init__(self, gw: Gateway, raws: dict[str, Proc]) -> None:
        self.raws = raws
        messages = [{"role": "user", "content": "hold"}]
        body = {"model": MODEL, "stream": True, "messages": messages, "raw_script": HOLD}
        self._stream = httpx.stream("POST", gw.url + CHAT, json=body, timeout=30)
        response = self._stream.__enter__()
        assert response.status_code == 200
        self.backend = response.headers["x-kneecap-backend"]
        self.response = response

    def release(self) -> None:
        try:
            assert httpx.get(self.raws[self.backend].url + "/poke", timeout=5).status_code == 200
            assert self.response.read().endswith(DONE)
        finally:
            self._stream.__exit__(None, None, None)


def failing_body(stream: bool = False) -> bytes:
    messages = [{"role": "user", "content": "x"}]
    body = {"model": MODEL, "messages": messages, "raw_script": FAILS, "stream": stream}
    return json.dumps(body).encode()


def censored_ttfts(gw: Gateway, backend: str) -> int:
    (state,) = [b for b in gw.state()["backends"] if b["name"] == backend]
    return state["window"]["ttft_censored"]


def test_a_retry_that_finds_no_room_is_no_retry(pair: Gateway, raws: dict[str, Proc]) -> None:
    """The retry's queue deadline passes before the held backend frees up: it was never
    sent, so kneecap_upstream_retries_total stays as it was (it counted one before)."""
    wait_until(lambda: idle(pair), timeout=10)
    before = retries(pair)
    held = Held(pair, raws)
    try:
        request_id = new_id("noroom")
        answer = httpx.post(
            pair.url + CHAT,
            content=failing_body(),
            headers={
                "content-type": "application/json",
                "x-request-id": request_id,
                "x-kneecap-max-queue-wait": "0.3",
            },
            timeout=10,
        )
        assert answer.status_code == 502  # the failure it had, not a 429
        record = record_of(pair, request_id)
        assert record["status"] == "upstream_error" and record["backend"] != held.backend
        assert retries(pair) == before
    finally:
        held.release()
    wait_until(lambda: idle(pair), timeout=10)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_while_its_retry_waits_is_counted_once(
    pair: Gateway, raws: dict[str, Proc], stream: bool
) -> None:
    """The request reached a backend (which answered 500), then left while its retry
    waited for the held one: one client_closed on the backend it reached, nothing else
    (before: counted nowhere). Streamed, its wait is no censored TTFT on the backend that
    failed it: that attempt was over, answered."""
    wait_until(lambda: idle(pair), timeout=10)
    retried_before = retries(pair)
    total_before = requests_total(pair)
    held = Held(pair, raws)
    reached = next(name for name in raws if name != held.backend)
    closed_before = requests_total(pair, status="client_closed", backend=reached)
    censored_before = censored_ttfts(pair, reached)
    try:
        request_id = new_id("left")
        conn = RawConnection(pair)
        try:
            conn.send(post_bytes(CHAT, failing_body(stream), {"x-request-id": request_id}))
            wait_until(lambda: pair.state()["pools"]["short"]["queue_depth"] == 1, timeout=10)
        finally:
            conn.close()
        wait_until(lambda: pair.state()["pools"]["short"]["queue_depth"] == 0, timeout=10)
        wait_until(lambda: requests_total(pair) > total_before, timeout=5)
        record = record_of(pair, request_id)
        assert (record["status"], record["backend"]) == ("client_closed", reached)
        assert requests_total(pair, status="client_closed", backend=reached) == closed_before + 1
        assert requests_total(pair) == total_before + 1
        assert retries(pair) == retried_before  # the retry never went out
        assert censored_ttfts(pair, reached) == censored_before
    finally:
        held.release()
    wait_until(lambda: idle(pair), timeout=10)
    assert requests_total(pair) == total_before + 2  # and the hold's own


def test_a_retry_that_goes_out_is_counted(pair: Gateway, raws: dict[str, Proc]) -> None:
    """Both backends fail it: the one retry that was sent is counted, on the backend that
    failed first."""
    wait_until(lambda: idle(pair), timeout=10)
    before = retries(pair)
    request_id = new_id("sent")
    answer = httpx.post(
        pair.url + CHAT,
        content=failing_body(),
        headers={"content-type": "application/json", "x-request-id": request_id},
        timeout=10,
    )
    assert answer.status_code == 500  # the last attempt's own answer
    assert retries(pair) == before + 1
    wait_until(lambda: idle(pair), timeout=10)


def test_a_retry_whose_backend_goes_down_while_it_waits_ends_with_its_failure(
    tmp_path: Path,
) -> None:
    """The retry waits for the held backend, which then stops answering (its probes time
    out: passive ejection never takes a pool's last backend, only a probe can): no backend
    is left. The client hears of the 500 it had, and the request is counted on the backend
    it reached, not refused as no_backend (before: 503 no_backend, a rejection, and no
    count in kneecap_requests_total)."""
    procs = {"a": start_raw_sse(tmp_path), "b": start_raw_sse(tmp_path)}
    config = {
        "backends": [raw_entry(name, proc) for name, proc in procs.items()],
        "pools": {"short": {"max_queue_wait_s": 30}},
        "health": {"interval_s": 0.1, "timeout_s": 0.5, "failure_threshold": 1},
        "routing": {"policy": "least_loaded"},
    }
    gateway = start_gateway(tmp_path, config)
    try:
        held = Held(gateway, procs)
        reached = next(name for name in procs if name != held.backend)
        request_id = new_id("down")
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                httpx.post,
                gateway.url + CHAT,
                content=failing_body(),
                headers={"content-type": "application/json", "x-request-id": request_id},
                timeout=20,
            )
            wait_until(lambda: gateway.state()["pools"]["short"]["queue_depth"] == 1, timeout=10)
            procs[held.backend].process.send_signal(signal.SIGSTOP)  # frozen, not cut
            response = answer.result()
            procs[held.backend].kill()  # the held stream ends too
        assert response.status_code == 502, response.text
        record = record_of(gateway, request_id)
        assert (record["status"], record["backend"]) == ("upstream_error", reached)
        rejected = metric_sum(gateway.url, "kneecap_rejected_requests_total", reason="no_backend")
        assert rejected == 0
        with contextlib.suppress(httpx.HTTPError):
            held.response.close()
    finally:
        gateway.proc.stop()
        for proc in procs.values():
            proc.stop()


# --- the time of a failed attempt ---------------------------------------------------

FAILED_ATTEMPT_S = 0.5


@pytest.fixture(scope="module")
def flaky(module_tmp: Path) -> Iterator[Proc]:
    yield from served(start_raw_sse(module_tmp))


@pytest.fixture(scope="module")
def sim(module_tmp: Path) -> Iterator[Proc]:
    yield from served(start_sim(module_tmp, model=MODEL, ttft_ms=1, itl_ms=1))


@pytest.fixture(scope="module")
def flaky_then_sim(module_tmp: Path, flaky: Proc, sim: Proc) -> Iterator[Gateway]:
    """``flaky`` (raw) is tried first and fails what the simulator, tried next, serves."""
    many = {"kind": "static", "initial": 8, "min": 8, "max": 8}  # nothing ever queues
    config = {
        "backends": [
            {**raw_entry("flaky", flaky), "limit": many},
            {**raw_entry("sim", sim), "limit": many},
        ],
        "health": {"interval_s": 30, "failure_threshold": 1000},
        "routing": {"policy": "least_loaded"},
    }
    gateway = start_gateway(module_tmp, config)
    try:
        yield gateway
    finally:
        gateway.proc.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_failed_attempt_is_neither_queue_wait_nor_overhead(
    flaky_then_sim: Gateway, stream: bool
) -> None:
    """The first backend answers 503 after FAILED_ATTEMPT_S; the retry is served at once.
    Nothing queued and the gateway's own work takes milliseconds: queue_s and overhead_s
    stay far below the failed attempt's time (before: both were ~0.5 s), while
    upstream_s, receipt to the last write, includes it."""
    gw = flaky_then_sim
    labels = {"backend": "sim"}
    queue_sum = metric_sum(gw.url, "kneecap_request_queue_seconds_sum", **labels)
    overhead_sum = metric_sum(gw.url, "kneecap_request_overhead_seconds_sum", **labels)
    retried = metric_sum(gw.url, "kneecap_upstream_retries_total", backend="flaky")
    request_id = new_id("slowfail")
    script = [["pause", FAILED_ATTEMPT_S], error_answer(503, "Service Unavailable")]
    body = json.loads(chat_body(model=MODEL, stream=stream, raw_script=script))
    with httpx.stream(
        "POST", gw.url + CHAT, json=body, headers={"x-request-id": request_id}, timeout=10
    ) as answer:
        assert answer.status_code == 200
        assert answer.headers["x-kneecap-backend"] == "sim"
        answer.read()
    record = record_of(gw, request_id)
    assert record["backend"] == "sim" and record["status"] == "ok"
    assert record["upstream_s"] >= FAILED_ATTEMPT_S
    own = {"queue_s": record["queue_s"], "overhead_s": record["overhead_s"]}
    assert all(seconds < 0.1 for seconds in own.values()), own
    queued = metric_sum(gw.url, "kneecap_request_queue_seconds_sum", **labels) - queue_sum
    overhead = metric_sum(gw.url, "kneecap_request_overhead_seconds_sum", **labels)
    assert queued < 0.1
    assert overhead - overhead_sum < 0.1
    assert metric_sum(gw.url, "kneecap_upstream_retries_total", backend="flaky") == retried + 1
