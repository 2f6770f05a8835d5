"""A waiter whose own backend frees is served however many wait ahead of it for busy
backends (README, Admission control: "it never waits behind a head whose backends are
busy while its own are idle"), and looking past a blocked head stays cheap.

Before: a dispatch asked at most four waiters past a blocked head, so a fifth or later
waiting for another backend sat out its deadline (429 queue_timeout) beside an idle one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from anyio import wait_all_tasks_blocked

from policies.admission import Outcome, PoolAdmission, Priority
from tests.procs import Gateway, Proc, start_gateway, start_raw_sse, wait_until
from tests.test_admission import FAR, Backend, first_with_room, pool
from tests.test_reload_live import HEAD, chat, held_chat, poke, reload, sse

CHAT = "/v1/chat/completions"
STATIC_1 = {"kind": "static", "initial": 1, "min": 1, "max": 1}


def only(backend: Backend) -> Callable[[Backend], bool]:
    def could_use(x: Backend) -> bool:
        return x is backend

    return could_use


def counted(pick: Callable[[], Backend | None], calls: list[int]) -> Callable[[], Backend | None]:
    def counting() -> Backend | None:
        calls[0] += 1
        return pick()

    return counting


async def wait_for(
    adm: PoolAdmission[Backend], backend: Backend, done: anyio.Event | None = None
) -> None:
    """A request for ``backend`` alone, with a ``could_use`` of its own as the gateway
    makes them; ``done`` is set once it is served."""
    await adm.acquire(
        first_with_room(backend),
        priority=Priority.INTERACTIVE,
        deadline=FAR,
        could_use=only(backend),
    )
    if done is not None:
        done.set()


@pytest.mark.anyio
@pytest.mark.parametrize("ahead", [3, 8])
async def test_a_release_serves_the_waiter_for_it_behind_many_for_a_busy_backend(
    ahead: int,
) -> None:
    a, b = Backend("a", limit=1), Backend("b", limit=1)
    adm = pool()
    await adm.acquire(first_with_room(a), priority=Priority.INTERACTIVE, deadline=FAR)
    b_holder = await adm.acquire(first_with_room(b), priority=Priority.INTERACTIVE, deadline=FAR)
    served_b = anyio.Event()

    async with anyio.create_task_group() as tg:
        for _ in range(ahead):
            tg.start_soon(wait_for, adm, a)
        await wait_all_tasks_blocked()
        tg.start_soon(wait_for, adm, b, served_b)
        await wait_all_tasks_blocked()
        assert adm.depth() == ahead + 1
        b_holder.release(Outcome.SUCCESS)
        await wait_all_tasks_blocked()
        assert served_b.is_set() and b.in_flight == 1 and adm.depth() == ahead
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_notify_serves_the_waiter_behind_many_for_a_busy_backend() -> None:
    a, b = Backend("a", limit=1), Backend("b", limit=0)  # b: a limit of 0 until raised
    adm = pool()
    await adm.acquire(first_with_room(a), priority=Priority.INTERACTIVE, deadline=FAR)
    served_b = anyio.Event()

    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(wait_for, adm, a)
        await wait_all_tasks_blocked()
        tg.start_soon(wait_for, adm, b, served_b)
        await wait_all_tasks_blocked()
        b.limit = 1
        adm.notify()  # e.g. the controller raised b's limit
        await wait_all_tasks_blocked()
        assert served_b.is_set() and adm.depth() == 8
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_release_asks_only_the_head_when_every_waiter_wants_the_same() -> None:
    """The common pool (one model): a release must not cost a pick() per waiter."""
    a = Backend("a", limit=1)
    uses_a = only(a)
    calls = [0]
    pick = counted(first_with_room(a), calls)
    adm: PoolAdmission[Backend] = pool()
    holder = await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    async with anyio.create_task_group() as tg:
        for _ in range(50):
            tg.start_soon(
                lambda: adm.acquire(
                    counted(first_with_room(a), calls),
                    priority=Priority.INTERACTIVE,
                    deadline=FAR,
                    could_use=lambda x: uses_a(x),  # one closure per request
                )
            )
        await wait_all_tasks_blocked()
        calls[0] = 0
        holder.release(Outcome.SUCCESS)
        await wait_all_tasks_blocked()
        assert adm.depth() == 49
        assert calls[0] == 2  # the head (granted), the next head (no room); nobody else
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_notify_asks_each_kind_of_waiter_once() -> None:
    a = Backend("a", limit=1)
    uses_a = only(a)  # one could_use for every waiter: they all want the same
    calls = [0]
    adm: PoolAdmission[Backend] = pool()
    await adm.acquire(first_with_room(a), priority=Priority.INTERACTIVE, deadline=FAR)
    async with anyio.create_task_group() as tg:
        for _ in range(50):
            tg.start_soon(
                lambda: adm.acquire(
                    counted(first_with_room(a), calls),
                    priority=Priority.INTERACTIVE,
                    deadline=FAR,
                    could_use=uses_a,
                )
            )
        await wait_all_tasks_blocked()
        calls[0] = 0
        adm.notify()
        assert calls[0] == 1  # the head; the rest want what it could not get
        tg.cancel_scope.cancel()


# --- through the gateway -------------------------------------------------------------


@pytest.fixture
def raws(tmp_path: Path) -> Iterator[dict[str, Proc]]:
    procs = {"x": start_raw_sse(tmp_path), "y": start_raw_sse(tmp_path)}
    try:
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def answered(model: str) -> dict[str, Any]:
    body = chat([["send", HEAD + sse("a") + "data: [DONE]\n\n"], ["close"]])
    return {**body, "model": model}


def held(client: httpx.Client, gw: Gateway, model: str) -> Iterator[bytes]:
    """A stream on ``model``'s backend that holds its permit until that backend is poked;
    the rest of its body (it is closed when this iterator is)."""
    request = client.build_request("POST", gw.url + CHAT, json={**held_chat(), "model": model})
    response = client.send(request, stream=True)
    assert response.status_code == 200, response.read()
    body = response.iter_raw()
    next(body)  # its first event: it runs
    return body


def post(gw: Gateway, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gw.url + CHAT, json=body, timeout=30)


def test_a_request_is_served_on_its_idle_backend_behind_six_for_a_busy_one(
    tmp_path: Path, raws: dict[str, Proc]
) -> None:
    """Two models in one pool, one permit each: six requests for mx wait for x (held); one
    for my waits for y. y frees: the my request is served, and so is the next arrival."""
    config = {
        "backends": [
            {"name": n, "url": p.url, "pool": "short", "models": [f"m{n}"], "limit": STATIC_1}
            for n, p in raws.items()
        ],
        "pools": {"short": {"max_queue_depth": 32, "max_queue_wait_s": 30}},
        "health": {"interval_s": 60},
        "routing": {"token_budget": {"enabled": False}},
    }
    gw = start_gateway(tmp_path, config)
    client = httpx.Client(timeout=30)
    hold_x, hold_y = held(client, gw, "mx"), held(client, gw, "my")

    def depth() -> int:
        return gw.state()["pools"]["short"]["queue_depth"]

    with ThreadPoolExecutor(8) as threads:
        for_x: list[Future[httpx.Response]] = []
        for n in range(6):
            for_x.append(threads.submit(post, gw, answered("mx")))
            wait_until(lambda n=n: depth() == n + 1, timeout=10)  # queued in this order
        for_y = threads.submit(post, gw, answered("my"))
        wait_until(lambda: depth() == 7, timeout=10)
        poke(raws["y"], 1)  # y's stream ends: y is idle
        assert b"".join(hold_y).endswith(b"[DONE]\n\n")
        # Before: it waited until those for x timed out (30 s), with y idle all along.
        answer = for_y.result(timeout=10)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kneecap-backend"] == "y"
        later = post(gw, answered("my"))  # y idle again: no waiting behind those for x
        assert later.status_code == 200, later.text
        assert depth() == 6 and not any(f.done() for f in for_x)
        poke(raws["x"], 1)
        assert b"".join(hold_x).endswith(b"[DONE]\n\n")
        assert [f.result(timeout=30).status_code for f in for_x] == [200] * 6
    client.close()
    gw.proc.stop()


def test_a_waiter_planned_onto_another_pool_is_served_when_a_backend_there_frees(
    tmp_path: Path,
) -> None:
    """W (model m) waits in `short` behind H (model n); a reload removes `short`'s only m
    backend, so W is planned onto `long`'s l1. l1 frees: its release must ask W, whose
    could_use had been built from W's first route (`short` only). Before, only the control
    tick's full pass served it; with ticks 30 s apart, W sat out its queue deadline (429)
    beside an idle l1."""
    raws = {name: start_raw_sse(tmp_path) for name in ("s1", "s2", "l1")}

    def entry(name: str, pool: str, model: str) -> dict[str, Any]:
        url = raws[name].url
        return {"name": name, "url": url, "pool": pool, "models": [model], "limit": STATIC_1}

    bound = {"max_queue_depth": 32, "max_queue_wait_s": 20}
    config = {
        "backends": [
            entry("s1", "short", "m"),
            entry("s2", "short", "n"),
            entry("l1", "long", "m"),
        ],
        "pools": {
            "short": {"max_prompt_tokens": 1000, **bound},
            "long": {"min_prompt_tokens": 1000, **bound},
        },
        "health": {"interval_s": 60},
        "admission": {"control_interval_s": 30},
        "routing": {"token_budget": {"enabled": False}, "spill": {"to_longer": False}},
    }
    gw = start_gateway(tmp_path, config)
    client = httpx.Client(timeout=30)
    try:
        hold_s2, hold_s1 = held(client, gw, "n"), held(client, gw, "m")
        long_prompt = {**held_chat(), "model": "m"}
        long_prompt["messages"] = [{"role": "user", "content": "word " * 3000}]
        response = client.send(
            client.build_request("POST", gw.url + CHAT, json=long_prompt), stream=True
        )
        hold_l1 = response.iter_raw()
        next(hold_l1)

        def depth() -> int:
            return gw.state()["pools"]["short"]["queue_depth"]

        with ThreadPoolExecutor(2) as threads:
            head = threads.submit(post, gw, answered("n"))
            wait_until(lambda: depth() == 1, timeout=10)
            waiter = threads.submit(post, gw, answered("m"))
            wait_until(lambda: depth() == 2, timeout=10)
            reload(gw, {**config, "backends": config["backends"][1:]})  # s1 gone
            assert depth() == 2  # W could not start on l1 yet: it is held
            poke(raws["l1"], 1)
            assert b"".join(hold_l1).endswith(b"[DONE]\n\n")
            answer = waiter.result(timeout=25)
            assert (answer.status_code, answer.headers.get("x-kneecap-backend")) == (200, "l1")
            poke(raws["s2"], 1)
            assert b"".join(hold_s2).endswith(b"[DONE]\n\n")
            assert head.result(timeout=10).status_code == 200
        poke(raws["s1"], 1)
        assert b"".join(hold_s1).endswith(b"[DONE]\n\n")
    finally:
        client.close()
        gw.proc.stop()
        for proc in raws.values():
            proc.stop()


class WantsOf:
    """A request's own ``could_use``, as the gateway makes one per request
    (``gateway.admission_pick.CouldUse``): never the same object as another's, its
    ``kind()`` the backends it could use."""

    def __init__(self, *backends: Backend) -> None:
        self.backends = backends

    def __call__(self, backend: Backend) -> bool:
        return backend in self.backends

    def kind(self) -> frozenset[str]:
        return frozenset(b.name for b in self.backends)


@pytest.mark.anyio
async def test_notify_asks_each_kind_once_though_every_waiter_has_its_own_could_use() -> None:
    """Before, waiters were told apart by their ``could_use`` objects: in the gateway, one
    per request, so a notify() (every control tick, for a pool with a queue) asked every
    waiter, a pick() each (~18 µs: 4.6 ms a tick for a queue of 256)."""
    a, b = Backend("a", limit=1), Backend("b", limit=1)
    calls = [0]
    adm: PoolAdmission[Backend] = pool()
    for backend in (a, b):
        await adm.acquire(first_with_room(backend), priority=Priority.INTERACTIVE, deadline=FAR)
    async with anyio.create_task_group() as tg:
        for index in range(40):
            backend = (a, b)[index % 2]
            tg.start_soon(
                lambda backend=backend: adm.acquire(
                    counted(first_with_room(backend), calls),
                    priority=Priority.INTERACTIVE,
                    deadline=FAR,
                    could_use=WantsOf(backend),
                )
            )
        await wait_all_tasks_blocked()
        calls[0] = 0
        adm.notify()
        assert calls[0] == 2  # the head (wants a), the first that wants b; nobody else
        tg.cancel_scope.cancel()
