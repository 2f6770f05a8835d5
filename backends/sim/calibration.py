"""The fixed calibration workload and the "simulator vs field" table.

Workload (fixed; chosen once to reproduce the field report, then frozen):

* closed loop as ``vllm bench serve --max-concurrency C --num-prompts N``
  runs it: C clients start together at t = 0 (the start-up burst is part of
  the measurement) and each replaces its finished request at once;
* prompts of 1,024 tokens, outputs of exactly 2,816 tokens (ignore_eos).
  The report does not state its output length; long outputs (Qwen3 thinks
  aloud) are what make KV capacity, not compute, bound the engine at 64;
* concurrency sweep: N = 640 requests at C = 32 and 64 (N = 8 at C = 1,
  which has no latency target and would otherwise take 1.8 M steps);
* prompt-length sweep at C = 8: N = 128 / 64 / 16 for 1K / 8K / 32K
  prompts -- runs of comparable simulated length (a quarter hour or more),
  as one would budget a real benchmark of long prompts; single-request TTFT
  is the median of one request on an idle engine.

Everything runs on the virtual clock. The field figures live here only to
be compared against; the engine never sees them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from backends.sim.closedloop import (
    RequestRecord,
    output_throughput,
    percentile,
    run_closed_loop,
)
from backends.sim.profiles import GPUS, get_profile

__all__ = ["Check", "RequestRecord", "calibration_checks", "calibration_table", "run_closed_loop"]

PROMPT_TOKENS = 1024
OUTPUT_TOKENS = 2816
SWEEP_REQUESTS = 640
SWEEP_REQUESTS_C1 = 8
CONTEXT_CONCURRENCY = 8
CONTEXT_REQUESTS = {1024: 128, 8192: 64, 32768: 16}

BASE = "qwen3-4b/l40s/bf16/vllm"


@dataclass(frozen=True, slots=True)
class Run:
    throughput: float  # output tok/s over the whole run
    ttft_p50: float  # s
    ttft_p95: float  # s
    itl_mean: float  # s, mean over requests of each request's mean gap


@cache
def measure(profile: str, concurrency: int, prompt: int, n_requests: int) -> Run:
    records = run_closed_loop(
        get_profile(profile), concurrency, prompt, OUTPUT_TOKENS, n_requests, seed=0
    )
    ttfts = [r.ttft for r in records]
    return Run(
        throughput=output_throughput(records),
        ttft_p50=percentile(ttfts, 50),
        ttft_p95=percentile(ttfts, 95),
        itl_mean=statistics.fmean(r.mean_itl for r in records),
    )


def sweep(profile: str, concurrency: int) -> Run:
    n = SWEEP_REQUESTS_C1 if concurrency == 1 else SWEEP_REQUESTS
    return measure(profile, concurrency, PROMPT_TOKENS, n)


@cache
def single_ttft(profile: str, prompt: int) -> float:
    records = run_closed_loop(get_profile(profile), 1, prompt, 1, 1)
    return records[0].ttft


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    sim: float
    field: float | None  # None: a relation with no single field number
    lo: float
    hi: float
    unit: str = ""

    @property
    def ok(self) -> bool:
        return self.lo <= self.sim <= self.hi


def _within(name: str, sim: float, field: float, tol: float, unit: str) -> Check:
    return Check(name, sim, field, field * (1 - tol), field * (1 + tol), unit)


def _abs(name: str, sim: float, field: float, tol: float) -> Check:
    return Check(name, sim, field, field - tol, field + tol, "x")


def _base_checks() -> list[Check]:
    checks = []
    for c, tok_s in ((1, 74), (32, 1088), (64, 1261)):
        checks.append(_within(f"throughput c={c}", sweep(BASE, c).throughput, tok_s, 0.20, "tok/s"))
    for c, ms in ((32, 292), (64, 2100)):
        checks.append(_within(f"p95 TTFT c={c}", sweep(BASE, c).ttft_p95 * 1e3, ms, 0.35, "ms"))
    for prompt, ms in ((1024, 56), (8192, 487), (32768, 3060)):
        ttft = single_ttft(BASE, prompt) * 1e3
        checks.append(_within(f"single TTFT {prompt // 1024}K", ttft, ms, 0.20, "ms"))
    for prompt, ms in ((1024, 176), (8192, 2500)):
        run = measure(BASE, CONTEXT_CONCURRENCY, prompt, CONTEXT_REQUESTS[prompt])
        checks.append(
            _within(f"c=8 p95 TTFT {prompt // 1024}K", run.ttft_p95 * 1e3, ms, 0.35, "ms")
        )
    run = measure(BASE, CONTEXT_CONCURRENCY, 32768, CONTEXT_REQUESTS[32768])
    checks.append(
        Check("c=8 p95 TTFT 32K", run.ttft_p95 * 1e3, 100_000, 60_000, float("inf"), "ms")
    )
    gain = sweep(BASE, 64).throughput / sweep(BASE, 32).throughput
    growth = sweep(BASE, 64).ttft_p95 / sweep(BASE, 32).ttft_p95
    checks.append(Check("knee: throughput 64/32", gain, 1261 / 1088, 0.0, 1.25, "x"))
    checks.append(Check("knee: p95 TTFT 64/32", growth, 2100 / 292, 4.0, float("inf"), "x"))
    return checks


def _relative_checks() -> list[Check]:
    def thr(profile: str, c: int = 32) -> float:
        return sweep(profile, c).throughput

    fp8, awq, sgl = "qwen3-4b/l40s/fp8/vllm", "qwen3-4b/l40s/awq/vllm", "qwen3-4b/l40s/bf16/sglang"
    itl = {p: sweep(p, 32).itl_mean for p in (BASE, fp8, awq)}
    checks = [
        _abs("FP8/BF16 throughput c=32", thr(fp8) / thr(BASE), 1.18, 0.08),
        _abs("AWQ/BF16 throughput c=32", thr(awq) / thr(BASE), 1.41, 0.10),
        Check("FP8/BF16 throughput c=1", thr(fp8, 1) / thr(BASE, 1), None, 0.0, 1.05, "x"),
        Check("AWQ ITL / best other c=32", itl[awq] / min(itl[BASE], itl[fp8]), None, 0, 1, "x"),
    ]
    for c in (32, 64):
        s, v = sweep(sgl, c), sweep(BASE, c)
        inf = float("inf")
        checks.append(
            Check(f"SGLang/vLLM throughput c={c}", s.throughput / v.throughput, None, 1, inf)
        )
        checks.append(Check(f"SGLang/vLLM p95 TTFT c={c}", s.ttft_p95 / v.ttft_p95, None, 1, inf))
    checks.append(
        Check(
            "SGLang/vLLM ITL c=32", sweep(sgl, 32).itl_mean / sweep(BASE, 32).itl_mean, None, 0, 1
        )
    )
    return checks


def _gpu_checks() -> list[Check]:
    """Other GPUs follow their specs: decode by bandwidth, prefill by compute."""
    base = GPUS["l40s"]
    checks = []
    for gpu in ("l4", "h100-sxm"):
        profile = f"qwen3-4b/{gpu}/bf16/vllm"
        spec = GPUS[gpu]
        decode = sweep(profile, 1).throughput / sweep(BASE, 1).throughput
        prefill = single_ttft(BASE, 8192) / single_ttft(profile, 8192)
        bw, fl = spec.mem_bw_gb_s / base.mem_bw_gb_s, spec.bf16_tflops / base.bf16_tflops
        checks.append(_within(f"{gpu}/l40s decode c=1 vs bandwidth", decode, bw, 0.35, "x"))
        checks.append(_within(f"{gpu}/l40s prefill 8K vs TFLOPS", prefill, fl, 0.35, "x"))
        ratio = sweep(profile, 32).throughput / sweep(BASE, 32).throughput
        lo, hi = (0.0, 1.0) if bw < 1 else (1.0, float("inf"))
        checks.append(Check(f"{gpu}/l40s throughput c=32", ratio, None, lo, hi, "x"))
    return checks


CHECK_GROUPS: dict[str, Callable[[], list[Check]]] = {
    BASE: _base_checks,
    "relative profiles": _relative_checks,
    "other GPUs": _gpu_checks,
}


def calibration_checks() -> dict[str, list[Check]]:
    return {group: build() for group, build in CHECK_GROUPS.items()}


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if value == float("inf"):
        return "inf"
    return f"{value:,.0f}" if unit in ("ms", "tok/s") else f"{value:.2f}"


def calibration_table() -> str:
    """Simulator vs field figures; what ``kneecap sim --calibrate`` prints."""
    lines = [
        f"workload: closed loop, {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS}-token outputs; "
        f"sweep N={SWEEP_REQUESTS} (N={SWEEP_REQUESTS_C1} at c=1); "
        f"c={CONTEXT_CONCURRENCY} prompt sweep N={CONTEXT_REQUESTS}",
    ]
    header = f"{'check':<38} {'simulator':>10} {'field':>10} {'accepted range':>22}  ok"
    for group, checks in calibration_checks().items():
        lines += ["", f"## {group}", header]
        for c in checks:
            band = f"{_fmt(c.lo, c.unit)} .. {_fmt(c.hi, c.unit)}"
            mark = "yes" if c.ok else "NO"
            lines.append(
                f"{c.name:<38} {_fmt(c.sim, c.unit):>10} {_fmt(c.field, c.unit):>10} "
                f"{band:>22}  {mark}"
            )
    return "\n".join(lines)
