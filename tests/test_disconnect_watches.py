"""Disconnect watches share one timer: each is armed ``grace_s`` after its request began,
in the order they began, unless its response was complete by then."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.disconnect import DisconnectWatch, DisconnectWatches

pytestmark = pytest.mark.anyio
WAIT_S = 5.0  # a bound on each wait, not a pace: armed watches are seen in milliseconds


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Client:
    """An ASGI ``receive`` that reports a disconnect once the client has left."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()  # a watcher is reading: the watch was armed
        self.gone = asyncio.Event()
        self.receives = 0

    async def __call__(self) -> dict[str, Any]:
        self.receives += 1
        self.asked.set()
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def watched(watches: DisconnectWatches, client: Client) -> DisconnectWatch:
    """A watch made as a request's handler makes it: from inside the request's task."""
    return watches.watch(client)


async def test_a_request_that_outlasts_the_grace_is_cancelled_when_its_client_leaves() -> None:
    watches = DisconnectWatches(grace_s=0.01)
    client = Client()
    watches_made: list[DisconnectWatch] = []

    async def handler() -> None:
        watch = watches.watch(client)
        watches_made.append(watch)
        try:
            await asyncio.Event().wait()  # a request waiting on its backend
        finally:
            watch.close()

    task = asyncio.get_running_loop().create_task(handler())
    await asyncio.wait_for(client.asked.wait(), WAIT_S)  # armed once the grace is over
    client.gone.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert watches_made[0].left


async def test_watches_fall_due_in_order_and_finished_ones_are_never_armed() -> None:
    watches = DisconnectWatches(grace_s=0.01)
    clients = [Client() for _ in range(4)]
    loop = asyncio.get_running_loop()
    made = [await loop.create_task(watched(watches, c)) for c in clients]
    made[1].close()  # its response was complete within the grace: no watcher
    made[3].close()
    assert watches._timer is not None  # one timer for all four
    await asyncio.wait_for(clients[2].asked.wait(), WAIT_S)  # the last one armed
    assert watches._timer is None  # none left to fall due
    assert [c.receives for c in clients] == [1, 0, 1, 0]
    assert [w._watcher is not None for w in made] == [True, False, True, False]
    for watch in made:
        watch.close()
    assert all(w._watcher is None for w in made)


async def test_a_watch_made_after_the_others_fell_due_gets_the_timer_back() -> None:
    watches = DisconnectWatches(grace_s=0.005)
    loop = asyncio.get_running_loop()
    first_client, later_client = Client(), Client()
    first = await loop.create_task(watched(watches, first_client))
    await asyncio.wait_for(first_client.asked.wait(), WAIT_S)
    assert watches._timer is None
    later = await loop.create_task(watched(watches, later_client))
    assert watches._timer is not None
    await asyncio.wait_for(later_client.asked.wait(), WAIT_S)
    first.close()
    later.close()


def test_a_gateway_served_again_on_a_new_loop_arms_its_watches() -> None:
    watches = DisconnectWatches(grace_s=0.005)

    async def end_before_the_timer() -> None:
        watches.watch(Client())

    asyncio.run(end_before_the_timer())  # its loop closes with the timer still pending

    async def watched_on_a_new_loop() -> None:
        client = Client()
        watches.watch(client)
        await asyncio.wait_for(client.asked.wait(), WAIT_S)

    asyncio.run(watched_on_a_new_loop())
