"""A fixed concurrency limit: from config, or from ``kneecap bench --emit-policy``.

The limit is ``initial`` (kept within [min, max]) and never moves. On reload a
static controller takes the new configured value rather than carrying the old
one over: a static limit means "exactly what the config says".
"""

from __future__ import annotations

from typing import Literal

from policies.base import LimitBounds, Sample


class StaticLimitConfig(LimitBounds):
    kind: Literal["static"] = "static"
    initial: int = 32


class StaticLimit:
    def __init__(self, config: StaticLimitConfig, start: int | None = None) -> None:
        # ``start`` (a carried-over limit) is deliberately ignored; see the module doc.
        del start
        self._limit = config.clamp(config.initial)

    @property
    def limit(self) -> int:
        return self._limit

    def update(self, sample: Sample) -> int:
        del sample
        return self._limit
