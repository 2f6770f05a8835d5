"""A waiter that leaves the queue unserved (its deadline passed, its client went away, the
router refused it) stops keeping the waiters behind it off the backends it could use: one
of them that can be served now is served at once, not at the next release or control tick.

Before: a long request at the head, blocked on a backend whose tokens it did not fit, kept
a short one behind it off that backend (FIFO); when the long one timed out or left, nothing
dispatched again, so the short one sat beside the room it fitted until a release on that
backend or the next control tick (``control_interval_s``), or sat out its own deadline.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import pytest
from anyio import wait_all_tasks_blocked

from policies.admission import (
    Lease,
    NoHealthyBackend,
    Outcome,
    PoolAdmission,
    Priority,
    QueueTimeout,
)
from tests.procs import (
    MODEL,
    Gateway,
    Proc,
    backend,
    served,
    start_gateway,
    start_raw_sse,
    wait_until,
)
from tests.test_admission import FAR, Backend, Clock, first_with_room, pool
from tests.test_admission_scan_fixes import CHAT, WantsOf, answered, counted, post
from tests.test_reload_live import held_chat, poke

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def when_idle(backend: Backend) -> Callable[[], Backend | None]:
    """A long request's pick: it fits ``backend``'s tokens only with nothing else there."""

    def pick() -> Backend | None:
        return backend if backend.in_flight == 0 else None

    return pick


class Waiting:
    """One queued request in its own cancel scope: its lease or its refusal, once it has one."""

    def __init__(
        self,
        adm: PoolAdmission[Backend],
        pick: Callable[[], Backend | None],
        could_use: Callable[[Backend], bool],
        deadline: float = FAR,
    ) -> None:
        self.adm, self.pick, self.could_use, self.deadline = adm, pick, could_use, deadline
        self.scope = anyio.CancelScope()
        self.lease: Lease[Backend] | None = None
        self.error: Exception | None = None
        self.done = anyio.Event()

    async def run(self) -> None:
        with self.scope:
            try:
                self.lease = await self.adm.acquire(
                    self.pick,
                    priority=Priority.INTERACTIVE,
                    deadline=self.deadline,
                    could_use=self.could_use,
                )
            except Exception as exc:
                self.error = exc
        self.done.set()


async def queue(tg: anyio.abc.TaskGroup, *waiting: Waiting) -> None:
    """Queue each in this order."""
    for w in waiting:
        tg.start_soon(w.run)
        await wait_all_tasks_blocked()


async def holding(adm: PoolAdmission[Backend], backend: Backend) -> Lease[Backend]:
    return await adm.acquire(first_with_room(backend), priority=Priority.INTERACTIVE, deadline=FAR)


@pytest.mark.parametrize("how", ["timed_out", "cancelled"])
async def test_the_waiter_behind_a_blocked_head_is_served_when_the_head_leaves(how: str) -> None:
    a = Backend("a", limit=2)
    clock = Clock()
    adm = pool(clock)
    await holding(adm, a)  # one of a's two slots, and a's tokens but for a short request
    # The real timer (50 ms): the head's deadline passes with no dispatch to notice it.
    deadline = clock.now + 0.05 if how == "timed_out" else FAR
    long = Waiting(adm, when_idle(a), WantsOf(a), deadline=deadline)
    short = Waiting(adm, first_with_room(a), WantsOf(a))
    async with anyio.create_task_group() as tg:
        await queue(tg, long, short)
        assert adm.depth() == 2 and a.in_flight == 1  # a has room, but the head comes first
        if how == "cancelled":
            long.scope.cancel()  # its client went away
        await long.done.wait()
        await wait_all_tasks_blocked()
        assert short.lease is not None and short.lease.backend is a
        assert a.in_flight == 2 and adm.leased == 2 and adm.depth() == 0
        if how == "timed_out":
            assert isinstance(long.error, QueueTimeout)
    assert long.lease is None and a.granted_over_limit == 0


@pytest.mark.parametrize("how", ["timed_out", "cancelled"])
async def test_a_waiter_leaving_from_behind_the_head_lets_the_one_behind_it_go_ahead(
    how: str,
) -> None:
    """The head waits for busy b; the long request behind it, for a; the short one behind
    that fits a but may not go ahead of the long one, until that leaves."""
    a, b = Backend("a", limit=2), Backend("b", limit=1)
    clock = Clock()
    adm = pool(clock)
    await holding(adm, a)
    await holding(adm, b)
    for_b = Waiting(adm, first_with_room(b), WantsOf(b))
    long = Waiting(adm, when_idle(a), WantsOf(a), deadline=clock.now + 5.0)
    short = Waiting(adm, first_with_room(a), WantsOf(a))
    async with anyio.create_task_group() as tg:
        await queue(tg, for_b, long, short)
        assert adm.depth() == 3
        if how == "cancelled":
            long.scope.cancel()
        else:
            clock.now += 6.0
            # A request for b arrives: it frees nothing, but its dispatch sees the deadline.
            tg.start_soon(Waiting(adm, first_with_room(b), WantsOf(b)).run)
        await long.done.wait()
        await wait_all_tasks_blocked()
        assert short.lease is not None and short.lease.backend is a
        assert for_b.lease is None and adm.depth() == 2 - (how == "cancelled")
        tg.cancel_scope.cancel()
    assert a.granted_over_limit == 0 and b.granted_over_limit == 0


async def test_a_release_elsewhere_that_finds_a_waiter_expired_serves_whom_it_held_back() -> None:
    """A release on c (nobody waits for c) notices the long request's deadline: the short
    one behind it fits a, and must be asked though it could not use c."""
    a, b, c = Backend("a", limit=2), Backend("b", limit=1), Backend("c", limit=1)
    clock = Clock()
    adm = pool(clock)
    await holding(adm, a)
    await holding(adm, b)
    on_c = await holding(adm, c)
    for_b = Waiting(adm, first_with_room(b), WantsOf(b))
    long = Waiting(adm, when_idle(a), WantsOf(a), deadline=clock.now + 5.0)
    short = Waiting(adm, first_with_room(a), WantsOf(a))
    async with anyio.create_task_group() as tg:
        await queue(tg, for_b, long, short)
        clock.now += 6.0
        on_c.release(Outcome.SUCCESS)
        await wait_all_tasks_blocked()
        assert isinstance(long.error, QueueTimeout)
        assert short.lease is not None and short.lease.backend is a
        assert for_b.lease is None and adm.depth() == 1
        tg.cancel_scope.cancel()


async def test_a_waiter_leaving_among_waiters_that_all_want_the_same_asks_nobody() -> None:
    """The common pool (one model): whoever leaves, those behind still wait for what the
    head waits for; a departure from behind the head costs no pick(), the head's own one."""
    a = Backend("a", limit=1)
    await_a = first_with_room(a)
    calls = [0]
    adm = pool()
    await holding(adm, a)
    waiting = [Waiting(adm, counted(await_a, calls), WantsOf(a)) for _ in range(30)]
    async with anyio.create_task_group() as tg:
        await queue(tg, *waiting)
        calls[0] = 0
        waiting[10].scope.cancel()
        await waiting[10].done.wait()
        await wait_all_tasks_blocked()
        assert calls[0] == 0 and adm.depth() == 29
        waiting[0].scope.cancel()
        await waiting[0].done.wait()
        await wait_all_tasks_blocked()
        assert calls[0] == 1 and adm.depth() == 28  # the new head: no room for it either
        tg.cancel_scope.cancel()
    assert a.in_flight == 1 and adm.leased == 1


