"""What a whole-system simulation is made of: requests, backends, pools, seams.

The seams are two small callables, so that routing policies (pools by prompt
length, token-budget admission, a round-robin baseline) plug in without
touching the event loop:

* :data:`Admits` -- ``admits(backend, request) -> bool``: may this backend take
  this request now? The default is the request limit alone, ``in_flight <
  limit``; :func:`within_token_budget` adds the gateway's default token budget.
* :data:`Router` -- ``router(request, candidates) -> backend | None``: choose
  among the healthy backends of the request's pool that admit it; None queues
  the request. The default is the gateway's least-loaded pick.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from backends.replica import Replica
from backends.sim.base import GenerationRequest, TokenEvent
from backends.sim.profiles import Profile
from backends.sim.virtual import VirtualEngine
from gateway.settings import TokenBudgetConfig
from gateway.window import RollingWindow
from policies.priority_queue import Priority
from policies.routing import Load
from policies.token_budget import token_budget

Status = Literal["ok", "queue_full", "queue_timeout", "no_backend", "failed", "cancelled"]
SHED: frozenset[Status] = frozenset({"queue_full", "queue_timeout", "no_backend"})
_KV_FRACTION = TokenBudgetConfig().kv_fraction  # routing.token_budget's default


@dataclass(slots=True, eq=False)
class SimRequest:
    """One client request, from arrival to its one outcome."""

    id: int
    prompt_tokens: int
    max_tokens: int
    arrived: float
    deadline: float  # of its queue wait (absolute)
    priority: Priority = Priority.INTERACTIVE
    pool: str = ""
    on_done: Callable[[SimRequest], None] | None = None  # the client's callback
    backend: SimBackend | None = None
    admitted: float | None = None
    first_token: float | None = None
    last_token: float = 0.0
    finished: float | None = None  # answered: last token, error, or shed
    output_tokens: int = 0
    status: Status | None = None
    good: bool = False  # first token within the SLO, counted from admission
    # The live feed of the backend's window, as gateway.meter.StreamMeter does it.
    gaps: list[float] = field(default_factory=list)
    flushed_tokens: int = 0
    last_flush: float = 0.0

    @property
    def queue_wait(self) -> float | None:
        return None if self.admitted is None else self.admitted - self.arrived

    @property
    def ttft(self) -> float | None:
        """Seconds from admission to the first token: the backend's share."""
        if self.first_token is None or self.admitted is None:
            return None
        return self.first_token - self.admitted

    def generation(self, seed: int) -> GenerationRequest:
        return GenerationRequest(
            request_id=f"r{self.id}",
            prompt_tokens=self.prompt_tokens,
            max_tokens=self.max_tokens,
            ignore_eos=True,
            seed=seed + self.id,
        )


@dataclass(slots=True, eq=False)
class SimBackend:
    """A gateway replica (in flight, limit, window) in front of a virtual engine."""

    replica: Replica
    engine: VirtualEngine
    tokens_in_flight: int = 0  # prompt + max_tokens of the requests it holds
    running: dict[int, SimRequest] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.replica.name

    @property
    def pool(self) -> str:
        return self.replica.pool

    @property
    def window(self) -> RollingWindow:
        return self.replica.window

    @property
    def profile(self) -> Profile:
        return self.engine.profile


class TokenListener:
    """Hands one request's engine tokens to the simulation (kept tiny: hot path)."""

    __slots__ = ("on_token",)

    def __init__(self, on_token: Callable[[float, TokenEvent], None]) -> None:
        self.on_token = on_token


Admits = Callable[[SimBackend, SimRequest], bool]
Router = Callable[[SimRequest, Sequence[SimBackend]], SimBackend | None]
PoolOf = Callable[[SimRequest], str]


def within_limit(backend: SimBackend, request: SimRequest) -> bool:
    """The gateway's admission rule: a permit is free on this backend."""
    del request
    return backend.replica.in_flight < backend.replica.limit


def within_token_budget(backend: SimBackend, request: SimRequest) -> bool:
    """The gateway's default admission: a permit, and room in the backend's token budget
    (prompt + max output tokens in flight <= ``routing.token_budget.kv_fraction`` of the
    KV cache; a backend with nothing in flight always has room), as Load.fits decides."""
    budget = token_budget(
        configured=None,
        kv_capacity=backend.profile.kv_tokens,
        kv_fraction=_KV_FRACTION,
        default=None,
    )
    load = Load(
        name=backend.name,
        in_flight=backend.replica.in_flight,
        limit=backend.replica.limit,
        tokens_in_flight=backend.tokens_in_flight,
        token_limit=budget,
    )
    return load.fits(request.prompt_tokens + request.max_tokens)


def always(backend: SimBackend, request: SimRequest) -> bool:
    """No admission control: every request goes straight to an engine."""
    del backend, request
    return True


def least_loaded(request: SimRequest, candidates: Sequence[SimBackend]) -> SimBackend | None:
    """The gateway's pick (policies.least_loaded): fewest in flight relative to the limit."""
    del request
    best: SimBackend | None = None
    for backend in candidates:
        r = backend.replica
        if best is None or r.in_flight / r.limit < best.replica.in_flight / best.replica.limit:
            best = backend
    return best


class RoundRobin:
    """Each request to the next candidate in turn, whatever their load."""

    def __init__(self) -> None:
        self._turn = 0

    def __call__(self, request: SimRequest, candidates: Sequence[SimBackend]) -> SimBackend | None:
        del request
        if not candidates:
            return None
        self._turn += 1
        return candidates[self._turn % len(candidates)]


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A pool's queue: bounded depth, default deadline, batch share (as PoolConfig)."""

    max_queue_depth: int = 256
    max_queue_wait_s: float = 30.0
    batch_share: float = 0.1
