"""Roofline step time and the named profiles built on it."""

from __future__ import annotations

import pytest

from backends.sim.costmodel import (
    Efficiency,
    build_step_cost,
    prefill_pairs,
)
from backends.sim.profiles import FORMATS, GPUS, MODELS, format_profiles, get_profile, list_profiles

QWEN = MODELS["qwen3-4b"]
EFF = Efficiency(bandwidth=0.5, compute=0.5, attention=0.5, step_overhead_s=0.001)


def test_kv_bytes_per_token_matches_the_model_card() -> None:
    assert QWEN.kv_bytes_per_token == 147456


def test_decode_step_is_weights_plus_kv_over_bandwidth_plus_overhead() -> None:
    cost = build_step_cost(GPUS["l40s"], QWEN, FORMATS["bf16"], EFF)
    bandwidth = 864e9 * 0.5
    expected = 0.001 + QWEN.params * 2 / bandwidth + 4096 * 147456 / bandwidth
    assert cost.step_time(1, 4096, 0.0) == pytest.approx(expected)
    # More sequences read more KV; the weights are read once whatever the batch.
    one, many = cost.step_time(1, 1000, 0.0), cost.step_time(32, 32000, 0.0)
    assert many - one == pytest.approx(31000 * 147456 / bandwidth)


def test_prefill_is_compute_bound_with_a_quadratic_attention_term() -> None:
    cost = build_step_cost(GPUS["l40s"], QWEN, FORMATS["bf16"], EFF)
    flops = 362e12 * 0.5
    linear = 2048 * 2 * QWEN.params / flops
    attention = prefill_pairs(0, 2048) * 4 * 36 * 32 * 128 / flops
    assert linear > QWEN.params * 2 / (864e9 * 0.5)  # compute beats the weight read
    assert cost.step_time(2048, 0, prefill_pairs(0, 2048)) == pytest.approx(
        0.001 + linear + attention
    )


def test_prefill_pairs_counts_causal_attention_of_a_chunk() -> None:
    assert prefill_pairs(0, 1) == 1
    assert prefill_pairs(0, 3) == 6  # 1 + 2 + 3
    assert prefill_pairs(10, 2) == 11 + 12
    # Chunking does not change the total work.
    assert prefill_pairs(0, 4096) == prefill_pairs(0, 2048) + prefill_pairs(2048, 2048)


def test_quantized_formats_read_fewer_bytes_but_keep_16_bit_embeddings() -> None:
    bf16, fp8, awq = (FORMATS[f].weight_bytes(QWEN) for f in ("bf16", "fp8", "awq"))
    assert awq < fp8 < bf16
    assert fp8 > bf16 / 2 and awq > bf16 * 0.28  # the embedding stays 16-bit


def test_fp8_kernels_gain_nothing_at_batch_one_but_do_at_batch_32() -> None:
    bf16 = build_step_cost(GPUS["l40s"], QWEN, FORMATS["bf16"], EFF)
    fp8 = build_step_cost(GPUS["l40s"], QWEN, FORMATS["fp8"], EFF)
    assert fp8.step_time(1, 1000, 0.0) >= 0.95 * bf16.step_time(1, 1000, 0.0)
    assert fp8.step_time(32, 0, 0.0) < 0.7 * bf16.step_time(32, 0, 0.0)


def test_fp8_needs_fp8_tensor_cores() -> None:
    with pytest.raises(ValueError, match="fp8"):
        build_step_cost(GPUS["a100-80gb"], QWEN, FORMATS["fp8"], EFF)


def test_every_valid_combination_is_a_profile() -> None:
    names = {p.name for p in list_profiles()}
    assert len(names) == 5 * 3 * 2 - 2  # no FP8 on the A100
    for name in (
        "qwen3-4b/l40s/bf16/vllm",
        "qwen3-4b/l40s/awq/sglang",
        "qwen3-4b/l4/fp8/vllm",
        "qwen3-4b/h100-sxm/bf16/vllm",
    ):
        assert name in names
    assert "qwen3-4b/a100-80gb/fp8/vllm" not in names


def test_unknown_profile_lists_the_valid_names() -> None:
    with pytest.raises(KeyError) as err:
        get_profile("qwen3-4b/l40s/bf16/tgi")
    assert "qwen3-4b/l40s/bf16/vllm" in str(err.value)


def test_derived_capacity_follows_vram_weights_and_engine() -> None:
    p = get_profile("qwen3-4b/l40s/bf16/vllm")
    expected = (48e9 * 0.9 - QWEN.params * 2 - 3e9) / 147456
    assert p.kv_tokens == pytest.approx(expected, abs=16)
    assert p.kv_tokens % 16 == 0 and p.max_seqs == 256
    awq = get_profile("qwen3-4b/l40s/awq/vllm")
    assert awq.kv_tokens > p.kv_tokens  # smaller weights leave more room for KV
    assert get_profile("qwen3-4b/l4/bf16/vllm").kv_tokens < p.kv_tokens
    assert get_profile("qwen3-4b/h100-sxm/bf16/vllm").kv_tokens > p.kv_tokens
    assert get_profile("qwen3-4b/l40s/bf16/sglang").scheduler_config().block_size == 1


def test_format_profiles_shows_capacity() -> None:
    table = format_profiles()
    assert "qwen3-4b/l40s/bf16/vllm" in table
    assert f"{get_profile('qwen3-4b/l40s/bf16/vllm').kv_tokens:,}" in table
    assert len(table.splitlines()) == len(list_profiles()) + 1
