"""Admission in tokens: a request holds a permit *and* its prompt + max output tokens.

A 32K-token prompt holds as much KV cache as thirty-two 1K prompts, so a
request limit alone lets a long-prompt pool oversubscribe its KV cache into a
preemption storm. Each backend therefore also has a *token budget*: the most
prompt + max-output tokens admitted at once (:func:`token_budget`), and a
request is admitted only when both its permit and its tokens fit
(:meth:`policies.routing.Load.fits`). A request's tokens are its prompt plus the
max output of each sequence it runs (``n`` of them, one per prompt of a batch),
and on a backend at most what those sequences can hold in its context
(:meth:`policies.routing.Load.cost_of`): that is what its claim holds.

The enforcement rides on admission's existing permit accounting: the router's
``pick()`` returns a :class:`Claim` — one request's hold on one backend — as
the admitted "backend". Admission adds 1 to the claim's ``in_flight`` when it
grants it and subtracts 1 when the lease is released (exactly once, or when a
granted waiter is abandoned); the claim mirrors each change onto its backend's
request count *and* its token count. So the tokens are released exactly when,
and exactly as often as, the permit is.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar


class TokenSlot(Protocol):
    """What a claim changes on its backend."""

    in_flight: int
    tokens_in_flight: int


B = TypeVar("B", bound=TokenSlot)


class Claim(Generic[B]):
    """One request's hold on ``backend``: ``tokens`` while admitted, nothing otherwise."""

    __slots__ = ("_held", "backend", "tokens")

    def __init__(self, backend: B, tokens: int) -> None:
        self.backend = backend
        self.tokens = tokens
        self._held = 0

    @property
    def in_flight(self) -> int:
        """1 while admitted, else 0 (admission's permit count for this claim)."""
        return self._held

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        if value not in (0, 1):
            raise RuntimeError(f"a claim is held once or not at all, asked for {value}")
        delta = value - self._held
        self._held = value
        self.backend.in_flight += delta
        self.backend.tokens_in_flight += delta * self.tokens


def token_budget(
    *,
    configured: int | None,
    kv_capacity: int | None,
    kv_fraction: float,
    default: int | None,
) -> int | None:
    """A backend's token budget: configured, else a share of its KV capacity, else default.

    None means no budget (admission counts requests only).
    """
    if configured is not None:
        return configured
    if kv_capacity is not None:
        return max(1, int(kv_capacity * kv_fraction))
    return default
