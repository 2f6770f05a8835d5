"""Admission control against the real engine: the engine never runs more than the limit.

The gateway allows 2 requests in flight on its one backend; the engine's own
``vllm:num_requests_running`` is the witness.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.procs import Gateway, wait_until
from tests.real_engine.conftest import (
    BACKEND,
    POLL_PAUSE,
    SLOW,
    LongStreams,
    RealVllm,
    admin_state,
    engine_value,
    poll,
    scrape,
    start_real_gateway,
    total,
)

LIMIT = 2
CLIENTS = 8
TOKENS = 768  # per request: about a second each on the CPU, so the 8 overlap
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Count to ten"}]
HOLD = 2000  # tokens: seconds of generation, for the streams that hold permits and queue
QUEUED = 2
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"  # exactly: not vllm:num_requests_waiting_by_reason
SHORT_WAIT = {"X-Kneecap-Max-Queue-Wait": "0.2"}
ATTEMPTS = 5


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, real_vllm: RealVllm) -> Iterator[Gateway]:
    pools = {"short": {"max_queue_depth": 16, "max_queue_wait_s": 120}}
    gw = start_real_gateway(
        tmp_path_factory.mktemp("real-admission"), real_vllm, limit=LIMIT, pools=pools
    )
    try:
        yield gw
    finally:
        gw.proc.stop()


class Watch:
    """Calls ``read`` every POLL_PAUSE on its own thread until the block ends; keeps each peak.

    Each call is one poll, and the engine and the gateway get a watcher each, so a slow
    answer from one does not hold up the other's polls. The pause leaves the (niced)
    engine its share of the cores: polled back to back, the two watchers starved it.
    """

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self.read = read
        self.peak: dict[str, float] = {}
        self.error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(SLOW)
        if self.error is not None:
            raise AssertionError(f"the watcher failed: {self.error!r}") from self.error

    def _run(self) -> None:
        try:
            while not self._stop.wait(POLL_PAUSE):
                for name, value in self.read().items():
                    self.peak[name] = max(self.peak.get(name, value), value)
        except Exception as exc:  # handed to the test in __exit__
            self.error = exc


@dataclass
class Run:
    """CLIENTS concurrent streams through the gateway, watched from both sides."""

    results: list[tuple[int, str | None]]  # (completion tokens from usage, finish_reason)
    engine: dict[str, float]  # peaks of the engine's own gauges over the polls
    gateway: dict[str, float]  # peaks of the gateway's in-flight count and queue depth


def run_clients(gateway: Gateway, engine: RealVllm) -> Run:
    url = gateway.url + "/v1/chat/completions"
    body = {"model": engine.model, "messages": MESSAGES, "max_tokens": TOKENS, "stream": True}
    body |= {"stream_options": {"include_usage": True}, "ignore_eos": True}

    def one(_: int) -> tuple[int, str | None]:
        # Raw lines, JSON only for the last two events: the clients' threads must leave
        # the watchers' threads their share of this process's time.
        with httpx.stream("POST", url, json=body, timeout=SLOW) as response:
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line.startswith("data: {")]
        last_choice, usage = (json.loads(event[6:]) for event in events[-2:])
        return usage["usage"]["completion_tokens"], last_choice["choices"][0]["finish_reason"]

    def engine_load() -> dict[str, float]:
        metrics = scrape(engine.root_url + "/metrics")
        return {name: total(metrics, name) for name in (RUNNING, WAITING)}

    def gateway_load() -> dict[str, float]:
        state = admin_state(gateway)
        return {"queued": state["pools"]["short"]["queue_depth"], "in_flight": in_flight(state)}

    with (
        Watch(engine_load) as engine_watch,
        Watch(gateway_load) as gateway_watch,
        ThreadPoolExecutor(CLIENTS) as pool,
    ):
        results = list(pool.map(one, range(CLIENTS)))
    return Run(results, engine_watch.peak, gateway_watch.peak)


def test_engine_never_runs_more_than_the_limit_and_the_queue_drains(
    gateway: Gateway, real_vllm: RealVllm
) -> None:
    # While the CPU engine decodes flat out, its API server may answer /metrics only once
    # the run is over; a run in which no poll saw it busy proves nothing, hence attempts.
    for _ in range(ATTEMPTS):
        before = scrape(gateway.url + "/metrics")
        run = run_clients(gateway, real_vllm)
        after = scrape(gateway.url + "/metrics")
        # The engine's own count: never above the gateway's limit, at any poll.
        assert run.engine[RUNNING] <= LIMIT, f"the engine ran {run.engine[RUNNING]} at once"
        assert run.engine[WAITING] == 0  # nothing queued inside the engine
        if run.engine[RUNNING] >= 1:
            break
    else:
        pytest.fail(f"no poll of the engine's /metrics landed inside {ATTEMPTS} runs")

    assert run.results == [(TOKENS, "length")] * CLIENTS  # every queued request completed
    # The gateway held the excess in its own queue: its polls may miss the queue on a
    # starved machine, its queue-wait histogram does not.
    assert run.gateway["in_flight"] == LIMIT
    wait = "kneecap_request_queue_seconds_bucket"
    quick = total(after, wait, backend=BACKEND, le="0.05") - total(
        before, wait, backend=BACKEND, le="0.05"
    )
    waited = CLIENTS - quick
    assert waited >= 1, "no request waited for admission"
    ok = "kneecap_requests_total"
    done = total(after, ok, backend=BACKEND, status="ok") - total(before, ok, backend=BACKEND)
    assert done == CLIENTS
    tokens = "kneecap_completion_tokens_total"
    assert (
        total(after, tokens, backend=BACKEND) - total(before, tokens, backend=BACKEND)
        == CLIENTS * TOKENS
    )
    queue = "kneecap_request_queue_seconds_count"
    assert total(after, queue, backend=BACKEND) - total(before, queue, backend=BACKEND) == CLIENTS
    wait_until(lambda: engine_value(real_vllm, RUNNING) == 0, timeout=SLOW)


@dataclass
class Shed:
    """Two short-wait requests sent while long streams hold both permits and queue."""

    raw: httpx.Response  # sent with httpx
    sdk: openai.APIStatusError | None  # sent with the openai client: what it raised
    rejected: float  # kneecap_rejected_requests_total{reason="queue_timeout"} added meanwhile


def shed_behind_long_streams(
    client: openai.OpenAI, gateway: Gateway, engine: RealVllm
) -> Shed | None:
    """None when the long streams ran out too early for the attempt to prove anything.

    LIMIT streams hold the permits and QUEUED more wait in the (FIFO) queue, so a request
    arriving next could only be admitted once QUEUED + 1 streams of HOLD tokens are done:
    seconds at best, far beyond its 0.2 s.
    """
    url = gateway.url + "/v1/chat/completions"
    hold = {"model": engine.model, "messages": MESSAGES, "max_tokens": HOLD, "ignore_eos": True}
    body = {"model": engine.model, "messages": MESSAGES, "max_tokens": 4}

    def sdk_request() -> openai.APIStatusError | None:
        try:
            client.chat.completions.create(
                model=engine.model, messages=MESSAGES, max_tokens=4, extra_headers=SHORT_WAIT
            )
        except openai.APIStatusError as exc:
            return exc
        return None

    def held_and_queued() -> bool:
        state = admin_state(gateway)
        return in_flight(state) == LIMIT and state["pools"]["short"]["queue_depth"] == QUEUED

    before = rejected_for_timeout(gateway)
    with LongStreams(url, hold, LIMIT + QUEUED) as streams, ThreadPoolExecutor(2) as pool:
        if not poll(held_and_queued, give_up=streams.any_ended):
            return None
        raw = pool.submit(httpx.post, url, json=body, headers=SHORT_WAIT, timeout=SLOW)
        sdk = pool.submit(sdk_request)
        answers = raw.result(), sdk.result()
    assert streams.statuses == [200] * (LIMIT + QUEUED)
    if sum(streams.cut_short) < LIMIT:  # the permits may have come free meanwhile
        return None
    return Shed(*answers, rejected_for_timeout(gateway) - before)


def rejected_for_timeout(gateway: Gateway) -> float:
    metrics = scrape(gateway.url + "/metrics")
    return total(metrics, "kneecap_rejected_requests_total", pool="short", reason="queue_timeout")


def test_short_queue_wait_sheds_with_retry_after(
    client: openai.OpenAI, gateway: Gateway, real_vllm: RealVllm
) -> None:
    # On a loaded machine a starved gateway or test can lag the engine by seconds; an attempt
    # in which the long streams ran out first proves nothing.
    for _ in range(ATTEMPTS):
        shed = shed_behind_long_streams(client, gateway, real_vllm)
        if shed is not None:
            break
    else:
        pytest.fail(f"the long streams' {HOLD} tokens ran out first in {ATTEMPTS} attempts")
    assert shed.raw.status_code == 429
    assert shed.raw.json()["error"]["code"] == "queue_timeout"
    assert int(shed.raw.headers["retry-after"]) >= 1
    assert shed.raw.elapsed.total_seconds() >= 0.2  # it did wait its 0.2 s
    assert isinstance(shed.sdk, openai.RateLimitError)
    assert int(shed.sdk.response.headers["retry-after"]) >= 1
    assert shed.rejected == 2
    # The long streams' close reached the engine, and with the permits back the same short
    # wait is enough.
    wait_until(lambda: engine_value(real_vllm, RUNNING) == 0, timeout=SLOW)
    wait_until(lambda: backend_in_flight(gateway) == 0, timeout=SLOW)
    ok = client.chat.completions.create(
        model=real_vllm.model, messages=MESSAGES, max_tokens=4, extra_headers=SHORT_WAIT
    )
    assert ok.choices[0].finish_reason in {"length", "stop"}


def in_flight(state: dict) -> int:
    backend = next(b for b in state["backends"] if b["name"] == BACKEND)
    count: int = backend["in_flight"]
    return count


def backend_in_flight(gateway: Gateway) -> int:
    return in_flight(admin_state(gateway))
