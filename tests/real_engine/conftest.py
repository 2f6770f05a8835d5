"""Tests against a real vLLM engine (CPU build, tiny model) on 127.0.0.1.

Every test under this directory is marked `real_engine`; skip them all locally with
``pytest -m "not real_engine"``. The first run installs the engine (~2 min, ~3.5 GB under
``$KNEECAP_CACHE``, default ``~/.cache/kneecap/real-vllm``); each session then spends
~30 s starting it. To reuse a server across sessions while iterating::

    python -m tests.real_engine.vllm_server start   # prints its URL
    KNEECAP_REAL_VLLM_URL=http://127.0.0.1:PORT pytest tests/real_engine
    python -m tests.real_engine.vllm_server stop
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import Gateway, start_gateway, wait_until
from tests.real_engine import vllm_server

ENGINE_GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)
_HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items, not only this directory's.
    for item in items:
        if _HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.real_engine)
            # The CPU engine takes both cores while it decodes and publishes its gauges
            # between steps, so a check that must catch it busy can miss on any one run;
            # a rerun (same assertions) tells that apart from a broken gateway, which
            # fails every time.
            item.add_marker(pytest.mark.flaky(reruns=2))


@dataclass(frozen=True)
class RealVllm:
    """A running vLLM OpenAI server; `pid` is None when it was started outside the session."""

    root_url: str  # http://127.0.0.1:PORT, for /health and /metrics
    pid: int | None
    model: str = vllm_server.SERVED_MODEL

    @property
    def base_url(self) -> str:
        """The OpenAI client's base URL (ends in /v1)."""
        return f"{self.root_url}/v1"

    def metrics(self) -> dict[str, float]:
        """The engine's load gauges, each summed over its label sets (one engine here).

        Exact names only: the engine also exports e.g. `vllm:num_requests_waiting_by_reason`.
        """
        status, body = vllm_server.http_get(f"{self.root_url}/metrics")
        if status != 200:
            raise AssertionError(f"GET /metrics -> {status}: {body[:200]!r}")
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                if sample.name in ENGINE_GAUGES:
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
        missing = set(ENGINE_GAUGES) - values.keys()
        if missing:
            raise AssertionError(f"engine /metrics lacks {sorted(missing)}")
        return values


# Package scope: the engine (3 GB, some CPU even idle) stops once its tests are done,
# instead of idling beside the latency-sensitive tests that run after it.
@pytest.fixture(scope="package")
def real_vllm() -> Iterator[RealVllm]:
    external = os.environ.get("KNEECAP_REAL_VLLM_URL")
    if external:
        yield RealVllm(external.rstrip("/").removesuffix("/v1"), pid=None)
        return
    # pytest's main thread lives as long as the session: safe for die_with_parent.
    server = vllm_server.start(die_with_parent=True)
    try:
        engine = RealVllm(server.root_url, server.pid)
        warm_up(engine)
        yield engine
    finally:
        server.stop()


def warm_up(engine: RealVllm) -> None:
    """A fresh engine's first requests are slow (lazy initialisation in its workers), which
    skews whichever test happens to run first; a few throwaway requests absorb that."""
    body = {"model": engine.model, "prompt": "warm", "max_tokens": 64, "ignore_eos": True}
    with httpx.Client(timeout=SLOW, trust_env=False) as client:
        for _ in range(3):
            client.post(engine.root_url + "/v1/completions", json=body).raise_for_status()


# -- kneecap in front of the real engine ----------------------------------------

BACKEND = "vllm-0"  # the one backend of every gateway started by start_real_gateway
# Seconds. While the CPU engine decodes, its processes take both cores, and the gateway, the
# engine's API server and the tests themselves can each wait seconds for a time slice.
SLOW = 60.0

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
# Seconds between polls of the gateway or the engine: short beside a stream (seconds),
# long enough that the pollers leave the niced engine its share of the cores.
POLL_PAUSE = 0.05
# One client for every poll, shared by the watcher threads (httpx clients are thread-safe):
# a new one per poll cost ~30 ms of CPU (its TLS context) of ~45 ms per engine scrape.
_POLLS = httpx.Client(timeout=SLOW, trust_env=False)


