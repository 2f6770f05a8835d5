"""A closed-loop load driver on the virtual clock.

``concurrency`` clients start together at t = 0 and each replaces its
finished request at the same instant, until ``n_requests`` were sent -- how
``vllm bench serve --max-concurrency C --num-prompts N`` and the field report
load a server. Throughput is output tokens over the whole run, start-up
burst and drain included, as that tool reports it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from backends.sim.base import FinishReason, GenerationRequest, TokenEvent
from backends.sim.profiles import Profile
from backends.sim.virtual import VirtualEngine


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    prompt_tokens: int
    sent: float
    ttft: float = -1.0  # seconds from sent to the first token
    e2e: float = -1.0  # seconds from sent to the last token
    output_tokens: int = 0
    finish_reason: FinishReason | None = None
    itls: list[float] = field(default_factory=list)  # only with keep_itls

    @property
    def mean_itl(self) -> float:
        if self.output_tokens < 2:
            return 0.0
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class _Client:
    """One closed-loop client: listens to its request, sends the next when done."""

    __slots__ = ("_last", "_loop", "_record")

    def __init__(self, loop: _Loop) -> None:
        self._loop = loop
        self._record: RequestRecord | None = None
        self._last = 0.0

    def send(self) -> None:
        self._record = self._loop.submit(self)

    def on_token(self, now: float, event: TokenEvent) -> None:
        rec = self._record
        assert rec is not None
        rec.output_tokens += 1
        if event.index == 0:
            rec.ttft = now - rec.sent
        elif self._loop.keep_itls:
            rec.itls.append(now - self._last)
        self._last = now
        if event.finish_reason is not None:
            rec.e2e = now - rec.sent
            rec.finish_reason = event.finish_reason
            if self._loop.remaining > 0:
                self.send()


class _Loop:
    def __init__(
        self,
        engine: VirtualEngine,
        prompt_tokens: int,
        output_tokens: int,
        n_requests: int,
        seed: int,
        ignore_eos: bool,
        output_spread: float,
        keep_itls: bool,
    ) -> None:
        self.engine = engine
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.remaining = n_requests
        self.ignore_eos = ignore_eos
        self.spread = output_spread
        self.keep_itls = keep_itls
        self.rng = random.Random(seed)
        self.records: list[RequestRecord] = []

    def submit(self, client: _Client) -> RequestRecord:
        i = len(self.records)
        out = self.output_tokens
        if self.spread:
            lo, hi = round(out * (1 - self.spread)), round(out * (1 + self.spread))
            out = self.rng.randint(max(1, lo), hi)
        rec = RequestRecord(f"req-{i}", self.prompt_tokens, self.engine.now)
        self.records.append(rec)
        self.remaining -= 1
        request = GenerationRequest(
            request_id=rec.request_id,
            prompt_tokens=self.prompt_tokens,
            max_tokens=out,
            ignore_eos=self.ignore_eos,
            seed=i,
        )
        self.engine.submit(request, client)
        return rec


def run_closed_loop(
    profile: Profile,
    concurrency: int,
    prompt_tokens: int,
    output_tokens: int,
    n_requests: int,
    seed: int = 0,
    ignore_eos: bool = True,
    *,
    output_spread: float = 0.0,
    keep_itls: bool = False,
) -> list[RequestRecord]:
    """Run the workload to completion; one record per request, in send order.

    ``output_spread`` draws each request's max_tokens uniformly within
    ``output_tokens * (1 +- spread)``; ``keep_itls`` keeps every gap (memory!).
    """
    engine = VirtualEngine(profile, seed=seed)
    loop = _Loop(
        engine, prompt_tokens, output_tokens, n_requests, seed, ignore_eos, output_spread, keep_itls
    )
    for _ in range(min(concurrency, n_requests)):
        _Client(loop).send()
    engine.run_until_idle()
    return loop.records


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in 0..100."""
    if not values:
        raise ValueError("percentile of nothing")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def output_throughput(records: list[RequestRecord]) -> float:
    """Output tokens per second from the first send to the last token."""
    start = min(r.sent for r in records)
    end = max(r.sent + r.e2e for r in records)
    return sum(r.output_tokens for r in records) / (end - start)
