"""Envoy's adaptive-concurrency gradient controller, on windowed p95 TTFT.

A reference baseline for ``knee``. The algorithm, as Envoy documents it, with
TTFT p95 standing in for the request round-trip time::

    gradient  = clamp(min_rtt * (1 + buffer) / sample_rtt, 0.5, 2.0)
    new_limit = clamp(limit * gradient + sqrt(limit * gradient), min, max)

``min_rtt`` is the TTFT p95 measured while the limit is pinned to ``min`` (Envoy's
``min_concurrency``). A new controller starts in such a measurement window, holds
it for ``min_rtt_window_s`` (so that the gateway's sliding window describes the
low concurrency only), then returns to the limit it had before. It re-measures
every ``min_rtt_interval_s``, and early when the limit has sat at ``min`` for
five consecutive updates (a sign of a bad min_rtt), as Envoy does. Envoy
jitters the interval randomly; this controller is deterministic instead. One that
takes over a running backend on reload (``carried``) starts at the limit carried
instead, and measures ``min_rtt_interval_s`` after its first sample.

The gateway's windows slide, so consecutive samples share most of their
requests; the limit is recomputed at most once per ``update_interval_s`` so
that each recomputation sees mostly fresh requests (Envoy clears its histogram
after each update for the same reason).

Defaults follow Envoy: buffer 25 %, min_rtt re-measured every 60 s, min 3. On
LLM engines TTFT rises well before the knee (prefills contend from the first
added request), so this controller settles low; that is the point of the
comparison.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from policies.base import LimitBounds, Sample

_GRADIENT_MIN = 0.5
_GRADIENT_MAX = 2.0
_REMEASURE_AFTER_UPDATES_AT_MIN = 5


class GradientLimitConfig(LimitBounds):
    kind: Literal["gradient"] = "gradient"
    min: int = Field(default=3, ge=1)
    buffer: float = Field(default=0.25, ge=0)
    min_rtt_interval_s: float = Field(default=60.0, gt=0)
    min_rtt_window_s: float = Field(default=10.0, ge=0)
    update_interval_s: float = Field(default=5.0, ge=0)


class GradientLimit:
    def __init__(
        self,
        config: GradientLimitConfig,
        start: int | None = None,
        min_rtt: float | None = None,
        *,
        carried: bool = False,
    ) -> None:
        self._config = config
        self._limit = config.clamp(config.initial if start is None else start)
        # A reload hands over the limit and the min_rtt measured, if any: the backend has
        # not changed, and a window now would pin the limit at min until enough traffic
        # measured it again (with no traffic, for good). Without a min_rtt the carried
        # limit holds until the window the first sample schedules.
        self.min_rtt = min_rtt
        self.gradient = 1.0
        self._deferred: int | None = None  # limit to restore after a min_rtt window
        self._window_started: float | None = None  # set on the first sample inside it
        self._next_min_rtt = float("inf")
        self._next_update = float("-inf")
        self._updates_at_min = 0
        self._carried = carried or min_rtt is not None  # re-measure counts from 1st sample
        if not self._carried:
            self._enter_min_rtt_window()  # as Envoy: no limit is trusted before min_rtt is known

    @property
    def settled_limit(self) -> int:
        """The limit outside a min_rtt window (inside one the limit is pinned at min)."""
        return self._limit if self._deferred is None else self._deferred

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def measuring_min_rtt(self) -> bool:
        return self._deferred is not None

    def update(self, sample: Sample) -> int:
        now = sample.now
        if self._carried:
            self._carried = False
            self._next_min_rtt = now + self._config.min_rtt_interval_s
        if self._deferred is None and now >= self._next_min_rtt:
            self._enter_min_rtt_window()
        if self._deferred is not None:
            self._measure_min_rtt(sample)
            return self._limit
        if now < self._next_update or sample.ttft_p95 is None or self.min_rtt is None:
            return self._limit
        self._next_update = now + self._config.update_interval_s
        self._apply_gradient(sample.ttft_p95)
        if self._limit == self._config.min:
            self._updates_at_min += 1
            if self._updates_at_min >= _REMEASURE_AFTER_UPDATES_AT_MIN:
                self._next_min_rtt = now  # from the next sample on
        else:
            self._updates_at_min = 0
        return self._limit

    def _enter_min_rtt_window(self) -> None:
        self._deferred = self._limit
        self._window_started = None
        self._limit = self._config.min

    def _measure_min_rtt(self, sample: Sample) -> None:
        if self._window_started is None:
            self._window_started = sample.now
        if sample.now - self._window_started < self._config.min_rtt_window_s:
            return
        # A p95 that is only a lower bound (streams gave up before their first token) is
        # no measured latency: it must not become the baseline every later sample is
        # judged against.
        measured = None if sample.ttft_p95_bound else sample.ttft_p95
        if measured is None and self.min_rtt is None:
            return  # nothing measured yet and nothing to fall back on: keep measuring
        if measured is not None:
            self.min_rtt = measured
        assert self._deferred is not None
        self._limit = self._deferred
        self._deferred = None
        self._updates_at_min = 0
        self._next_min_rtt = sample.now + self._config.min_rtt_interval_s
        self._next_update = sample.now + self._config.update_interval_s

    def _apply_gradient(self, sample_rtt: float) -> None:
        assert self.min_rtt is not None
        buffered = self.min_rtt * (1 + self._config.buffer)
        raw = buffered / sample_rtt if sample_rtt > 0 else _GRADIENT_MAX
        self.gradient = max(_GRADIENT_MIN, min(_GRADIENT_MAX, raw))
        scaled = self._limit * self.gradient
        self._limit = self._config.clamp(scaled + math.sqrt(scaled))