def scrape(url: str) -> Samples:
    """Every sample of a Prometheus text endpoint, keyed by (name, labels)."""
    response = _POLLS.get(url)
    response.raise_for_status()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name`` over the series whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def engine_value(engine: RealVllm, name: str, **labels: str) -> float:
    """One figure of the engine's /metrics (summed over matching series)."""
    return total(scrape(engine.root_url + "/metrics"), name, **labels)


def admin_state(gateway: Gateway) -> dict[str, Any]:
    response = _POLLS.get(gateway.url + "/admin/state")
    response.raise_for_status()
    state: dict[str, Any] = response.json()
    return state


def backend_state(gateway: Gateway) -> dict[str, Any]:
    """The one backend's entry in /admin/state."""
    backend: dict[str, Any] = next(
        b for b in admin_state(gateway)["backends"] if b["name"] == BACKEND
    )
    return backend


def poll(condition: Callable[[], bool], give_up: Callable[[], bool], timeout: float = SLOW) -> bool:
    """Whether ``condition`` came true before ``give_up`` did (or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if give_up():
            return False
        time.sleep(POLL_PAUSE)
    return condition()


class LongStreams:
    """``count`` streams of ``body`` to ``url``, each read on a thread of its own.

    Leaving the block closes the ones still running (the gateway passes the close on and
    the engine aborts them). ``cut_short`` tells, per stream, whether it was still running
    then: on 2 busy cores a stream can end before the test has done what it needed it for.
    """

    def __init__(self, url: str, body: dict[str, Any], count: int) -> None:
        self.url, self.body, self.count = url, {**body, "stream": True}, count
        self.statuses: list[int] = []
        self.cut_short: list[bool] = []
        self._release = threading.Event()
        self._pool = ThreadPoolExecutor(count)
        self._streams: list[Future[None]] = []

    def __enter__(self) -> LongStreams:
        self._streams = [self._pool.submit(self._read) for _ in range(self.count)]
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self._pool.shutdown(wait=True)
        for stream in self._streams:
            stream.result()  # re-raise what a reader hit

    def any_ended(self) -> bool:
        return any(stream.done() for stream in self._streams)

    def _read(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=SLOW) as response:
            self.statuses.append(response.status_code)
            for _ in response.iter_lines():
                if self._release.is_set():
                    break
            self.cut_short.append(self._release.is_set())


def start_real_gateway(tmp: Path, engine: RealVllm, limit: int, **config: Any) -> Gateway:
    """A gateway process with the engine as its one backend (models discovered), ready.

    The limit is static so that nothing but the test moves it; engine gauges are scraped
    twice a second and the measurement window is long enough to outlive a module.
    """
    static = {"kind": "static", "initial": limit, "min": 1, "max": limit}
    backend = {"name": BACKEND, "url": engine.root_url, "engine": "vllm", "limit": static}
    base: dict[str, Any] = {
        "pools": {"short": {}},
        "backends": [backend],
        # A busy CPU engine can take seconds to answer /health: no flapping in the tests.
        "health": {"interval_s": 0.5, "timeout_s": SLOW / 2},
        "measurement": {"window_s": 600, "scrape_interval_s": 0.5},
    }
    gateway = start_gateway(tmp, {**base, **config})
    try:
        # Up, with the engine's model discovered from its /v1/models.
        wait_until(lambda: _serves(gateway, engine.model), timeout=SLOW, interval=0.1)
    except BaseException:
        gateway.proc.stop()
        raise
    return gateway


def _serves(gateway: Gateway, model: str) -> bool:
    try:
        response = _POLLS.get(gateway.url + "/v1/models")
    except httpx.HTTPError:
        return False
    return model in {m["id"] for m in response.json()["data"]}


@pytest.fixture
def client(gateway: Gateway) -> Iterator[openai.OpenAI]:
    """The openai client on the test module's ``gateway`` (test_direct.py has its own,
    on the engine)."""
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c
