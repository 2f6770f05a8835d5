"""GatewayMetrics: names and types from the issue, one call per request, clean removal."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import ITL_BUCKETS, GatewayMetrics, render
from gateway.record import REJECT_REASONS, RequestRecord

EXPECTED = {
    "kneecap_request_ttft_seconds": "histogram",
    "kneecap_request_itl_seconds": "histogram",
    "kneecap_request_e2e_seconds": "histogram",
    "kneecap_request_queue_seconds": "histogram",
    "kneecap_request_overhead_seconds": "histogram",
    "kneecap_requests": "counter",
    "kneecap_prompt_tokens": "counter",
    "kneecap_completion_tokens": "counter",
    "kneecap_inflight_requests": "gauge",
    "kneecap_concurrency_limit": "gauge",
    "kneecap_queue_depth": "gauge",
    "kneecap_rejected_requests": "counter",
    "kneecap_backend_up": "gauge",
    "kneecap_backend_ejections": "counter",
    "kneecap_engine_requests_running": "gauge",
    "kneecap_engine_requests_waiting": "gauge",
    "kneecap_engine_kv_cache_usage_ratio": "gauge",
    "kneecap_output_tokens_per_second": "gauge",
    "kneecap_config_reloads": "counter",
    "kneecap_upstream_retries": "counter",
}


def record(backend: str = "vllm-0", **overrides: object) -> RequestRecord:
    fields: dict[str, object] = {
        "backend": backend,
        "pool": "short",
        "model": "Qwen/Qwen3-4B",
        "status": "ok",
        "stream": True,
        "finish_reason": "stop",
        "queue_s": 0.002,
        "upstream_s": 0.0025,
        "overhead_s": 0.0005,
        "ttft_s": 0.05,
        "itl_s": [0.01, 0.02, 0.012],
        "e2e_s": 0.1,
        "prompt_tokens": 12,
        "completion_tokens": 4,
    }
    fields.update(overrides)
    return RequestRecord(**fields)  # type: ignore[arg-type]


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    body, _ = render(registry)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return samples(registry).get((name, frozenset(labels.items())))


def test_every_issue_metric_is_defined_with_its_type() -> None:
    registry = CollectorRegistry()
    GatewayMetrics(registry)
    families = {m.name: m.type for m in registry.collect()}
    assert families == EXPECTED


def test_instances_on_separate_registries_do_not_collide() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    GatewayMetrics(first).observe_request(record())
    GatewayMetrics(second)
    assert value(first, "kneecap_requests_total", backend="vllm-0", pool="short",
                 model="Qwen/Qwen3-4B", status="ok") == 1.0  # fmt: skip
    assert value(second, "kneecap_requests_total", backend="vllm-0", pool="short",
                 model="Qwen/Qwen3-4B", status="ok") is None  # fmt: skip


def test_observe_request_counts_tokens_status_and_latencies() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    metrics.observe_request(record())
    metrics.observe_request(record(status="client_closed", ttft_s=None, itl_s=[]))
    labels = {"backend": "vllm-0", "pool": "short", "model": "Qwen/Qwen3-4B"}
    assert value(registry, "kneecap_requests_total", status="ok", **labels) == 1
    assert value(registry, "kneecap_requests_total", status="client_closed", **labels) == 1
    assert value(registry, "kneecap_prompt_tokens_total", **labels) == 24
    assert value(registry, "kneecap_completion_tokens_total", **labels) == 8
    assert value(registry, "kneecap_request_e2e_seconds_count", **labels) == 2
    assert value(registry, "kneecap_request_queue_seconds_count", **labels) == 2
    # The gateway's own time before the upstream write, queue wait excluded: 0.5 ms, twice.
    assert value(registry, "kneecap_request_overhead_seconds_count", **labels) == 2
    assert value(registry, "kneecap_request_overhead_seconds_sum", **labels) == pytest.approx(0.001)
    # A request without output contributes no TTFT and no ITL.
    assert value(registry, "kneecap_request_ttft_seconds_count", **labels) == 1
    assert value(registry, "kneecap_request_itl_seconds_count", **labels) == 3
    assert value(registry, "kneecap_request_itl_seconds_sum", **labels) == pytest.approx(0.042)


def test_bulk_itl_histogram_exposes_what_a_plain_histogram_would() -> None:
    rng = random.Random(7)
    gaps = [rng.choice([*ITL_BUCKETS, 0.0]) for _ in range(50)]  # edges are inclusive
    gaps += [rng.uniform(0.0, 12.0) for _ in range(200)]
    ours, reference = CollectorRegistry(), CollectorRegistry()
    GatewayMetrics(ours).observe_request(record(itl_s=gaps))
    plain = Histogram(
        "kneecap_request_itl_seconds", "x", ("backend", "pool", "model"),
        registry=reference, buckets=ITL_BUCKETS,
    )  # fmt: skip
    child = plain.labels("vllm-0", "short", "Qwen/Qwen3-4B")
    for gap in gaps:
        child.observe(gap)
    got = {k: v for k, v in samples(ours).items() if k[0].startswith("kneecap_request_itl")}
    want = {k: v for k, v in samples(reference).items() if not k[0].endswith("_created")}
    assert got.keys() == want.keys()
    for key, expected in want.items():
        assert got[key] == pytest.approx(expected), key


def test_register_pool_and_backend_precreate_zeroed_series() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    metrics.register_pool("short", ["interactive", "batch"])
    metrics.register_backend("vllm-0", "short")
    for reason in REJECT_REASONS:
        assert value(registry, "kneecap_rejected_requests_total", pool="short", reason=reason) == 0
    assert value(registry, "kneecap_queue_depth", pool="short", priority="batch") == 0
    assert value(registry, "kneecap_backend_up", backend="vllm-0", pool="short") == 0
    assert value(registry, "kneecap_upstream_retries_total", backend="vllm-0") == 0
    assert value(registry, "kneecap_config_reloads_total", result="error") == 0
    metrics.set_backend_state("vllm-0", up=True, inflight=3, limit=16)
    metrics.observe_rejection("short", "queue_full")
    assert value(registry, "kneecap_concurrency_limit", backend="vllm-0", pool="short") == 16
    assert (
        value(registry, "kneecap_rejected_requests_total", pool="short", reason="queue_full") == 1
    )


def test_remove_backend_drops_every_label_set_of_that_backend_only() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    for name in ("vllm-0", "vllm-1"):
        metrics.register_backend(name, "short")
        metrics.set_backend_state(name, up=True, inflight=1, limit=8)
        metrics.set_engine_stats(name, running=1, waiting=0, kv_cache_usage=0.3)
        metrics.set_output_tokens_per_second(name, 100.0)
        metrics.observe_retry(name)
        metrics.observe_request(record(name))
    metrics.remove_backend("vllm-0")
    metrics.remove_backend("vllm-0")  # idempotent
    backends = {dict(labels).get("backend") for _, labels in samples(registry)}
    assert "vllm-0" not in backends
    assert "vllm-1" in backends
    # Coming back starts from zero.
    metrics.register_backend("vllm-0", "long")
    assert value(registry, "kneecap_backend_up", backend="vllm-0", pool="long") == 0


def test_moving_a_backend_to_another_pool_drops_the_old_pool_labels() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    metrics.register_backend("sglang-0", "short")
    metrics.register_backend("sglang-0", "long")
    assert value(registry, "kneecap_backend_up", backend="sglang-0", pool="short") is None
    assert value(registry, "kneecap_backend_up", backend="sglang-0", pool="long") == 0


def test_render_negotiates_openmetrics() -> None:
    registry = CollectorRegistry()
    GatewayMetrics(registry).observe_request(record())
    body, content_type = render(registry)
    assert content_type.startswith("text/plain")
    assert b"kneecap_request_itl_seconds_bucket{" in body
    body, content_type = render(registry, "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")


def test_a_request_never_written_upstream_has_no_overhead_sample() -> None:
    """A client that left while the gateway connected: the request counts, but the
    gateway's time before the upstream write was never completed, so it is not a sample."""
    registry = CollectorRegistry()
    never_written = record(status="client_closed", upstream_s=None, overhead_s=None)
    GatewayMetrics(registry).observe_request(never_written)
    labels = {"backend": "vllm-0", "pool": "short", "model": "Qwen/Qwen3-4B"}
    assert value(registry, "kneecap_requests_total", status="client_closed", **labels) == 1
    assert value(registry, "kneecap_request_overhead_seconds_count", **labels) == 0
