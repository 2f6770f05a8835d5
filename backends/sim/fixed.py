"""The simplest engine: every request gets the same TTFT and ITL, independently.

No batching and no contention — useful for testing the gateway's relay and
timing (known latencies in, measured latencies out) and for the relay benchmark
(``itl_ms=0`` is a zero-latency backend). The calibrated continuous-batching
engine lives beside it behind the same :class:`~backends.sim.base.AsyncEngine`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import anyio

from backends.sim.base import EngineFlavor, EngineStats, GenerationRequest, TokenEvent
from backends.sim.engine_metrics import EngineTimings, render_metrics

MAX_MODEL_LEN = 40960


@dataclass(slots=True)
class _Counters:
    running: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cancelled_total: int = 0


class FixedLatencyEngine:
    max_model_len = MAX_MODEL_LEN

    def __init__(
        self,
        *,
        ttft_s: float,
        itl_s: float,
        flavor: EngineFlavor = "vllm",
        model: str = "sim",
        speed: float = 1.0,
    ) -> None:
        self.ttft_s = ttft_s  # wall time, the speed-up applied
        self.itl_s = itl_s
        # The latency histograms are in engine seconds, as a profile engine's are: wall
        # times the speed-up (at --speed 10 they read a tenth of the configured figures).
        self.speed = speed
        self.flavor = flavor
        self.model = model
        self._counters = _Counters()
        self._timings = EngineTimings(flavor)

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def generate(
        self, request: GenerationRequest, arrival: float | None = None
    ) -> AsyncGenerator[TokenEvent, None]:
        counters = self._counters
        counters.running += 1
        counters.prompt_tokens_total += request.prompt_tokens
        arrival = last = time.monotonic() if arrival is None else arrival
        finished = False
        try:
            if self.ttft_s:  # counted from the arrival, as a real engine's clock would
                await _sleep_until(arrival + self.ttft_s)
            final = request.max_tokens - 1
            for index in range(request.max_tokens):
                if index and self.itl_s:
                    await anyio.sleep(self.itl_s)
                now = time.monotonic()
                (self._timings.itl if index else self._timings.ttft).observe(
                    (now - (last if index else arrival)) * self.speed
                )
                last = now
                counters.generation_tokens_total += 1
                yield TokenEvent(index, "length" if index == final else None)
            self._timings.e2e.observe((time.monotonic() - arrival) * self.speed)
            finished = True
        finally:
            counters.running -= 1
            if not finished:
                counters.cancelled_total += 1

    def stats(self) -> EngineStats:
        c = self._counters
        return EngineStats(
            running=c.running,
            waiting=0,
            kv_usage=0.0,
            preemptions_total=0,
            prompt_tokens_total=c.prompt_tokens_total,
            generation_tokens_total=c.generation_tokens_total,
            cancelled_total=c.cancelled_total,
        )

    def render_metrics(self) -> bytes:
        return render_metrics(self.flavor, self.model, self.stats(), self._timings)


async def _sleep_until(due: float) -> None:
    """Not a moment before ``due`` (monotonic): uvloop's timers count whole milliseconds
    from a loop time cached at the iteration's start, so one sleep may end up to a
    millisecond early, and a configured 5 ms TTFT read 4.9 at the client."""
    while (left := due - time.monotonic()) > 0:  # noqa: ASYNC110  (a deadline, no event)
        await anyio.sleep(left)
