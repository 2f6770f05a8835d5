"""Minimal Prometheus text for engines without their own histograms.

Speaks the real engine's gauge and counter names so the gateway's scraper is
tested against what it meets in production.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.sim.base import EngineFlavor, EngineStats


@dataclass(slots=True)
class EngineCounters:
    running: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cancelled_total: int = 0


def render_engine_metrics(
    flavor: EngineFlavor, model: str, stats: EngineStats, cancelled_total: int
) -> bytes:
    labels = f'{{model_name="{model}"}}'
    if flavor == "vllm":
        rows = [
            ("vllm:num_requests_running", "gauge", stats.running),
            ("vllm:num_requests_waiting", "gauge", stats.waiting),
            ("vllm:kv_cache_usage_perc", "gauge", stats.kv_usage),
            ("vllm:num_preemptions_total", "counter", stats.preemptions_total),
            ("vllm:prompt_tokens_total", "counter", stats.prompt_tokens_total),
            ("vllm:generation_tokens_total", "counter", stats.generation_tokens_total),
        ]
    else:
        rows = [
            ("sglang:num_running_reqs", "gauge", stats.running),
            ("sglang:num_queue_reqs", "gauge", stats.waiting),
            ("sglang:token_usage", "gauge", stats.kv_usage),
            ("sglang:prompt_tokens_total", "counter", stats.prompt_tokens_total),
            ("sglang:generation_tokens_total", "counter", stats.generation_tokens_total),
        ]
    rows.append(("kneecap_sim_cancelled_requests_total", "counter", cancelled_total))
    lines = []
    for name, kind, value in rows:
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name}{labels} {value}")
    return ("\n".join(lines) + "\n").encode()
