"""Reading an engine's own /metrics: exact names, ranks summed (KV usage averaged),
fallbacks, both engines."""

from __future__ import annotations

from backends.engines import ENGINE_METRICS
from backends.scrape import parse_engine_gauges, samples

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 99.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25 1700000000000
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 7.0
"""

OLD_VLLM = """\
vllm:num_requests_running{model_name="m"} 1
vllm:num_requests_waiting{model_name="m"} 0
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
"""

SGLANG = """\
sglang:num_running_reqs{model_name="m",tp_rank="0"} 7.0
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 1.0
sglang:token_usage{model_name="m",tp_rank="0"} 0.75
"""


def test_vllm_gauges_sum_ranks_and_match_names_exactly() -> None:
    gauges = parse_engine_gauges(VLLM, ENGINE_METRICS["vllm"], now=12.0)
    assert (gauges.running, gauges.waiting, gauges.kv_usage) == (5.0, 4.0, 0.25)
    assert gauges.scraped_at == 12.0


def test_vllm_falls_back_to_the_deprecated_cache_gauge() -> None:
    gauges = parse_engine_gauges(OLD_VLLM, ENGINE_METRICS["vllm"], now=0.0)
    assert gauges.kv_usage == 0.5


def test_sglang_names() -> None:
    gauges = parse_engine_gauges(SGLANG, ENGINE_METRICS["sglang"], now=0.0)
    assert (gauges.running, gauges.waiting, gauges.kv_usage) == (7.0, 1.0, 0.75)


def test_missing_gauges_are_none_and_garbage_is_skipped() -> None:
    text = 'vllm:num_requests_running{engine="0"} not-a-number\nvllm:num_requests_waiting 2\n'
    gauges = parse_engine_gauges(text, ENGINE_METRICS["vllm"], now=0.0)
    assert gauges.running is None and gauges.waiting == 2.0 and gauges.kv_usage is None


def test_labels_with_braces_and_spaces_in_values() -> None:
    text = 'vllm:num_requests_running{model_name="a {b} c"} 6\n'
    assert list(samples(text, ("vllm:num_requests_running",))) == [
        ("vllm:num_requests_running", 'model_name="a {b} c"', 6.0)
    ]


def test_kv_usage_of_data_parallel_ranks_is_their_mean_not_their_sum() -> None:
    # vLLM's data-parallel engines and SGLang's DP ranks each report a series: requests
    # add up, but two ranks 60 % full are a backend 60 % full, not 120 %.
    vllm = (
        'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 3\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6\n'
    )
    gauges = parse_engine_gauges(vllm, ENGINE_METRICS["vllm"], now=0.0)
    assert gauges.running == 6.0
    assert gauges.kv_usage is not None and abs(gauges.kv_usage - 0.4) < 1e-9
    sglang = (
        'sglang:token_usage{model_name="m",dp_rank="0"} 0.6\n'
        'sglang:token_usage{model_name="m",dp_rank="1"} 0.6\n'
    )
    assert parse_engine_gauges(sglang, ENGINE_METRICS["sglang"], now=0.0).kv_usage == 0.6
