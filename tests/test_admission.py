"""Admission: leases, the bounded priority queue, deadlines, cancellation, shutdown.

Deterministic without sleeps: waiters are parked with ``wait_all_tasks_blocked``,
capacity is driven by explicit releases and ``notify()``, and deadlines by a fake
clock (one test uses anyio's real timer on purpose, with a 20 ms deadline).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import pytest
from anyio import wait_all_tasks_blocked

from policies.admission import (
    Lease,
    NoHealthyBackend,
    Outcome,
    PoolAdmission,
    Priority,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
)

FAR = 1e9  # a deadline nobody reaches

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass(eq=False)
class Backend:
    name: str
    limit: int
    in_flight: int = 0
    healthy: bool = True
    granted_over_limit: int = 0  # times in_flight rose past the limit (must stay 0)

    def __setattr__(self, name: str, value: object) -> None:
        if name == "in_flight" and isinstance(value, int) and value > self.limit:
            if value > getattr(self, "in_flight", 0):
                object.__setattr__(self, "granted_over_limit", self.granted_over_limit + 1)
        object.__setattr__(self, name, value)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def first_with_room(*backends: Backend) -> Callable[[], Backend | None]:
    def pick() -> Backend | None:
        if not any(b.healthy for b in backends):
            raise NoHealthyBackend("nothing healthy")
        for b in backends:
            if b.healthy and b.in_flight < b.limit:
                return b
        return None

    return pick


def pool(
    clock: Clock | None = None, depth: int = 100, share: float = 0.0
) -> PoolAdmission[Backend]:
    return PoolAdmission(max_queue_depth=depth, batch_share=share, clock=clock or Clock())


async def park(adm: PoolAdmission[Backend], pick: Callable[[], Backend | None]) -> None:
    """A batch request that waits until it is served or cancelled, then holds its lease."""
    await adm.acquire(pick, priority=Priority.BATCH, deadline=FAR)


async def test_grants_at_once_when_there_is_room() -> None:
    b = Backend("a", limit=2)
    adm = pool()
    lease = await adm.acquire(first_with_room(b), priority=Priority.INTERACTIVE, deadline=FAR)
    assert lease.backend is b and b.in_flight == 1 and lease.queue_wait == 0.0
    assert adm.leased == 1 and adm.depth() == 0
    lease.release(Outcome.SUCCESS)
    assert b.in_flight == 0 and adm.leased == 0 and lease.outcome is Outcome.SUCCESS


async def test_release_is_exactly_once() -> None:
    b = Backend("a", limit=1)
    adm = pool()
    lease = await adm.acquire(first_with_room(b), priority=Priority.BATCH, deadline=FAR)
    lease.release(Outcome.DROPPED)
    lease.release(Outcome.SUCCESS)
    lease.release(Outcome.IGNORE)
    assert b.in_flight == 0 and adm.leased == 0
    assert lease.outcome is Outcome.DROPPED and lease.released


async def test_waiters_are_served_interactive_first_then_fifo() -> None:
    b = Backend("a", limit=1)
    pick = first_with_room(b)
    adm = pool(share=0.0)
    holder = await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    order: list[str] = []

    async def wait(tag: str, priority: Priority) -> None:
        lease = await adm.acquire(pick, priority=priority, deadline=FAR)
        order.append(tag)
        lease.release(Outcome.SUCCESS)

    async with anyio.create_task_group() as tg:
        for tag, priority in [
            ("b1", Priority.BATCH),
            ("i1", Priority.INTERACTIVE),
            ("b2", Priority.BATCH),
            ("i2", Priority.INTERACTIVE),
        ]:
            tg.start_soon(wait, tag, priority)
            await wait_all_tasks_blocked()
        assert adm.depth() == 4
        assert adm.depth(Priority.BATCH) == 2 and adm.depth(Priority.INTERACTIVE) == 2
        holder.release(Outcome.SUCCESS)  # each waiter passes the permit on as it releases
    assert order == ["i1", "i2", "b1", "b2"]
    assert b.in_flight == 0 and adm.depth() == 0


async def test_batch_share_prevents_starvation() -> None:
    b = Backend("a", limit=1)
    pick = first_with_room(b)
    adm = pool(share=0.25)
    holder = await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    served: list[Priority] = []
    leases: list[Lease[Backend]] = []

    async def wait(priority: Priority) -> None:
        leases.append(await adm.acquire(pick, priority=priority, deadline=FAR))
        served.append(priority)

    async with anyio.create_task_group() as tg:
        for _ in range(12):
            tg.start_soon(wait, Priority.INTERACTIVE)
            tg.start_soon(wait, Priority.BATCH)
        await wait_all_tasks_blocked()
        assert adm.depth() == 24
        holder.release(Outcome.SUCCESS)
        for _ in range(24):
            await wait_all_tasks_blocked()
            leases[-1].release(Outcome.SUCCESS)
    # Under contention every fourth grant goes to batch; batch never waits for
    # the interactive class to drain.
    assert served[:12].count(Priority.BATCH) == 3
    assert served[3] is Priority.BATCH and served[7] is Priority.BATCH
    assert b.in_flight == 0


async def test_full_queue_refuses_at_once_with_retry_after() -> None:
    b = Backend("a", limit=1)
    pick = first_with_room(b)
    adm = pool(depth=2)
    holder = await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    async with anyio.create_task_group() as tg:
        for _ in range(2):
            tg.start_soon(park, adm, pick)
        await wait_all_tasks_blocked()
        with pytest.raises(QueueFull) as refused:
            await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
        assert refused.value.code == "queue_full" and refused.value.http_status == 429
        assert refused.value.depth == 2
        assert 1.0 <= refused.value.retry_after <= 60.0
        tg.cancel_scope.cancel()
    assert adm.depth() == 0
    holder.release(Outcome.SUCCESS)
    assert b.in_flight == 0


async def test_deadline_on_the_injected_clock_times_out() -> None:
    clock = Clock()
    b = Backend("a", limit=1)
    pick = first_with_room(b)
    adm = pool(clock)
    holder = await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    errors: list[QueueTimeout] = []

    async def wait(deadline: float) -> None:
        try:
            await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=deadline)
        except QueueTimeout as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, clock.now + 2.0)
        tg.start_soon(wait, clock.now + 5.0)
        await wait_all_tasks_blocked()
        clock.now += 2.5
        adm.notify()
        await wait_all_tasks_blocked()
        assert len(errors) == 1 and errors[0].waited == 2.5 and adm.depth() == 1
        clock.now += 3.0
        adm.notify()
    assert len(errors) == 2 and errors[0].code == "queue_timeout"
    assert adm.depth() == 0 and b.in_flight == 1
    holder.release(Outcome.SUCCESS)


async def test_a_passed_deadline_is_refused_without_queueing() -> None:
    clock = Clock()
    b = Backend("a", limit=0)
    adm = pool(clock)
    with pytest.raises(QueueTimeout):
        await adm.acquire(first_with_room(b), priority=Priority.BATCH, deadline=clock.now)
    assert adm.depth() == 0


async def test_deadline_fires_on_the_real_timer_without_notify() -> None:
    b = Backend("a", limit=0)
    adm: PoolAdmission[Backend] = PoolAdmission(max_queue_depth=4, batch_share=0.1)
    start = time.monotonic()
    with pytest.raises(QueueTimeout):
        await adm.acquire(first_with_room(b), priority=Priority.INTERACTIVE, deadline=start + 0.02)
    assert 0.015 <= time.monotonic() - start < 1.0
    assert adm.depth() == 0


async def test_a_cancelled_waiter_leaves_the_queue_at_once() -> None:
    b = Backend("a", limit=1)
    pick = first_with_room(b)
    adm = pool(depth=1)
    holder = await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    async with anyio.create_task_group() as tg:
        tg.start_soon(park, adm, pick)
        await wait_all_tasks_blocked()
        assert adm.depth() == 1
        tg.cancel_scope.cancel()  # the client went away
    assert adm.depth() == 0
    # Its slot is free: another request may queue, and gets the permit.
    got: list[Lease[Backend]] = []

    async def wait() -> None:
        got.append(await adm.acquire(pick, priority=Priority.BATCH, deadline=FAR))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await wait_all_tasks_blocked()
        holder.release(Outcome.IGNORE)
    assert got and got[0].backend is b and b.in_flight == 1
    got[0].release(Outcome.SUCCESS)
    assert b.in_flight == 0 and adm.leased == 0


async def test_a_grant_to_a_cancelled_waiter_passes_to_the_next() -> None:
    b = Backend("a", limit=1)
    pick = first_with_room(b)
    adm = pool()
    holder = await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    got: dict[str, Lease[Backend]] = {}
    scopes: dict[str, anyio.CancelScope] = {}

    async def wait(tag: str) -> None:
        with anyio.CancelScope() as scope:
            scopes[tag] = scope
            got[tag] = await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, "first")
        await wait_all_tasks_blocked()
        tg.start_soon(wait, "second")
        await wait_all_tasks_blocked()
        # Cancellation and the grant race: the permit goes to "first", whose task
        # is already cancelled and must hand it on rather than leak it.
        scopes["first"].cancel()
        holder.release(Outcome.SUCCESS)
    assert "first" not in got and got["second"].backend is b
    assert b.in_flight == 1 and adm.leased == 1 and adm.depth() == 0
    got["second"].release(Outcome.SUCCESS)
    assert b.in_flight == 0 and adm.leased == 0


async def test_a_lease_is_released_from_another_task() -> None:
    b = Backend("a", limit=1)
    pick = first_with_room(b)
    adm = pool()
    send, receive = anyio.create_memory_object_stream[Lease[Backend]](1)
    waited: list[Lease[Backend]] = []

    async def acquirer() -> None:
        async with send:
            await send.send(await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR))

    async def streamer() -> None:
        async with receive:
            async for lease in receive:
                await wait_all_tasks_blocked()
                lease.release(Outcome.SUCCESS)

    async def queued() -> None:
        waited.append(await adm.acquire(pick, priority=Priority.BATCH, deadline=FAR))

    async with anyio.create_task_group() as tg:
        tg.start_soon(acquirer)
        await wait_all_tasks_blocked()
        tg.start_soon(queued)
        tg.start_soon(streamer)
    assert waited and waited[0].backend is b and b.in_flight == 1
    waited[0].release(Outcome.SUCCESS)
    assert b.in_flight == 0


async def test_shutdown_wakes_every_waiter_and_refuses_new_requests() -> None:
    b = Backend("a", limit=1)
    pick = first_with_room(b)
    adm = pool()
    holder = await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    errors: list[ShuttingDown] = []

    async def wait(priority: Priority) -> None:
        try:
            await adm.acquire(pick, priority=priority, deadline=FAR)
        except ShuttingDown as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for priority in [Priority.BATCH, Priority.INTERACTIVE] * 3:
            tg.start_soon(wait, priority)
        await wait_all_tasks_blocked()
        adm.close()
    assert len(errors) == 6 and adm.depth() == 0 and adm.closed
    with pytest.raises(ShuttingDown):
        await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    holder.release(Outcome.SUCCESS)  # leases granted before shutdown still release
    assert b.in_flight == 0 and adm.leased == 0


async def test_later_arrivals_never_overtake_waiters() -> None:
    b = Backend("a", limit=1)
    pick = first_with_room(b)
    adm = pool()
    await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    got: list[str] = []

    async def wait(tag: str) -> None:
        await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
        got.append(tag)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, "early")
        await wait_all_tasks_blocked()
        b.limit = 2  # capacity appeared, but nobody called notify()
        tg.start_soon(wait, "late")
        await wait_all_tasks_blocked()
        assert got == ["early"] and adm.depth() == 1
        b.limit = 3
        adm.notify()  # e.g. the controller raised the limit
    assert got == ["early", "late"] and b.in_flight == 3


async def test_a_waiter_goes_ahead_only_onto_a_backend_no_earlier_waiter_could_use() -> None:
    # One pool, two backends serving different models: a request for b waited behind one
    # for a, busy, while b was idle (and was shed at its deadline).
    a, b = Backend("a", limit=1), Backend("b", limit=1)
    for_a, for_b = first_with_room(a), first_with_room(b)

    def uses_a(x: Backend) -> bool:
        return x is a

    def uses_b(x: Backend) -> bool:
        return x is b

    adm = pool()
    first_a = await adm.acquire(
        for_a, priority=Priority.INTERACTIVE, deadline=FAR, could_use=uses_a
    )
    first_b = await adm.acquire(
        for_b, priority=Priority.INTERACTIVE, deadline=FAR, could_use=uses_b
    )
    got: list[str] = []

    async def wait(tag: str, pick: Callable[[], Backend | None], could_use: Callable) -> None:
        await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR, could_use=could_use)
        got.append(tag)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, "a1", for_a, uses_a)
        await wait_all_tasks_blocked()
        tg.start_soon(wait, "b1", for_b, uses_b)  # b is busy too: it queues behind a1
        await wait_all_tasks_blocked()
        tg.start_soon(wait, "a2", for_a, uses_a)
        await wait_all_tasks_blocked()
        assert adm.depth() == 3
        first_b.release(Outcome.SUCCESS)  # b frees while the head (a1) still cannot run
        await wait_all_tasks_blocked()
        assert got == ["b1"]
        newcomer = anyio.Event()

        async def b_newcomer() -> None:
            await adm.acquire(for_b, priority=Priority.INTERACTIVE, deadline=FAR, could_use=uses_b)
            newcomer.set()

        tg.start_soon(b_newcomer)  # b is taken again (b1): it must queue
        await wait_all_tasks_blocked()
        assert not newcomer.is_set() and adm.depth() == 3
        first_a.release(Outcome.SUCCESS)  # a frees: the first waiter for a gets it, not a2
        await wait_all_tasks_blocked()
        assert got == ["b1", "a1"]
        assert a.granted_over_limit == 0 and b.granted_over_limit == 0
        tg.cancel_scope.cancel()


async def test_a_waiter_that_names_no_backends_is_never_gone_ahead_of() -> None:
    a, b = Backend("a", limit=1), Backend("b", limit=1)
    adm = pool()
    await adm.acquire(first_with_room(a), priority=Priority.INTERACTIVE, deadline=FAR)
    async with anyio.create_task_group() as tg:
        tg.start_soon(park, adm, first_with_room(a))  # without could_use: it may want b too
        await wait_all_tasks_blocked()

        async def for_b() -> None:
            await adm.acquire(
                first_with_room(b), priority=Priority.BATCH, deadline=FAR, could_use=lambda x: True
            )

        tg.start_soon(for_b)  # b is idle, but the waiter ahead has not said it won't want it
        await wait_all_tasks_blocked()
        assert adm.depth() == 2 and b.in_flight == 0
        tg.cancel_scope.cancel()


async def test_the_routers_refusal_reaches_the_waiter() -> None:
    b = Backend("a", limit=1)
    pick = first_with_room(b)
    adm = pool()
    holder = await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    errors: list[NoHealthyBackend] = []

    async def wait() -> None:
        try:
            await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
        except NoHealthyBackend as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await wait_all_tasks_blocked()
        b.healthy = False
        adm.notify()  # the health checker ejected the backend
    assert len(errors) == 1 and errors[0].http_status == 503 and adm.depth() == 0
    with pytest.raises(NoHealthyBackend):
        await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    holder.release(Outcome.DROPPED)
    assert b.in_flight == 0


async def test_retry_after_follows_the_drain_rate() -> None:
    clock = Clock()
    b = Backend("a", limit=100)
    pick = first_with_room(b)
    adm = pool(clock)
    leases = [await adm.acquire(pick, priority=Priority.BATCH, deadline=FAR) for _ in range(20)]
    clock.now += 10.0  # a full drain window busy, then all 20 end
    for lease in leases:
        lease.release(Outcome.SUCCESS)
    assert adm.retry_after() == 1.0  # 2/s and nobody queued: 0.5 s, clamped up to 1
    b.limit = 0
    async with anyio.create_task_group() as tg:
        for _ in range(9):
            tg.start_soon(park, adm, pick)
        await wait_all_tasks_blocked()
        assert adm.retry_after() == pytest.approx(5.0)  # (9 queued + 1) / 2 per s
        clock.now += 11.0  # the releases age out of the drain window
        assert adm.retry_after() == 60.0  # (9 + 1) * 10 s, clamped
        tg.cancel_scope.cancel()


async def test_retry_after_does_not_count_time_the_pool_sat_idle() -> None:
    clock = Clock()
    b = Backend("a", limit=1)
    pick = first_with_room(b)
    adm = pool(clock, depth=2)
    first = await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    clock.now += 1.0
    first.release(Outcome.SUCCESS)
    clock.now += 11.0  # idle longer than the drain window
    held = await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)  # a burst
    clock.now += 0.5
    async with anyio.create_task_group() as tg:
        for _ in range(2):
            tg.start_soon(park, adm, pick)
        await wait_all_tasks_blocked()
        with pytest.raises(QueueFull) as refused:
            await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
        # Busy for 0.5 s with nothing drained yet: (2 queued + 1) x 0.5 s, not x 10 s.
        assert refused.value.retry_after == pytest.approx(1.5)
        tg.cancel_scope.cancel()
    held.release(Outcome.SUCCESS)


async def test_a_pool_whose_backend_is_lent_out_does_not_read_idle_time_as_no_drain() -> None:
    clock = Clock()
    b = Backend("l0", limit=1)
    pick = first_with_room(b)
    lender = pool(clock, depth=0)  # refuses at once when it has no room
    borrower = pool(clock)
    clock.now += 10.0  # the lender idle a whole drain window
    lent = await borrower.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    clock.now += 0.2
    with pytest.raises(QueueFull) as refused:
        await lender.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    # Busy since it had to refuse, not "nothing drained for 10 s" (which read 10 s).
    assert refused.value.retry_after == 1.0
    clock.now += 2.0
    lent.release(Outcome.SUCCESS)
    lender.note_drained()  # what the gateway tells a pool whose lent backend freed
    assert lender.retry_after() == 2.0  # one drained in the 2 s busy: 2 s per request


async def test_waiters_timing_out_together_hear_the_same_retry_after() -> None:
    b = Backend("a", limit=0)
    pick = first_with_room(b)
    shift = [0.0]
    # The real clock (the waits are anyio's timers), moved on once the waiters are queued:
    # a pool busy for a drain window with nothing drained estimates 10 s per request.
    adm = PoolAdmission(
        max_queue_depth=10, batch_share=0.0, clock=lambda: time.monotonic() + shift[0]
    )
    deadline = time.monotonic() + 0.05
    refusals: list[float] = []

    async def wait() -> None:
        with pytest.raises(QueueTimeout) as timed_out:
            await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=deadline)
        refusals.append(timed_out.value.retry_after)

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(wait)
        await wait_all_tasks_blocked()
        shift[0] = 10.0  # they waited out a whole drain window, nothing released
    # Each is told of the queue behind it (none): not 40, 30, 20 and 10 s.
    assert refusals == [10.0] * 4
    assert adm.depth() == 0


async def test_reconfigure_keeps_the_queue() -> None:
    b = Backend("a", limit=0)
    pick = first_with_room(b)
    adm = pool(depth=4)
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(park, adm, pick)
        await wait_all_tasks_blocked()
        adm.configure(max_queue_depth=1, batch_share=0.5)
        assert adm.depth() == 3  # nobody already queued is dropped ...
        with pytest.raises(QueueFull):  # ... but the new bound applies to arrivals
            await adm.acquire(pick, priority=Priority.BATCH, deadline=FAR)
        b.limit = 3
        adm.notify()
    assert b.in_flight == 3 and adm.depth() == 0


async def test_randomized_stress_ends_with_nothing_held_or_queued() -> None:
    rng = random.Random(20240611)
    clock = Clock()
    backends = [Backend(f"b{i}", limit=rng.randint(1, 4)) for i in range(3)]

    def pick() -> Backend | None:
        room = [b for b in backends if b.in_flight < b.limit]
        return min(room, key=lambda b: b.in_flight) if room else None

    adm = PoolAdmission[Backend](max_queue_depth=40, batch_share=0.2, clock=clock)
    tally = {"served": 0, "full": 0, "timeout": 0, "cancelled": 0}
    scopes: list[anyio.CancelScope] = []

    async def request() -> None:
        result = "cancelled"
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            try:
                lease = await adm.acquire(
                    pick,
                    priority=rng.choice(list(Priority)),
                    deadline=clock.now + rng.uniform(0.0, 4.0),
                )
            except QueueFull:
                result = "full"
            except QueueTimeout:
                result = "timeout"
            else:
                result = "served"
                try:
                    for _ in range(rng.randint(0, 6)):
                        await anyio.lowlevel.checkpoint()  # streaming the body
                finally:
                    lease.release(rng.choice(list(Outcome)))
                    if rng.random() < 0.05:
                        lease.release(Outcome.SUCCESS)  # a careless second release
        tally[result] += 1

    total = 4000
    async with anyio.create_task_group() as tg:
        for i in range(total):
            tg.start_soon(request)
            roll = rng.random()
            if roll < 0.05:
                rng.choice(scopes[-40:]).cancel()  # a client disconnects, queued or streaming
            elif roll < 0.10:
                rng.choice(backends).limit = rng.randint(0, 4)  # the controller moves
                adm.notify()
            elif roll < 0.30:
                clock.now += rng.uniform(0.0, 0.2)
                adm.notify()
            if i % 4 == 0:
                await anyio.lowlevel.checkpoint()
        for b in backends:
            b.limit = 4
        adm.notify()
        while adm.depth() or adm.leased:
            clock.now += 1.0
            adm.notify()
            await anyio.lowlevel.checkpoint()
    assert sum(tally.values()) == total
    assert min(tally.values()) > 50, tally  # every path was exercised
    assert adm.leased == 0 and adm.depth() == 0
    assert all(b.in_flight == 0 for b in backends)
    assert all(b.granted_over_limit == 0 for b in backends)
