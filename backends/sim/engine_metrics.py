"""Prometheus text under the real engines' metric names, timed in engine time.

The gateway scrapes ``/metrics`` of vLLM and SGLang; the simulator speaks
the same names so that scraping is tested against what it will meet. The
latency histograms are observed in *engine* seconds: a real-clock engine at
speed K reports what the modelled GPU would, not the shortened wall time.
Each engine owns its own :class:`EngineTimings`; there is no global registry.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from backends.sim.base import EngineFlavor, EngineStats, TokenEvent
from backends.sim.sequence import TokenSink


@dataclass(frozen=True, slots=True)
class FlavorNames:
    running: str
    waiting: str
    kv_usage: str
    ttft: str
    itl: str
    e2e: str
    ttft_buckets: tuple[float, ...]
    itl_buckets: tuple[float, ...]
    e2e_buckets: tuple[float, ...]
    # counters this engine exports: (metric name, EngineStats field)
    counters: tuple[tuple[str, str], ...] = ()


FLAVORS: dict[EngineFlavor, FlavorNames] = {
    "vllm": FlavorNames(
        running="vllm:num_requests_running",
        waiting="vllm:num_requests_waiting",
        kv_usage="vllm:kv_cache_usage_perc",  # a 0..1 fraction despite the name
        ttft="vllm:time_to_first_token_seconds",
        itl="vllm:inter_token_latency_seconds",
        e2e="vllm:e2e_request_latency_seconds",
        ttft_buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                      2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
        itl_buckets=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
        e2e_buckets=(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                     50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
        counters=(
            ("vllm:num_preemptions_total", "preemptions_total"),
            ("vllm:prompt_tokens_total", "prompt_tokens_total"),
            ("vllm:generation_tokens_total", "generation_tokens_total"),
        ),
    ),
    "sglang": FlavorNames(
        running="sglang:num_running_reqs",
        waiting="sglang:num_queue_reqs",
        kv_usage="sglang:token_usage",
        ttft="sglang:time_to_first_token_seconds",
        itl="sglang:inter_token_latency_seconds",
        e2e="sglang:e2e_request_latency_seconds",
        ttft_buckets=(0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0,
                      60.0, 80.0, 100.0, 200.0, 400.0),
        itl_buckets=(0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04,
                     0.06, 0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0),
        e2e_buckets=(0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0,
                     100.0, 200.0, 400.0, 800.0),
        # SGLang's TokenizerMetricsCollector (docs: "Production Metrics"); it has no
        # preemption counter of the same meaning.
        counters=(
            ("sglang:prompt_tokens_total", "prompt_tokens_total"),
            ("sglang:generation_tokens_total", "generation_tokens_total"),
        ),
    ),
}  # fmt: skip


class Histogram:
    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last: above every bound (+Inf only)
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.total += value


class EngineTimings:
    """TTFT, ITL and e2e histograms of one engine, in engine seconds."""

    def __init__(self, flavor: EngineFlavor) -> None:
        names = FLAVORS[flavor]
        self.ttft = Histogram(names.ttft_buckets)
        self.itl = Histogram(names.itl_buckets)
        self.e2e = Histogram(names.e2e_buckets)

    def timed(self, sink: TokenSink, arrival: float) -> TokenSink:
        """Wrap a request's token sink so its latencies are recorded."""
        last = arrival

        def on_token(now: float, event: TokenEvent, /) -> None:
            nonlocal last
            if event.index == 0:
                self.ttft.observe(now - arrival)
            else:
                self.itl.observe(now - last)
            last = now
            if event.finish_reason is not None:
                self.e2e.observe(now - arrival)
            sink(now, event)

        return on_token


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float) -> str:
    return repr(float(value)) if value != float("inf") else "+Inf"


def render_metrics(
    flavor: EngineFlavor,
    model_name: str,
    stats: EngineStats,
    timings: EngineTimings,
    kv_blocks: tuple[int, int] | None = None,
) -> bytes:
    """``kv_blocks``: the KV cache as (blocks, tokens per block), as the engine states it:
    vLLM in ``cache_config_info``'s labels, SGLang as ``max_total_num_tokens``."""
    names = FLAVORS[flavor]
    label = f'model_name="{_escape(model_name)}"'
    out: list[str] = []

    def sample(name: str, kind: str, value: float) -> None:
        out.append(f"# TYPE {name} {kind}")
        out.append(f"{name}{{{label}}} {_num(value)}")

    if kv_blocks is not None:
        blocks, block_size = kv_blocks
        if flavor == "sglang":
            sample("sglang:max_total_num_tokens", "gauge", blocks * block_size)
        else:
            out.append("# TYPE vllm:cache_config_info gauge")
            out.append(
                f'vllm:cache_config_info{{block_size="{block_size}",num_gpu_blocks="{blocks}"}} 1.0'
            )

    sample(names.running, "gauge", stats.running)
    sample(names.waiting, "gauge", stats.waiting)
    sample(names.kv_usage, "gauge", stats.kv_usage)
    for name, field in names.counters:
        sample(name, "counter", getattr(stats, field))
    # Not an engine metric: lets tests see that a disconnect reached the engine.
    sample("kneecap_sim_cancelled_requests_total", "counter", stats.cancelled_total)
    for name, hist in (
        (names.ttft, timings.ttft),
        (names.itl, timings.itl),
        (names.e2e, timings.e2e),
    ):
        out.append(f"# TYPE {name} histogram")
        cumulative = 0
        for bound, n in zip((*hist.bounds, float("inf")), hist.counts, strict=True):
            cumulative += n
            out.append(f'{name}_bucket{{{label},le="{_num(bound)}"}} {_num(cumulative)}')
        out.append(f"{name}_count{{{label}}} {_num(hist.count)}")
        out.append(f"{name}_sum{{{label}}} {_num(hist.total)}")
    return ("\n".join(out) + "\n").encode()
