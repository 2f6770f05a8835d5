"""Which engine a simulated backend runs: a calibrated profile, or fixed latencies."""

from __future__ import annotations

from backends.sim.base import AsyncEngine, EngineFlavor
from backends.sim.fixed import FixedLatencyEngine


def make_engine(
    *,
    model: str,
    profile: str | None = None,
    ttft_ms: float = 50.0,
    itl_ms: float = 15.0,
    speed: float = 1.0,
    seed: int = 0,
    flavor: EngineFlavor = "vllm",
) -> AsyncEngine:
    if profile:
        from backends.sim.realtime import build_engine  # the calibrated engine

        return build_engine(profile, speed=speed, seed=seed, model=model)
    return FixedLatencyEngine(
        ttft_s=ttft_ms / 1000 / speed,
        itl_s=itl_ms / 1000 / speed,
        flavor=flavor,
        model=model,
        speed=speed,
    )
