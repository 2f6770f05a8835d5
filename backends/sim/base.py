"""The contract between the simulated engine and everything that drives it.

Two kinds of driver use an engine:

* the HTTP face (``backends.sim.server``) on a real clock, through
  :class:`AsyncEngine`: one async iterator of :class:`TokenEvent` per request;
  closing the iterator early (client went away) frees the sequence;
* the benchmark and whole-system simulations on a virtual clock, through the
  discrete-event API of the engine core (``backends.sim.virtual``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol

FinishReason = Literal["stop", "length"]
EngineFlavor = Literal["vllm", "sglang"]


# The simulator's speed-up: delays are divided by it and engine time multiplied. Under a
# thousandth of real time a 15 ms ITL is 15 s (divided by 1e-310, a 50 ms TTFT overflows
# to infinity: every request slept forever); over a thousand times, each 0.1 ms the
# gateway and the HTTP face spend on a request is 0.1 s of engine time or more.
MIN_SPEED = 0.001
MAX_SPEED = 1000.0
# A fixed TTFT or ITL: no engine takes an hour per token; 1e308 ms slept forever, or
# overflowed the clock.
MAX_DELAY_MS = 3_600_000.0
# The fixed-latency engine's, when none is given (`kneecap sim`, `sim:` without a profile).
DEFAULT_TTFT_MS = 50.0
DEFAULT_ITL_MS = 15.0


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    ignore_eos: bool = False
    # Seeds the pseudo-random EOS draw so that a request replays identically.
    seed: int = 0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    index: int  # 0-based position of this output token
    finish_reason: FinishReason | None  # set on the last token only


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int
    waiting: int
    kv_usage: float  # 0..1 of the KV cache in use
    preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    cancelled_total: int = 0  # sequences dropped because their client went away


class TokenIterator(Protocol):
    def __aiter__(self) -> AsyncIterator[TokenEvent]: ...

    async def __anext__(self) -> TokenEvent: ...

    async def aclose(self) -> None:
        """Stop early: the sequence is cancelled and its KV freed."""
        ...


class AsyncEngine(Protocol):
    """What the HTTP face needs from an engine running on a real clock."""

    flavor: EngineFlavor
    max_model_len: int

    def generate(self, request: GenerationRequest, arrival: float | None = None) -> TokenIterator:
        """Start ``request``, which arrived at ``arrival`` (``time.monotonic``; None: now)."""
        ...

    def stats(self) -> EngineStats: ...

    def render_metrics(self) -> bytes:
        """Prometheus text exposition under the real engine's metric names."""
        ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...
