"""The vocabulary shared by every routing policy: a backend's load, a request, a router.

A router chooses, among the backends of one pool, the one a request is
admitted to. It is pure: it reads :class:`Load` values (built by the gateway
from its live replicas, or by a whole-system simulation from its simulated
engines), returns one of them or None, and keeps at most its own small state
(a round-robin cursor, a random generator injected for determinism).

Admission is not the router's business beyond :meth:`Load.fits`: a backend
fits a request while it has a request permit free *and* room for the request's
tokens (prompt + max output) within its token budget. A backend with nothing
in flight always has room for tokens, so a request larger than every budget
still runs, alone. A request's tokens on a backend are at most its sequences times the
backend's context length (:attr:`Load.cost_cap`): an engine stops each sequence there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True)  # not frozen: built per request, where frozen's __init__ costs 4x
class Load:
    """What a router may know of one backend at the moment of choice."""

    name: str
    in_flight: int  # requests admitted and not finished
    limit: int  # the concurrency limit (from the limit controller)
    tokens_in_flight: int = 0  # their prompt + max output tokens
    token_limit: int | None = None  # the token budget; None: not limited in tokens
    waiting: float | None = None  # the engine's own queue, when freshly scraped
    kv_usage: float | None = None  # 0..1 of the engine's KV cache, when freshly scraped
    # The most tokens the request being placed can hold here: each of its sequences stops
    # at the backend's context length. None: no bound (the context length is unknown).
    cost_cap: int | None = None

    def cost_of(self, cost: int) -> int:
        """The request's tokens on this backend: ``cost``, at most :attr:`cost_cap`."""
        return cost if self.cost_cap is None or cost <= self.cost_cap else self.cost_cap

    def fits(self, cost: int) -> bool:
        """Both a request permit and ``cost`` tokens (at most the cap) are free."""
        if self.in_flight >= self.limit:
            return False
        if self.token_limit is None or self.tokens_in_flight == 0:
            return True
        return self.tokens_in_flight + self.cost_of(cost) <= self.token_limit

    def pressure(self, cost: int, requests: int = 1) -> float:
        """How full the backend would be with the request on it: 1.0 is at a limit.

        The fullest of requests/limit, tokens/budget and the engine's KV usage,
        plus the engine's own waiting queue relative to the limit (requests the
        engine could not start mean it is fuller than the gateway's counts say).
        ``pressure(0, requests=0)`` is how full it is now.
        """
        load = (self.in_flight + requests) / max(1, self.limit)
        if self.token_limit:
            load = max(load, (self.tokens_in_flight + self.cost_of(cost)) / self.token_limit)
        if self.kv_usage is not None:
            load = max(load, self.kv_usage)
        if self.waiting:
            load += self.waiting / max(1, self.limit)
        return load


@dataclass(slots=True)  # not frozen: built per request, where frozen's __init__ costs 4x
class RouteRequest:
    cost: int  # prompt + max output tokens of each sequence: the KV it may come to hold
    session: str | None = None  # conversation key for affinity, if any


class Router(Protocol):
    def choose(self, loads: Sequence[Load], request: RouteRequest) -> Load | None:
        """The backend to admit ``request`` to, among those that fit; None if none fits."""
        ...
