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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

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


@pytest.fixture(scope="session")
def real_vllm() -> Iterator[RealVllm]:
    external = os.environ.get("KNEECAP_REAL_VLLM_URL")
    if external:
        yield RealVllm(external.rstrip("/").removesuffix("/v1"), pid=None)
        return
    # pytest's main thread lives as long as the session: safe for die_with_parent.
    server = vllm_server.start(die_with_parent=True)
    try:
        yield RealVllm(server.root_url, server.pid)
    finally:
        server.stop()
