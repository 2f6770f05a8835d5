"""Dashboard panels compute the right value, not just some value.

A real Prometheus scrapes a ``GatewayMetrics`` fed with a known mix: the panels'
expressions, run as Grafana would run them, must give the figures that mix implies.
Each batch of observations and each exposition hold one lock, so every scrape sees
whole batches and the ratio of two rates is exact.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.metrics import GatewayMetrics, render
from gateway.record import RequestRecord, RequestStatus
from tests.prom import BUILTINS, expressions, load_dashboard, running_prometheus, substitute

MODEL = "Qwen/Qwen3-4B"
LIMIT = 4
# name -> (pool, up, in flight): "b" is down with streams still running on it.
BACKENDS = {"a": ("short", True, LIMIT), "b": ("short", False, 2), "c": ("long", True, 1)}


def record(backend: str, pool: str, status: RequestStatus, prompt: int | None) -> RequestRecord:
    return RequestRecord(
        backend=backend, pool=pool, model=MODEL, status=status, stream=True,
        finish_reason="stop" if prompt else None, queue_s=0.01, ttft_s=None, itl_s=(),
        e2e_s=0.5, prompt_tokens=prompt, completion_tokens=10 if prompt else None,
    )  # fmt: skip


def feed(metrics: GatewayMetrics, lock: threading.Lock, stop: threading.Event) -> None:
    """Per batch and pool: 2 ok requests of 100 prompt tokens, 3 without usage."""
    for name, (pool, up, inflight) in BACKENDS.items():
        metrics.register_backend(name, pool)
        metrics.set_backend_state(name, up=up, inflight=inflight, limit=LIMIT)
    while not stop.wait(0.05):
        with lock:
            for backend, pool in (("a", "short"), ("c", "long")):
                for _ in range(2):
                    metrics.observe_request(record(backend, pool, "ok", 100))
                for status in ("client_error", "client_closed", "upstream_error"):
                    metrics.observe_request(record(backend, pool, status, None))


@pytest.fixture
def known_target() -> Iterator[str]:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    lock, stop = threading.Lock(), threading.Event()

    class Exposition(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            with lock:
                body, content_type = render(registry)
            self.send_response(200)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Exposition)
    threads = [
        threading.Thread(target=server.serve_forever, daemon=True),
        threading.Thread(target=feed, args=(metrics, lock, stop), daemon=True),
    ]
    for thread in threads:
        thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        for thread in threads:
            thread.join(10)


def panel_expr(title: str) -> str:
    (expr,) = [e for where, e in expressions(load_dashboard()) if where == f"{title} / A"]
    return substitute(expr, {**BUILTINS, "pool": ".*", "backend": ".*"})


@pytest.mark.prometheus
def test_mean_prompt_and_saturation_panels_compute_the_true_figures(
    tmp_path: Path, known_target: str
) -> None:
    with running_prometheus(tmp_path / "prom", {"kneecap": [known_target]}) as prom:
        prom.wait_for_scrape("kneecap", scrapes=3)

        def by_pool(title: str) -> dict[str, float]:
            found = prom.query(panel_expr(title))
            return {s["metric"].get("pool", ""): float(s["value"][1]) for s in found}

        # Only ok requests carry a usage: 100 tokens each, whatever else is counted.
        mean = by_pool("Mean prompt tokens per request by pool")
        assert mean == pytest.approx({"short": 100.0, "long": 100.0}), mean
        # The up backends are full in short ("b" is down: its limit is no room, its
        # streams take none of "a"'s); "c" holds 1 of 4 in long.
        assert by_pool("In flight / limit") == pytest.approx({"": 5 / 8})  # all pools
        assert by_pool("In flight / limit by pool") == pytest.approx({"short": 1.0, "long": 0.25})
