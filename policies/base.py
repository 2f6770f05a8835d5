"""The vocabulary shared by every limit controller.

A limit controller turns windowed observations of one backend into that
backend's concurrency limit. It is pure arithmetic: synchronous, no clock of
its own (time arrives inside each :class:`Sample`), no I/O. Enforcing the limit
(permits, queueing, rejections) is :mod:`policies.admission`'s business.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


@dataclass(frozen=True, slots=True)
class Sample:
    """One windowed observation of one backend, as the gateway measured it."""

    now: float  # monotonic seconds when the window closed
    # p95 over the window, seconds; None when the window holds too few requests.
    # TTFT must exclude the gateway's own queue wait: the controller judges the
    # backend, and queue wait grows with demand, not with the limit.
    ttft_p95: float | None
    itl_p95: float | None
    output_tokens_per_s: float
    in_flight: int  # permits held on this backend when the window closed
    completed: int  # requests finished within the window
    engine_waiting: int | None  # the engine's own num_requests_waiting, if scraped
    demand: int  # requests queued for this backend's pool (unmet demand)
    # The engine's KV cache in use, 0..1 (vLLM kv_cache_usage_perc, SGLang
    # token_usage), if scraped: what the running streams hold, whatever their age.
    engine_kv_usage: float | None = None
    # ttft_p95 is only a lower bound: more streams ended before their first token than
    # the window's observed TTFTs could place (see gateway.window).
    ttft_p95_bound: bool = False


class LimitController(Protocol):
    """Feed a sample, read the limit."""

    @property
    def limit(self) -> int: ...

    def update(self, sample: Sample) -> int:
        """Digest one sample and return the (possibly new) limit."""
        ...


class LimitBounds(BaseModel):
    """The knobs every controller has: where it starts and the range it keeps to."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    initial: int = Field(default=8, ge=1)
    min: int = Field(default=1, ge=1)
    max: int = Field(default=256, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _no_yes_or_no_for_a_number(cls, data: Any) -> Any:
        # `initial: true` held the backend at one request, `max_step: false` froze the limit.
        return refuse_yes_or_no_for_numbers(cls, data)

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if not self.min <= self.initial <= self.max:
            raise ValueError(
                f"need min <= initial <= max, got {self.min} <= {self.initial} <= {self.max}"
            )
        return self

    def clamp(self, value: float) -> int:
        """``value`` rounded down and kept within [min, max]."""
        return max(self.min, min(self.max, int(value)))


def refuse_yes_or_no_for_numbers(model: type[BaseModel], data: Any) -> Any:
    """A ``mode="before"`` check for config models: pydantic reads ``true``/``false`` as
    1/0 where a number is due, and a YAML slip then configures a number nobody chose."""
    if isinstance(data, dict):
        for name, value in data.items():
            if isinstance(value, bool) and name in _numeric_fields(model):
                raise ValueError(f"`{name}` must be a number, got {str(value).lower()}")
    return data


@functools.cache
def _numeric_fields(model: type[BaseModel]) -> frozenset[str]:
    numbers = (int, float, int | None, float | None)
    return frozenset(name for name, f in model.model_fields.items() if f.annotation in numbers)