async def test_a_head_the_router_refuses_on_a_release_elsewhere_no_longer_holds_back() -> None:
    """The long request at the head is refused (its backends gone) by the dispatch a release
    on c runs; the next head waits for busy b; the short one behind fits a."""
    a, b, c = Backend("a", limit=2), Backend("b", limit=1), Backend("c", limit=1)
    adm = pool()
    await holding(adm, a)
    await holding(adm, b)
    on_c = await holding(adm, c)
    refuse = [False]

    def long_pick() -> Backend | None:
        if refuse[0]:
            raise NoHealthyBackend("its backends are gone")
        return when_idle(a)()

    long = Waiting(adm, long_pick, WantsOf(a))
    for_b = Waiting(adm, first_with_room(b), WantsOf(b))
    short = Waiting(adm, first_with_room(a), WantsOf(a))
    async with anyio.create_task_group() as tg:
        await queue(tg, long, for_b, short)
        refuse[0] = True
        on_c.release(Outcome.SUCCESS)
        await wait_all_tasks_blocked()
        assert isinstance(long.error, NoHealthyBackend)
        assert short.lease is not None and short.lease.backend is a
        assert for_b.lease is None and adm.depth() == 1
        tg.cancel_scope.cancel()


# --- through the gateway -------------------------------------------------------------

