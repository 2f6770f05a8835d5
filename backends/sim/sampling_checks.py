"""Step 4 of vLLM's checks (see :mod:`.validate`): ``SamplingParams._verify_args``, in its
order, one row per check."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backends.sim.refusal import refused


@dataclass(frozen=True, slots=True)
class _Range:
    """One of ``SamplingParams._verify_args``'s checks. ``says`` is formatted with every
    sampling value; ``named`` when vLLM names the parameter (``param``, and its value in
    the message)."""

    name: str
    holds: Callable[[dict[str, Any]], bool]
    says: str
    named: bool = False


_SAMPLING_CHECKS = (
    _Range("n", lambda v: v["n"] >= 1, "n must be at least 1, got {n}."),
    _Range(
        "presence_penalty",
        lambda v: -2.0 <= v["presence_penalty"] <= 2.0,
        "presence_penalty must be in [-2, 2], got {presence_penalty}.",
    ),
    _Range(
        "frequency_penalty",
        lambda v: -2.0 <= v["frequency_penalty"] <= 2.0,
        "frequency_penalty must be in [-2, 2], got {frequency_penalty}.",
    ),
    _Range(
        "repetition_penalty",
        lambda v: math.isfinite(v["repetition_penalty"]),
        "repetition_penalty must be a finite number, got {repetition_penalty}.",
    ),
    _Range(
        "repetition_penalty",
        lambda v: v["repetition_penalty"] > 0.0,
        "repetition_penalty must be greater than zero, got {repetition_penalty}.",
    ),
    _Range(
        "temperature",
        lambda v: math.isfinite(v["temperature"]),
        "temperature must be a finite number, got {temperature}.",
        named=True,
    ),
    _Range(
        "temperature",
        lambda v: v["temperature"] >= 0.0,
        "temperature must be non-negative, got {temperature}.",
        named=True,
    ),
    _Range(
        "temperature",
        lambda v: v["temperature"] <= 2.0,
        "temperature must be in [0, 2], got {temperature}.",
        named=True,
    ),
    _Range(
        "top_p",
        lambda v: 0.0 < v["top_p"] <= 1.0,
        "top_p must be in (0, 1], got {top_p}.",
        named=True,
    ),
    _Range(  # -1 is quietly accepted as "disabled", like 0
        "top_k",
        lambda v: v["top_k"] >= -1,
        "top_k must be 0 (disable), or at least 1, got {top_k}.",
    ),
    _Range("min_p", lambda v: 0.0 <= v["min_p"] <= 1.0, "min_p must be in [0, 1], got {min_p}."),
    _Range(
        "max_tokens",
        lambda v: v["max_tokens"] >= 1,
        "max_tokens must be at least 1, got {max_tokens}.",
        named=True,
    ),
    _Range(
        "min_tokens",
        lambda v: v["min_tokens"] >= 0,
        "min_tokens must be greater than or equal to 0, got {min_tokens}.",
    ),
    _Range(
        "min_tokens",
        lambda v: v["min_tokens"] <= v["max_tokens"],
        "min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
    ),
    _Range("stop", lambda v: all(v["stop"]), "stop cannot contain an empty string."),
    _Range(  # after _verify_args; a temperature under 0.01 was raised to it, so only 0 is
        "n",  # greedy
        lambda v: v["temperature"] != 0.0 or v["n"] == 1,
        "n must be 1 when using greedy sampling, got {n}.",
    ),
)

# What a field left out (or null) samples with: vLLM's defaults.
_SAMPLING_DEFAULTS = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "min_tokens": 0,
    "stop": [],
}


def check_sampling(fields: dict[str, Any], max_tokens: int) -> None:
    """``SamplingParams._verify_args``, the first check that fails, with the output
    budget as its ``max_tokens``."""
    values = {
        name: default if fields[name] is None else fields[name]
        for name, default in _SAMPLING_DEFAULTS.items()
    }
    values["max_tokens"] = max_tokens
    for check in _SAMPLING_CHECKS:
        if not check.holds(values):
            message = check.says.format(**values)
            if check.named:
                raise refused(message, check.name, values[check.name])
            raise refused(message)
