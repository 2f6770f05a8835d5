"""Pool choice by prompt length: long prompts go to the pool whose range holds them."""

from __future__ import annotations

from collections.abc import Mapping

from gateway.settings import PoolConfig


def choose_pool(
    pools: Mapping[str, PoolConfig], serving_pools: set[str], prompt_tokens: int
) -> str | None:
    """The pool whose range holds the prompt, among pools with a replica for the model.

    When no serving pool's range holds it, the serving pool with the highest
    range is used so that the request still has a chance to be served; the
    context-aware routing policy replaces this with explicit spill rules.
    """
    in_range = [
        name for name in pools if name in serving_pools and pools[name].accepts(prompt_tokens)
    ]
    if in_range:
        return in_range[0]
    candidates = sorted(
        (name for name in pools if name in serving_pools),
        key=lambda name: pools[name].min_prompt_tokens,
    )
    return candidates[-1] if candidates else None