STATIC_2 = {"kind": "static", "initial": 2, "min": 2, "max": 2}


@pytest.fixture
def raw(tmp_path: Path) -> Iterator[Proc]:
    yield from served(start_raw_sse(tmp_path))


def sent_raw(gw: Gateway, body: dict[str, Any]) -> socket.socket:
    """A client that sent its request on a socket of its own, to hang up when told."""
    url = urlsplit(gw.url)
    assert url.hostname is not None and url.port is not None
    data = json.dumps(body).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nhost: {url.netloc}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    )
    client = socket.create_connection((url.hostname, url.port), timeout=10)
    client.sendall(head.encode() + data)
    return client


@pytest.mark.parametrize("how", ["timed_out", "disconnected"])
def test_over_http_a_short_request_is_served_when_the_long_one_ahead_leaves(
    tmp_path: Path, raw: Proc, how: str
) -> None:
    """One backend, two permits and 1,000 tokens: a held stream takes 500 of them, a long
    request (600 more) waits, a short one behind it may not go ahead. The long one leaves:
    the short one runs at once. Before, it waited for the next control tick (30 s) and sat
    out its own deadline (20 s) first: a 429 beside the room it fitted."""
    config = {
        "backends": [backend("x", raw.url, limit=STATIC_2, max_tokens_in_flight=1000)],
        "pools": {"short": {"max_queue_depth": 8, "max_queue_wait_s": 20}},
        "admission": {"control_interval_s": 30},
        "health": {"interval_s": 60},
    }
    gw = start_gateway(tmp_path, config)
    client = httpx.Client(timeout=30)
    long_body = {**answered(MODEL), "max_tokens": 600}
    leaving: socket.socket | None = None
    try:
        request = client.build_request("POST", gw.url + CHAT, json=holding_500())
        holder = client.send(request, stream=True)
        assert holder.status_code == 200, holder.read()
        hold = holder.iter_raw()
        next(hold)  # its first event: it runs

        def depth() -> int:
            return gw.state()["pools"]["short"]["queue_depth"]

        with ThreadPoolExecutor(2) as threads:
            if how == "timed_out":
                wait = {"x-kneecap-max-queue-wait": "3"}
                long = threads.submit(
                    lambda: httpx.post(gw.url + CHAT, json=long_body, headers=wait, timeout=30)
                )
            else:
                leaving = sent_raw(gw, long_body)
            wait_until(lambda: depth() == 1, timeout=10)
            assert gw.state()["backends"][0]["in_flight"] == 1  # a permit free, not the tokens
            short = threads.submit(post, gw, {**answered(MODEL), "max_tokens": 10})
            wait_until(lambda: depth() == 2, timeout=10)  # it fits, but the long one is first
            if how == "timed_out":
                assert not long.done()
                refused = long.result(timeout=10)
                assert refused.status_code == 429
                assert refused.json()["error"]["code"] == "queue_timeout"
            else:
                assert leaving is not None
                leaving.close()  # its client hangs up while it waits
            answer = short.result(timeout=10)  # before: 429 queue_timeout after 20 s
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-kneecap-backend"] == "x"
            assert depth() == 0
        poke(raw, 1)
        assert b"".join(hold).endswith(b"[DONE]\n\n")
        wait_until(lambda: gw.state()["pools"]["short"] == {"queue_depth": 0, "leased": 0})
    finally:
        if leaving is not None:
            leaving.close()
        client.close()
        gw.proc.stop()


def holding_500() -> dict[str, Any]:
    """A stream that holds its permit and 500 of the backend's tokens until poked."""
    return {**held_chat(), "max_tokens": 500}
