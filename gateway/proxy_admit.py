"""A proxied request's admission: its lease taken, a refusal typed and counted, its lease
released, with the other pools' waiters told of the room."""

from __future__ import annotations

from backends.replica import Replica
from gateway.admission_pick import CouldUse, Planned, make_pick
from gateway.errors import GatewayError, RateLimited, Unavailable
from gateway.placement import Route
from gateway.recording import Flight
from gateway.runtime import Runtime
from policies.admission import (
    Lease,
    NoHealthyBackend,
    Outcome,
    Priority,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
)
from policies.token_budget import Claim


class NoRoomToRetry(Exception):
    """A retry found no capacity before the request's queue deadline, no healthy backend,
    or the gateway shutting down: the client hears of the failure it had."""


async def admit(
    runtime: Runtime,
    flight: Flight,
    route: Route,
    priority: Priority,
    deadline: float,
    tried: set[str],
) -> Lease[Claim[Replica]]:
    pool = flight.pool
    planned = Planned(route)
    pick = make_pick(runtime, planned, tried)
    could_use = CouldUse(runtime, planned, tried)
    try:
        return await runtime.admission(pool).acquire(
            pick, priority=priority, deadline=deadline, could_use=could_use
        )
    except (QueueFull, QueueTimeout) as exc:
        if tried:  # a retry: the request was admitted once, it is no shed
            raise NoRoomToRetry from exc
        raise _refusal(runtime, pool, exc) from exc
    except (NoHealthyBackend, ShuttingDown) as exc:
        if tried:  # as above: the client hears of the failure it had
            raise NoRoomToRetry from exc
        raise _unavailable(runtime, pool, exc) from exc


def _unavailable(runtime: Runtime, pool: str, exc: NoHealthyBackend | ShuttingDown) -> GatewayError:
    if isinstance(exc, NoHealthyBackend):
        runtime.recorder.rejected(pool, "no_backend")
        return Unavailable(str(exc))
    runtime.recorder.rejected(pool, "shutting_down")
    return Unavailable("the gateway is shutting down", code="shutting_down")


def _refusal(runtime: Runtime, pool: str, exc: QueueFull | QueueTimeout) -> GatewayError:
    if isinstance(exc, QueueFull):
        return _shed(runtime, pool, "queue_full", f"pool `{pool}` queue is full", exc)
    message = f"no capacity in pool `{pool}` within the queue deadline"
    return _shed(runtime, pool, "queue_timeout", message, exc)


def release_lease(
    runtime: Runtime, flight: Flight, lease: Lease[Claim[Replica]], outcome: Outcome
) -> None:
    """Release the lease; other pools' waiters hear of it too: they may borrow from its
    replica, or have been planned onto its pool when their own lost its replicas."""
    lease.release(outcome)  # wakes the queue it was taken from
    owner = lease.backend.backend.pool
    for name, admission in runtime.admissions.items():
        if name == flight.pool:
            continue
        if name == owner:  # lent: the room freed is this pool's, in its drain rate too
            admission.note_drained()
        if admission.depth():
            admission.notify(room=lease.backend)


def _shed(
    runtime: Runtime,
    pool: str,
    reason: str,
    message: str,
    exc: QueueFull | QueueTimeout,
) -> GatewayError:
    runtime.recorder.rejected(pool, reason)  # type: ignore[arg-type]
    retry_after = str(max(1, round(exc.retry_after or 1)))
    return RateLimited(message, code=reason, headers={"retry-after": retry_after})
