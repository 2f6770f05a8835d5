"""The embedded default: three calibrated simulated GPUs, so `kneecap serve` runs anywhere.

Two vLLM replicas take the short prompts, one SGLang replica the long ones, each
a Qwen3-4B on an L40S as measured in the field, at real speed: a newcomer meets
a realistic knee on the first run.
"""

from __future__ import annotations

from typing import Any

DEFAULT_MODEL = "Qwen/Qwen3-4B"
SHORT_PROFILE = "qwen3-4b/l40s/bf16/vllm"
LONG_PROFILE = "qwen3-4b/l40s/bf16/sglang"


def default_config() -> dict[str, Any]:
    def sim_backend(name: str, pool: str, profile: str, seed: int) -> dict[str, Any]:
        return {
            "name": name,
            "pool": pool,
            "engine": profile.rsplit("/", 1)[1],
            "models": [DEFAULT_MODEL],
            "sim": {"profile": profile, "seed": seed},
        }

    return {
        "backends": [
            sim_backend("sim-short-0", "short", SHORT_PROFILE, 0),
            sim_backend("sim-short-1", "short", SHORT_PROFILE, 1),
            sim_backend("sim-long-0", "long", LONG_PROFILE, 2),
        ]
    }
