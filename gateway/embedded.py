"""The embedded default: three simulated backends, so `kneecap serve` runs anywhere."""

from __future__ import annotations

from typing import Any

DEFAULT_MODEL = "Qwen/Qwen3-4B"


def default_config() -> dict[str, Any]:
    def sim_backend(name: str, pool: str) -> dict[str, Any]:
        return {"name": name, "pool": pool, "engine": "vllm", "models": [DEFAULT_MODEL], "sim": {}}

    return {
        "backends": [
            sim_backend("sim-short-0", "short"),
            sim_backend("sim-short-1", "short"),
            sim_backend("sim-long-0", "long"),
        ]
    }
