"""Roofline step time of one engine iteration on one GPU.

An iteration runs every scheduled token through the model once. Its time is
the sum of four parts, each the slower of bytes-over-bandwidth and
FLOPs-over-compute for the kernels involved:

* a fixed per-step overhead (CPU scheduling, sampling, kernel launches);
* the linear layers: the weights are read once per step whatever the batch,
  and every token costs ``2 * params`` FLOPs, so they take
  ``max(weight read, tokens * 2P / compute)`` -- memory-bound in decode,
  compute-bound in prefill;
* decode attention: every running sequence reads its whole KV cache, so the
  step reads ``kv_tokens * kv_bytes_per_token`` more bytes;
* prefill attention: a prompt token at position ``i`` attends to ``i`` keys,
  ``4 * layers * heads * head_dim`` FLOPs per (query, key) pair.

Real kernels reach only a fraction of the data-sheet peaks; those fractions
(:class:`Efficiency`) are the calibration knobs. Nothing here knows about
concurrency or workloads: the knee comes out of the scheduler feeding this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ComputeKind = Literal["bf16", "fp8"]


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    vram_gb: float
    mem_bw_gb_s: float
    bf16_tflops: float
    fp8_tflops: float | None  # None: no FP8 tensor cores


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    hf_name: str  # what /v1/models and the metrics' model_name report
    params: float
    embedding_params: float  # tied embedding / LM head, kept 16-bit by quantizers
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    max_context: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, 16-bit

    @property
    def attention_flops_per_pair(self) -> float:
        return 4.0 * self.layers * self.attention_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class WeightFormat:
    name: str
    bytes_per_param: float  # quantized (non-embedding) weights, scales included
    compute: ComputeKind  # tensor-core path of the linear layers
    # Small-batch penalty of the format's GEMM kernels: with M rows in the
    # batch they reach M / (M + small_batch_rows) of the memory bandwidth.
    # W8A8 FP8 kernels quantize activations per token and are tuned for
    # M >= 16, so at batch 1 they read FP8 weights no faster than cuBLAS
    # reads BF16 ones -- the field saw no FP8 gain at very low concurrency.
    small_batch_rows: float = 0.0
    hf_suffix: str = ""

    def weight_bytes(self, model: ModelShape) -> float:
        quantized = model.params - model.embedding_params
        return quantized * self.bytes_per_param + model.embedding_params * 2.0


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Fractions of the data-sheet peaks that real kernels reach."""

    bandwidth: float  # of mem_bw for weight and KV reads
    compute: float  # of the tensor-core peak for the linear layers
    attention: float  # of the BF16 peak for prefill attention
    step_overhead_s: float  # fixed cost of one engine iteration


@dataclass(frozen=True, slots=True)
class StepCost:
    """Per-step coefficients, precomputed so that a step costs a few flops."""

    overhead: float  # s
    weight_read: float  # s to stream the weights once
    small_batch_rows: float
    per_token: float  # s of linear-layer compute per scheduled token
    per_kv_token: float  # s to read one token of KV cache
    per_pair: float  # s per prefill (query, key) attention pair

    def step_time(self, tokens: int, kv_read_tokens: int, attention_pairs: float) -> float:
        """Duration of a step that computes ``tokens`` tokens.

        ``kv_read_tokens``: KV-cache tokens read by decode attention and by
        chunked prefill attending to its own earlier chunks;
        ``attention_pairs``: (query, key) pairs of prefill attention.
        """
        weights = self.weight_read * (1.0 + self.small_batch_rows / tokens)
        linear = tokens * self.per_token
        return (
            self.overhead
            + (weights if weights > linear else linear)
            + kv_read_tokens * self.per_kv_token
            + attention_pairs * self.per_pair
        )


def build_step_cost(gpu: Gpu, model: ModelShape, fmt: WeightFormat, eff: Efficiency) -> StepCost:
    bandwidth = gpu.mem_bw_gb_s * 1e9 * eff.bandwidth
    peak = gpu.fp8_tflops if fmt.compute == "fp8" else gpu.bf16_tflops
    if peak is None:
        raise ValueError(f"{gpu.name} has no {fmt.compute} tensor cores")
    return StepCost(
        overhead=eff.step_overhead_s,
        weight_read=fmt.weight_bytes(model) / bandwidth,
        small_batch_rows=fmt.small_batch_rows,
        per_token=2.0 * model.params / (peak * 1e12 * eff.compute),
        per_kv_token=model.kv_bytes_per_token / bandwidth,
        per_pair=model.attention_flops_per_pair / (gpu.bf16_tflops * 1e12 * eff.attention),
    )


def prefill_pairs(start: int, length: int) -> float:
    """(query, key) pairs when positions ``start .. start+length-1`` attend causally."""
    return length * start + length * (length + 1) / 2.0
