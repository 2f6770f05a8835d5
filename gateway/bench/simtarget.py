"""``--sim PROFILE``: the same sweep on the simulator's virtual clock, no sockets.

Each load point runs on a fresh engine, as if against an idle server. The
engine calls back once per output token; replacements for finished requests
(closed loop) are submitted between steps, never from inside a callback.
A closed loop's clients send their first requests at :func:`client_starts`.
"""

from __future__ import annotations

import importlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio.lowlevel

from backends.sim.base import GenerationRequest, TokenEvent
from gateway.bench.client import TargetError
from gateway.bench.phase import LoadPoint, Phase, Ticket, arrival_gaps, client_starts
from gateway.bench.stats import RequestRecord
from gateway.bench.target import Progress
from gateway.bench.workload import RequestSpec, Workload

# A point runs thousands of engine steps without awaiting anything; a checkpoint now and
# then lets Ctrl-C (a cancellation) stop it, at ~10 µs each.
_STEPS_PER_CHECKPOINT = 1000


@dataclass(slots=True)
class _Listener:
    """Times one request in virtual seconds; collects itself when finished."""

    ticket: Ticket
    spec: RequestSpec
    arrived: float
    phase: Phase
    finished: list[_Listener]
    first: float | None = None
    last: float = 0.0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)

    def on_token(self, now: float, event: TokenEvent) -> None:
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now
        self.tokens += 1
        self.phase.delivered(1)
        if event.finish_reason is not None:
            self.finished.append(self)

    def record(self) -> RequestRecord:
        assert self.first is not None
        return RequestRecord(
            prompt_tokens=self.spec.prompt_tokens,
            output_tokens=self.tokens,
            ttft=self.first - self.arrived,
            e2e=self.last - self.arrived,
            itls=self.gaps,
            prompt_class=self.spec.prompt_class,
        )


class Engine(Protocol):
    """The discrete-event API of ``backends.sim.virtual.VirtualEngine``."""

    @property
    def now(self) -> float: ...

    def submit(self, request: GenerationRequest, listener: Any) -> None: ...

    def next_time(self) -> float | None: ...

    def advance(self) -> None: ...

    def advance_to(self, t: float) -> None: ...


class SimTarget:
    def __init__(self, label: str, engine_for_seed: Callable[[int], Engine]) -> None:
        self.label = label
        self._engine_for_seed = engine_for_seed

    @classmethod
    def for_profile(cls, profile_name: str) -> SimTarget:
        try:
            virtual = importlib.import_module("backends.sim.virtual")
            profiles = importlib.import_module("backends.sim.profiles")
        except ImportError:
            raise TargetError(
                "the simulator's virtual-clock engine (backends.sim.virtual) is not installed"
            ) from None
        try:
            profile = profiles.get_profile(profile_name)
        except LookupError as exc:  # its message lists the valid names
            raise TargetError(exc.args[0] if exc.args else str(exc)) from None
        return cls(f"sim:{profile_name}", lambda seed: virtual.VirtualEngine(profile, seed=seed))

    async def prepare(self, workloads: Sequence[Workload]) -> list[str]:
        return [f"{self.label} on a virtual clock"]

    async def aclose(self) -> None:
        return None

    async def run_point(self, point: LoadPoint, workload: Workload, progress: Progress) -> Phase:
        engine = self._engine_for_seed(point.seed)  # the same per point for A and B
        phase = Phase(point)
        finished: list[_Listener] = []

        def submit(opening: bool = False) -> None:
            ticket = phase.issue(engine.now, opening=opening)
            spec = workload.spec(ticket.index)
            request = GenerationRequest(
                request_id=str(ticket.index),
                prompt_tokens=spec.prompt_tokens,
                max_tokens=spec.max_tokens,
                ignore_eos=True,
                seed=spec.seed,
            )
            try:
                engine.submit(request, _Listener(ticket, spec, engine.now, phase, finished))
            except ValueError as exc:  # e.g. longer than the model's context: none would run
                raise TargetError(f"{self.label}: {exc}") from None

        arrivals = arrival_gaps(point) if point.kind == "rate" else None
        starts = deque(engine.now + t for t in client_starts(point))
        due = engine.now
        while starts and starts[0] <= engine.now:  # no stagger: every client at once
            starts.popleft()
            submit(opening=True)
        steps = 0
        while not phase.done:
            steps += 1
            if steps % _STEPS_PER_CHECKPOINT == 0:
                await anyio.lowlevel.checkpoint()  # Ctrl-C (a cancellation) lands here
            step_end = engine.next_time()
            if starts and (step_end is None or starts[0] <= step_end):
                engine.advance_to(starts[0])
                arrive = True
            elif arrivals is not None and (step_end is None or due <= step_end):
                engine.advance_to(due)
                arrive = True
            elif step_end is None:
                raise TargetError(f"{self.label}: the engine went idle with requests outstanding")
            else:
                engine.advance()
                arrive = False
            while finished:
                listener = finished.pop()
                phase.finish(listener.ticket, listener.record(), engine.now)
                progress.tick(phase, engine.now)
                if arrivals is None and not phase.done:
                    submit()
            if arrive and starts and not phase.done:
                starts.popleft()
                submit(opening=True)
            elif arrive and arrivals is not None and not phase.done:
                submit()
                due += next(arrivals)
        return phase
