"""Named simulator profiles: model x GPU x weight format x engine.

The facts (GPU data sheets, the model's shape, bytes per weight format) are
embedded here as data; they mirror ``hardware-facts.yaml``. The engine
traits are the real engines' defaults that shape batching and memory. The
only calibrated numbers are in :data:`KERNEL_EFFICIENCY` and the engines'
step overheads, fitted once on qwen3-4b/l40s/bf16/vllm against the field
report; every other profile follows from its specs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from backends.sim.base import EngineFlavor
from backends.sim.costmodel import (
    Efficiency,
    Gpu,
    ModelShape,
    StepCost,
    WeightFormat,
    build_step_cost,
)
from backends.sim.scheduler import Batching, SchedulerConfig

GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("l4", vram_gb=24, mem_bw_gb_s=300, bf16_tflops=121, fp8_tflops=242),
        Gpu("l40s", vram_gb=48, mem_bw_gb_s=864, bf16_tflops=362, fp8_tflops=733),
        Gpu("a100-80gb", vram_gb=80, mem_bw_gb_s=2039, bf16_tflops=312, fp8_tflops=None),
        Gpu("h100-sxm", vram_gb=80, mem_bw_gb_s=3350, bf16_tflops=989, fp8_tflops=1979),
        Gpu("h200", vram_gb=141, mem_bw_gb_s=4800, bf16_tflops=989, fp8_tflops=1979),
    )
}

MODELS: dict[str, ModelShape] = {
    "qwen3-4b": ModelShape(
        name="qwen3-4b",
        hf_name="Qwen/Qwen3-4B",
        params=4.02e9,
        embedding_params=151936 * 2560,  # vocab x hidden, tied with the LM head
        layers=36,
        attention_heads=32,
        kv_heads=8,
        head_dim=128,
        max_context=40960,
    ),
}

FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("bf16", bytes_per_param=2.0, compute="bf16"),
        WeightFormat("fp8", 1.0, compute="fp8", small_batch_rows=1.0, hf_suffix="-FP8"),
        WeightFormat("awq", 0.56, compute="bf16", hf_suffix="-AWQ"),  # Marlin int4
    )
}

# Fractions of the data-sheet peaks real kernels reach, fitted on the L40S
# (see calibration.py): bandwidth from decode at concurrency 1 (74 tok/s),
# compute and attention from single-request TTFT at 1K/8K/32K prompts.
# Shared by every GPU: other GPUs follow from their specs.
KERNEL_EFFICIENCY = {"bandwidth": 0.80, "compute": 0.47, "attention": 0.58}


@dataclass(frozen=True, slots=True)
class EngineTraits:
    flavor: EngineFlavor
    batching: Batching
    token_budget: int
    max_seqs: int
    block_size: int
    memory_fraction: float  # of VRAM for weights + KV (+ runtime for vLLM)
    runtime_gb: float  # activations and CUDA graphs inside that fraction
    step_overhead_s: float
    reserve: tuple[float, float, float] = (0.0, 0.0, 0.0)  # init, min, decay per step


def _vllm(gpu: Gpu) -> EngineTraits:
    # vLLM V1 defaults for the OpenAI server: bigger batches on >= 70 GB GPUs.
    big = gpu.vram_gb >= 70
    return EngineTraits(
        flavor="vllm",
        batching="mixed",
        token_budget=8192 if big else 2048,
        max_seqs=1024 if big else 256,
        block_size=16,
        memory_fraction=0.90,  # gpu_memory_utilization
        runtime_gb=3.0,  # activation peak of the profiling run, CUDA graphs, sampler
        # CPU scheduling and sampling plus attention launched outside the
        # piecewise CUDA graphs; fitted with the bandwidth fraction.
        step_overhead_s=1.2e-3,
    )


def _sglang(gpu: Gpu) -> EngineTraits:
    # SGLang sizes its static memory pool and prefill chunk by GPU memory; the
    # overlap scheduler hides most CPU work, so a step costs less overhead.
    vram = gpu.vram_gb
    chunk = 2048 if vram < 25 else 4096 if vram < 60 else 8192 if vram < 100 else 16384
    fraction = 0.80 if vram < 25 else 0.85 if vram < 60 else 0.88 if vram < 100 else 0.90
    return EngineTraits(
        flavor="sglang",
        batching="prefill_first",
        token_budget=chunk,
        max_seqs=1024,
        block_size=1,
        memory_fraction=fraction,
        runtime_gb=0.0,  # activations live outside mem_fraction_static
        step_overhead_s=0.3e-3,
        # new_token_ratio: admission reserves this share of every running
        # request's remaining max_tokens; 0.7 decaying to 0.1 over 600 steps.
        reserve=(0.7, 0.1, (0.7 - 0.1) / 600),
    )


ENGINES: dict[str, Callable[[Gpu], EngineTraits]] = {"vllm": _vllm, "sglang": _sglang}


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    model: ModelShape
    gpu: Gpu
    fmt: WeightFormat
    engine: EngineTraits
    cost: StepCost
    kv_tokens: int
    max_seqs: int

    @property
    def flavor(self) -> EngineFlavor:
        return self.engine.flavor

    @property
    def served_model_name(self) -> str:
        return self.model.hf_name + self.fmt.hf_suffix

    def scheduler_config(self) -> SchedulerConfig:
        init, floor, decay = self.engine.reserve
        return SchedulerConfig(
            token_budget=self.engine.token_budget,
            max_seqs=self.max_seqs,
            block_size=self.engine.block_size,
            kv_blocks=self.kv_tokens // self.engine.block_size,
            batching=self.engine.batching,
            reserve_init=init,
            reserve_min=floor,
            reserve_decay=decay,
        )


def build_profile(model: str, gpu: str, fmt: str, engine: str) -> Profile:
    m, g, f = MODELS[model], GPUS[gpu], FORMATS[fmt]
    traits = ENGINES[engine](g)
    eff = Efficiency(step_overhead_s=traits.step_overhead_s, **KERNEL_EFFICIENCY)
    cost = build_step_cost(g, m, f, eff)
    kv_bytes = (
        g.vram_gb * 1e9 * traits.memory_fraction - f.weight_bytes(m) - traits.runtime_gb * 1e9
    )
    blocks = int(kv_bytes // (m.kv_bytes_per_token * traits.block_size))
    if blocks <= 0:
        raise ValueError(f"{model} in {fmt} does not fit {gpu}")
    return Profile(
        name=f"{model}/{gpu}/{fmt}/{engine}",
        model=m,
        gpu=g,
        fmt=f,
        engine=traits,
        cost=cost,
        kv_tokens=blocks * traits.block_size,
        max_seqs=min(traits.max_seqs, blocks),
    )


@cache
def _all() -> dict[str, Profile]:
    profiles = {}
    for model in MODELS:
        for gpu, spec in GPUS.items():
            for fmt, wf in FORMATS.items():
                if wf.compute == "fp8" and spec.fp8_tflops is None:
                    continue  # no FP8 tensor cores (A100)
                for engine in ENGINES:
                    p = build_profile(model, gpu, fmt, engine)
                    profiles[p.name] = p
    return profiles


def list_profiles() -> list[Profile]:
    return [p for _, p in sorted(_all().items())]


def get_profile(name: str) -> Profile:
    try:
        return _all()[name]
    except KeyError:
        valid = ", ".join(sorted(_all()))
        raise KeyError(f"unknown simulator profile {name!r}; valid profiles: {valid}") from None


def engine_conflict(profile: str, engine: str) -> str | None:
    """Why a backend said to be ``engine`` cannot run ``profile`` (None: it can).

    A profile names its engine (``…/vllm``, ``…/sglang``), which decides its scheduler,
    its step overhead and its metric names; another engine named beside it would be
    silently ignored. Raises KeyError for an unknown profile, as :func:`get_profile`."""
    simulated = get_profile(profile).flavor
    if engine == simulated:
        return None
    return f"engine {engine!r} contradicts profile {profile!r}, which simulates {simulated}"


def format_profiles() -> str:
    """What ``kneecap sim --list-profiles`` prints."""
    rows = [f"{'profile':<32} {'KV tokens':>10} {'max seqs':>9} {'budget':>7}  served model"]
    for p in list_profiles():
        rows.append(
            f"{p.name:<32} {p.kv_tokens:>10,} {p.max_seqs:>9} "
            f"{p.engine.token_budget:>7}  {p.served_model_name}"
        )
    return "\n".join(rows)
