"""What each engine calls its load gauges in /metrics (one table, no if-chains).

Names verified against vLLM's and SGLang's metric documentation; vLLM renamed
``gpu_cache_usage_perc`` to ``kv_cache_usage_perc``, so both are accepted, the
new name first.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineMetricNames:
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]


ENGINE_METRICS: dict[str, EngineMetricNames] = {
    "vllm": EngineMetricNames(
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    "sglang": EngineMetricNames(
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_usage=("sglang:token_usage",),
    ),
}
