"""The engine on a virtual clock: discrete events, no sockets, deterministic.

A driver interleaves its own events with the engine's: ``next_time()`` says
when the step in progress ends, ``advance()`` completes it (listeners are
called with that time), ``advance_to(t)`` lets time pass up to ``t``.
Requests submitted mid-step join at the next step boundary, as in vLLM.
Listeners may submit or cancel from inside ``on_token`` (a closed-loop client
replaces a finished request at the same instant).
"""

from __future__ import annotations

from typing import Protocol

from backends.sim.base import EngineStats, GenerationRequest, TokenEvent
from backends.sim.profiles import Profile
from backends.sim.scheduler import Scheduler


class RequestListener(Protocol):
    def on_token(self, now: float, event: TokenEvent) -> None:
        """First call is the first token (TTFT); the last carries finish_reason."""
        ...


class VirtualEngine:
    def __init__(self, profile: Profile, *, seed: int = 0) -> None:
        self.profile = profile
        self._scheduler = Scheduler(profile.scheduler_config(), profile.cost, seed=seed)
        self._now = 0.0
        self._step_end: float | None = None
        self._in_step = False  # True while a step's tokens are being handed out
        self.steps = 0

    @property
    def now(self) -> float:
        return self._now

    def submit(self, request: GenerationRequest, listener: RequestListener) -> None:
        """Queue ``request`` arriving at ``now``; ValueError if it can never run."""
        limit = self.profile.model.max_context
        if request.prompt_tokens + request.max_tokens > limit:
            raise ValueError(
                f"prompt ({request.prompt_tokens}) + max_tokens ({request.max_tokens}) "
                f"exceeds the model's context length {limit}"
            )
        self._scheduler.add(request, listener.on_token)
        if self._step_end is None and not self._in_step:
            self._start_step()

    def cancel(self, request_id: str) -> None:
        self._scheduler.cancel(request_id)

    def next_time(self) -> float | None:
        return self._step_end

    def advance(self) -> None:
        end = self._step_end
        if end is None:
            raise RuntimeError("advance() on an idle engine")
        self._now = end
        self._step_end = None
        self._in_step = True
        try:
            self._scheduler.commit(end)
        finally:
            self._in_step = False
        self.steps += 1
        self._start_step()

    def advance_to(self, t: float) -> None:
        while self._step_end is not None and self._step_end <= t:
            self.advance()
        if t > self._now:
            self._now = t

    def run_until_idle(self) -> None:
        while self._step_end is not None:
            self.advance()

    def stats(self) -> EngineStats:
        return self._scheduler.stats()

    def _start_step(self) -> None:
        if not self._scheduler.has_work():
            return
        duration = self._scheduler.schedule()
        if duration is None:
            raise RuntimeError("scheduler has work but nothing can run")
        self._step_end = self._now + duration
