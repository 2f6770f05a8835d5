"""The simplest engine: every request gets the same TTFT and ITL, independently.

No batching and no contention — useful for testing the gateway's relay and
timing (known latencies in, measured latencies out) and for the relay benchmark
(``itl_ms=0`` is a zero-latency backend). The calibrated continuous-batching
engine lives beside it behind the same :class:`~backends.sim.base.AsyncEngine`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio

from backends.sim.base import EngineFlavor, EngineStats, GenerationRequest, TokenEvent
from backends.sim.exposition import EngineCounters, render_engine_metrics


class FixedLatencyEngine:
    def __init__(
        self, *, ttft_s: float, itl_s: float, flavor: EngineFlavor = "vllm", model: str = "sim"
    ) -> None:
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.flavor = flavor
        self.model = model
        self.counters = EngineCounters()

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        counters = self.counters
        counters.running += 1
        counters.prompt_tokens_total += request.prompt_tokens
        finished = False
        try:
            if self.ttft_s:
                await anyio.sleep(self.ttft_s)
            last = request.max_tokens - 1
            for index in range(request.max_tokens):
                if index and self.itl_s:
                    await anyio.sleep(self.itl_s)
                counters.generation_tokens_total += 1
                yield TokenEvent(index, "length" if index == last else None)
            finished = True
        finally:
            counters.running -= 1
            if not finished:
                counters.cancelled_total += 1

    def stats(self) -> EngineStats:
        c = self.counters
        return EngineStats(
            running=c.running,
            waiting=0,
            kv_usage=0.0,
            preemptions_total=0,
            prompt_tokens_total=c.prompt_tokens_total,
            generation_tokens_total=c.generation_tokens_total,
        )

    def render_metrics(self) -> bytes:
        return render_engine_metrics(
            self.flavor, self.model, self.stats(), self.counters.cancelled_total
        )
