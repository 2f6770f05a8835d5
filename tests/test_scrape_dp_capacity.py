"""A data-parallel engine's KV capacity is its whole cache, as its KV usage is the share of
the whole in use: the token budget (0.95 of the capacity) then budgets the whole engine.
SGLang reports a pool per data-parallel rank (``dp_rank``); vLLM's API server reports the
ranks' sum on every rank's series."""

from __future__ import annotations

from backends.engines import ENGINE_METRICS
from backends.scrape import parse_engine_gauges, parse_kv_capacity

# SGLang --dp-size 2 --tp-size 2 with every scheduler reporting: each data-parallel rank
# has a pool of its own, its tensor-parallel ranks share it.
SGLANG_DP = """\
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 160000.0
sglang:max_total_num_tokens{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="1"} 160000.0
sglang:max_total_num_tokens{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="2"} 150000.0
sglang:max_total_num_tokens{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="3"} 150000.0
sglang:token_usage{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.5
sglang:token_usage{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="2"} 0.5
"""  # noqa: E501

# vLLM --data-parallel-size 2: the API server sums the engines' blocks at startup
# (vllm/v1/engine/utils.py, wait_for_engine_startup: "Sum values from all engines in DP
# case") and labels that one cache config with each engine (loggers.py, log_metrics_info).
VLLM_DP = """\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="20000"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="20000"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
"""


def test_sglang_data_parallel_ranks_each_add_their_pool() -> None:
    assert parse_kv_capacity(SGLANG_DP) == 160000 + 150000  # was 160000: one rank's


def test_the_whole_capacity_holds_what_the_usage_says_is_in_use() -> None:
    gauges = parse_engine_gauges(SGLANG_DP, ENGINE_METRICS["sglang"], now=0.0)
    capacity = parse_kv_capacity(SGLANG_DP)
    assert gauges.kv_usage is not None and capacity is not None
    # Half of each rank's pool in use: 155,000 tokens, all within the capacity read.
    assert gauges.kv_usage * capacity == 0.5 * 160000 + 0.5 * 150000


def test_vllm_ranks_repeat_the_sum_which_is_not_counted_again() -> None:
    assert parse_kv_capacity(VLLM_DP) == 20000 * 16


def test_sglang_ranks_that_cannot_be_told_apart_count_once() -> None:
    """An SGLang that labels no ``dp_rank``: the ranks may share a pool (tensor
    parallel) or not; the largest is the safe side."""
    text = (
        'sglang:max_total_num_tokens{model_name="m",tp_rank="0"} 161721.0\n'
        'sglang:max_total_num_tokens{model_name="m",tp_rank="1"} 161000.0\n'
    )
    assert parse_kv_capacity(text) == 161721


def test_a_figure_that_is_no_pool_size_is_skipped_not_fatal() -> None:
    text = (
        'sglang:max_total_num_tokens{dp_rank="0"} NaN\n'
        'sglang:max_total_num_tokens{dp_rank="1"} -5\n'
        'sglang:max_total_num_tokens{dp_rank="2"} 1e400\n'
        'sglang:max_total_num_tokens{dp_rank="3"} 1000.0\n'
    )
    assert parse_kv_capacity(text) == 1000  # was a ValueError: the whole figure lost
