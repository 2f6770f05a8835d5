"""Client populations for a :class:`~backends.sim.system.sim.SystemSim`.

* :class:`ClosedLoop`: C clients; each sends its next request the moment the
  previous one is answered (after ``retry_delay_s`` when it was shed, as a
  client honouring Retry-After would), until ``stop``.
* :class:`Poisson`: open loop, arrivals at ``rate`` per second, whatever
  happens to them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from backends.sim.system.model import SHED, SimRequest
from backends.sim.system.sim import SystemSim


@dataclass(frozen=True, slots=True)
class Shape:
    """What every request of a population asks for."""

    prompt_tokens: int
    output_tokens: int


class ClosedLoop:
    def __init__(
        self,
        sim: SystemSim,
        clients: int,
        shape: Shape,
        *,
        start: float = 0.0,
        stop: float = float("inf"),
        retry_delay_s: float = 1.0,
        start_spread_s: float = 0.0,
        seed: int = 0,
    ) -> None:
        self._sim = sim
        self._shape = shape
        self._stop = stop
        self._retry = retry_delay_s
        rng = random.Random(seed)
        for _ in range(clients):
            sim.at(start + rng.uniform(0.0, start_spread_s), self._send)

    def _send(self) -> None:
        sim = self._sim
        if sim.now < self._stop:
            sim.submit(self._shape.prompt_tokens, self._shape.output_tokens, on_done=self._done)

    def _done(self, request: SimRequest) -> None:
        if request.status in SHED:
            self._sim.at(self._sim.now + self._retry, self._send)
        else:
            self._send()


class Poisson:
    def __init__(
        self,
        sim: SystemSim,
        rate: float,
        shape: Shape,
        *,
        start: float = 0.0,
        stop: float = float("inf"),
        seed: int = 0,
    ) -> None:
        self._sim = sim
        self._rate = rate
        self._shape = shape
        self._stop = stop
        self._rng = random.Random(seed)
        sim.at(start + self._rng.expovariate(rate), self._arrive)

    def _arrive(self) -> None:
        sim = self._sim
        if sim.now >= self._stop:
            return
        sim.submit(self._shape.prompt_tokens, self._shape.output_tokens)
        sim.at(sim.now + self._rng.expovariate(self._rate), self._arrive)
