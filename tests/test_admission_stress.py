"""Leak-freedom of the real admission code under 10,000 requests and chaos.

The real :class:`policies.admission.PoolAdmission` and :class:`Lease` on anyio,
with its real timers: clients that disconnect while queued or while streaming,
bodies streamed (and leases released) by another task, backends that fail and
come back, reloads that change queue depths, batch shares and limits. When the
dust settles no permit may be held and no waiter queued, no backend may have
been granted past its limit, and every queue timeout must have been answered
within 50 ms of its deadline (beyond any stall of the whole event loop, which a
heartbeat measures: on a quiet host both are about a millisecond).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field

import anyio
import pytest

from policies.admission import (
    Lease,
    NoHealthyBackend,
    Outcome,
    PoolAdmission,
    Priority,
    QueueFull,
    QueueTimeout,
)

pytestmark = pytest.mark.anyio

REQUESTS = 10_000
CLIENTS = 200  # requests in the air at once
GRACE_S = 0.050


@dataclass(eq=False)
class Backend:
    name: str
    limit: int
    in_flight: int = 0
    healthy: bool = True
    granted_over_limit: int = 0

    def __setattr__(self, name: str, value: object) -> None:
        if name == "in_flight" and isinstance(value, int) and value > getattr(self, "in_flight", 0):
            if value > self.limit:
                object.__setattr__(self, "granted_over_limit", self.granted_over_limit + 1)
        object.__setattr__(self, name, value)


@dataclass
class Pool:
    admission: PoolAdmission[Backend]
    backends: list[Backend]

    def pick(self) -> Backend | None:
        healthy = [b for b in self.backends if b.healthy]
        if not healthy:
            raise NoHealthyBackend("no healthy backend")
        room = [b for b in healthy if b.in_flight < b.limit]
        return min(room, key=lambda b: b.in_flight / b.limit) if room else None


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    released: Counter[Outcome] = field(default_factory=Counter)
    overshoot: float = 0.0  # worst lateness of a queue timeout past its deadline
    loop_lag: float = 0.0  # worst lateness of a 5 ms heartbeat: what the host itself cost


async def test_ten_thousand_requests_with_chaos_leave_nothing_behind() -> None:
    rng = random.Random(6)
    pools = [
        Pool(
            PoolAdmission(max_queue_depth=64, batch_share=0.2, name=name),
            [Backend(f"{name}-{i}", limit=rng.randint(2, 8)) for i in range(3)],
        )
        for name in ("short", "long")
    ]
    tally = Tally()
    clients = anyio.CapacityLimiter(CLIENTS)  # borrowed per request, by the arrival loop
    done = anyio.Event()

    async def stream(lease: Lease[Backend], seed: int) -> None:
        """The body, streamed by another task than the one that was admitted."""
        local = random.Random(seed)
        outcome = Outcome.SUCCESS
        try:
            with anyio.move_on_after(0.01):  # the client gives up on a stalled stream
                await anyio.sleep(local.uniform(0, 0.003))  # the stream's duration
                if local.random() < 0.05:
                    await anyio.sleep(1.0)  # stalled
            if not lease.backend.healthy:
                outcome = Outcome.DROPPED  # its backend failed under it
            elif local.random() < 0.1:
                outcome = Outcome.IGNORE
        finally:
            lease.release(outcome)
            lease.release(Outcome.DROPPED)  # a second release must be a no-op
            tally.released[lease.outcome or outcome] += 1

    async def request(i: int, group: anyio.abc.TaskGroup) -> None:
        try:
            await admit_and_stream(i, group)
        finally:
            clients.release_on_behalf_of(i)

    async def admit_and_stream(i: int, group: anyio.abc.TaskGroup) -> None:
        local = random.Random(i)
        pool = pools[i % 2]
        priority = Priority.BATCH if local.random() < 0.3 else Priority.INTERACTIVE
        wait = local.choice((0.0, 0.002, 0.01, 0.03))
        leaves_after = local.uniform(0, 0.02) if local.random() < 0.1 else None
        deadline = time.monotonic() + wait  # the request arrives now
        try:
            with anyio.CancelScope() as scope:
                if leaves_after is not None:
                    scope.deadline = anyio.current_time() + leaves_after
                lease = await pool.admission.acquire(
                    pool.pick, priority=priority, deadline=deadline
                )
            if scope.cancelled_caught:
                tally.outcomes["left the queue"] += 1
                return
        except QueueFull:
            tally.outcomes["queue_full"] += 1
            return
        except QueueTimeout:
            tally.overshoot = max(tally.overshoot, time.monotonic() - deadline)
            tally.outcomes["queue_timeout"] += 1
            return
        except NoHealthyBackend:
            tally.outcomes["no_backend"] += 1
            return
        tally.outcomes["admitted"] += 1
        group.start_soon(stream, lease, i)

    async def chaos() -> None:
        """Failures, recoveries and reloads, until every request is answered."""
        while not done.is_set():
            pool = rng.choice(pools)
            backend = rng.choice(pool.backends)
            roll = rng.random()
            if roll < 0.3:
                backend.healthy = not backend.healthy
            elif roll < 0.6:
                backend.limit = rng.randint(1, 10)  # a reload or the controller moved it
            else:
                pool.admission.configure(
                    max_queue_depth=rng.randint(0, 128), batch_share=rng.random()
                )
            if not any(b.healthy for b in pool.backends) and rng.random() < 0.5:
                rng.choice(pool.backends).healthy = True
            pool.admission.notify()
            await anyio.sleep(0.002)
        for pool in pools:  # the storm is over: everyone healthy again
            for backend in pool.backends:
                backend.healthy = True
            pool.admission.notify()

    async def heartbeat() -> None:
        """A shared, overloaded host stalls the whole process now and then; that is
        not admission's doing, so the timers are judged net of the loop's own lag."""
        while not done.is_set():
            before = time.monotonic()
            await anyio.sleep(0.005)
            tally.loop_lag = max(tally.loop_lag, time.monotonic() - before - 0.005)

    async with anyio.create_task_group() as outer:
        outer.start_soon(chaos)
        outer.start_soon(heartbeat)
        async with anyio.create_task_group() as streams:
            async with anyio.create_task_group() as arrivals:
                for i in range(REQUESTS):  # at most CLIENTS requests in the air
                    await clients.acquire_on_behalf_of(i)
                    arrivals.start_soon(request, i, streams)
        done.set()

    for pool in pools:
        assert pool.admission.leased == 0
        assert pool.admission.depth() == 0
        for backend in pool.backends:
            assert backend.in_flight == 0, backend.name
            assert backend.granted_over_limit == 0, backend.name
    outcomes = tally.outcomes
    assert sum(outcomes.values()) == REQUESTS
    assert outcomes["admitted"] == sum(tally.released.values())
    # Every path was exercised, not only the happy one.
    assert min(outcomes[k] for k in ("queue_full", "queue_timeout", "left the queue")) > 0
    assert outcomes["no_backend"] > 0
    assert min(tally.released[o] for o in Outcome) > 0
    late = tally.overshoot - tally.loop_lag
    assert late <= GRACE_S, f"a queue timeout came {tally.overshoot * 1000:.0f} ms late"
