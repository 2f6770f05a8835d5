"""Retry-After's drain rate counts only the time the pool was busy (README, Refusals), also
when the idle spell between two bursts is shorter than the drain window.

Before: a pool that had drained anything within the window counted from the start of
its previous burst, idle spell included: 1 s of work, 8 s idle, and the next burst's
429s advised 19 s for a queue that empties in 3 s.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from anyio import wait_all_tasks_blocked

from policies.admission import Outcome, Priority, QueueFull
from tests.procs import Proc, backend, served, start_gateway, start_raw_sse, wait_until
from tests.test_admission import FAR, Backend, Clock, first_with_room, park, pool
from tests.test_admission_scan_fixes import held
from tests.test_reload_live import HEAD, chat, poke, sse

CHAT = "/v1/chat/completions"
STATIC_1 = {"kind": "static", "initial": 1, "min": 1, "max": 1}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("idle", "advised"),
    [
        (8.0, 3.0),  # busy 1 s + 0.5 s, one drained: (1 queued + 1) x 1.5 s
        (9.0, 2.0),  # the first spell half out of the window: busy 0.5 s + 0.5 s
    ],
)
async def test_an_idle_spell_inside_the_drain_window_is_not_busy_time(
    idle: float, advised: float
) -> None:
    clock = Clock()
    b = Backend("a", limit=1)
    pick = first_with_room(b)
    adm = pool(clock, depth=1)
    first = await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    clock.now += 1.0
    first.release(Outcome.SUCCESS)
    clock.now += idle  # nothing asked, nothing drained
    held_lease = await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    clock.now += 0.5
    async with anyio.create_task_group() as tg:
        tg.start_soon(park, adm, pick)
        await wait_all_tasks_blocked()
        with pytest.raises(QueueFull) as refused:
            await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
        assert refused.value.retry_after == pytest.approx(advised)
        tg.cancel_scope.cancel()
    held_lease.release(Outcome.SUCCESS)


@pytest.mark.anyio
async def test_busy_spells_add_up_across_idle_gaps() -> None:
    clock = Clock()
    b = Backend("a", limit=1)
    pick = first_with_room(b)
    adm = pool(clock, depth=0)
    for _ in range(3):  # 1 s busy, 2 s idle, three times: 3 s busy, 3 drained
        lease = await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
        clock.now += 1.0
        lease.release(Outcome.SUCCESS)
        clock.now += 2.0
    assert adm.retry_after() == 1.0  # 1 s per request, nobody queued
    holder = await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    clock.now += 3.0  # a long one
    with pytest.raises(QueueFull) as refused:
        await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)
    # The window, the last 10 s: two earlier spells (1 s each, one drained each) and 3 s
    # of this one: 5 s busy, two drained. Before: 10 s (idle gaps too) for two.
    assert refused.value.retry_after == pytest.approx(5.0 / 2)
    holder.release(Outcome.SUCCESS)


# --- through the gateway -------------------------------------------------------------


@pytest.fixture
def raw(tmp_path: Path) -> Any:
    yield from served(start_raw_sse(tmp_path))


def test_the_429s_after_a_short_idle_spell_advise_the_busy_drain_rate(
    tmp_path: Path, raw: Proc
) -> None:
    config = {
        "backends": [backend("b", raw.url, limit=STATIC_1)],
        "pools": {"short": {"max_queue_depth": 1, "max_queue_wait_s": 30}},
        "health": {"interval_s": 60},
        "routing": {"token_budget": {"enabled": False}},
    }
    gw = start_gateway(tmp_path, config)
    quick = chat([["send", HEAD + sse("a") + "data: [DONE]\n\n"], ["close"]])
    client = httpx.Client(timeout=30)
    try:
        assert client.post(gw.url + CHAT, json=quick).status_code == 200  # drained in ms
        time.sleep(3.0)  # the scenario, not a wait for anything: an idle spell
        hold = held(client, gw, quick["model"])
        with ThreadPoolExecutor(1) as threads:
            queued = threads.submit(httpx.post, gw.url + CHAT, json=quick, timeout=30)
            wait_until(lambda: gw.state()["pools"]["short"]["queue_depth"] == 1, timeout=10)
            refused = client.post(gw.url + CHAT, json=quick)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "queue_full"
            # Busy well under a second, one drained: (1 queued + 1) x that, at least 1 s.
            # Before: the 3 s idle counted as busy, so 6.
            assert int(refused.headers["retry-after"]) <= 2, refused.headers["retry-after"]
            poke(raw, 1)
            assert b"".join(hold).endswith(b"[DONE]\n\n")
            assert queued.result(timeout=30).status_code == 200
    finally:
        client.close()
        gw.proc.stop()


@pytest.mark.anyio
async def test_the_busy_time_kept_as_a_sum_is_the_spells_within_the_window() -> None:
    """The busy time a refusal reads is a running sum, not a walk over every spell (a pool
    at low load makes one per request): the same as the spells' overlap with the window,
    over 2,000 random lease/release steps."""
    rng = random.Random(7)
    clock = Clock()
    b = Backend("a", limit=3)
    pick = first_with_room(b)
    adm = pool(clock, depth=1)
    leases = []
    spells: list[list[float]] = []  # [start, end]; end is -1 while it runs
    for _ in range(2000):
        clock.now += rng.choice((0.0, 0.01, 0.3, 2.0, 7.0))
        if leases and (len(leases) == 3 or rng.random() < 0.5):
            leases.pop(rng.randrange(len(leases))).release(Outcome.SUCCESS)
            if not leases:
                spells[-1][1] = clock.now
        else:
            if not leases:
                spells.append([clock.now, -1.0])
            leases.append(await adm.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR))
        horizon = clock.now - 10.0
        expected = sum(
            (clock.now if end < 0 else end) - max(start, horizon)
            for start, end in spells
            if end < 0 or end > horizon
        )
        assert adm._busy_time(clock.now) == pytest.approx(expected, abs=1e-9)
