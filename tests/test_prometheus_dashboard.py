"""Every PromQL expression of the shipped dashboard returns data from a live gateway.

A real Prometheus scrapes the gateway's ``GET /metrics`` every second while
clients stream and non-stream chat completions through it; the test polls until
each dashboard query (template variables filled as Grafana would with "All")
has a finite value, and fails naming every panel that stays blank.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.prom import running_prometheus, wait_until_no_blank_panel

MODEL = "Qwen/Qwen3-4B"
CLIENTS = 3  # a little concurrency, so in-flight and queue panels see non-zero values
MAX_REQUESTS = 600  # per client; the stop event normally ends the loop much sooner


def chat(client: httpx.Client, stream: bool, n: int) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"count to ten, take {n}"}],
        "max_tokens": 16,
        "stream": stream,
    }
    if stream:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for _ in response.iter_lines():
                pass
    else:
        client.post("/v1/chat/completions", json=body).raise_for_status()


def drive(base_url: str, stop: threading.Event, errors: list[BaseException]) -> None:
    try:
        with httpx.Client(base_url=base_url, timeout=30.0, trust_env=False) as client:
            for n in range(MAX_REQUESTS):
                if stop.is_set():
                    return
                chat(client, stream=n % 2 == 0, n=n)
    except BaseException as exc:  # reported by the test, not lost in the thread
        errors.append(exc)


@pytest.fixture
def traffic(live_gateway: str) -> Iterator[list[BaseException]]:
    stop = threading.Event()
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=drive, args=(live_gateway, stop, errors), daemon=True)
        for _ in range(CLIENTS)
    ]
    for thread in threads:
        thread.start()
    try:
        yield errors
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)


@pytest.mark.prometheus
def test_every_dashboard_query_has_data_from_a_live_gateway(
    tmp_path: Path, live_gateway: str, traffic: list[BaseException]
) -> None:
    target = urlsplit(live_gateway).netloc
    with running_prometheus(tmp_path / "prom", {"kneecap": [target]}) as prom:
        prom.wait_for_scrape("kneecap", scrapes=2)
        wait_until_no_blank_panel(prom, timeout=45)
    assert not traffic, f"traffic through the gateway failed: {traffic[0]!r}"
