"""Cancel a request's handler when its client hangs up, without paying for it on fast requests.

uvicorn never cancels a handler whose client went away: a request waiting for
admission would hold its queue place until its deadline, a non-streamed one
would keep its engine busy, a stream whose backend is between tokens would
notice only at the next token. One watcher task per request fixes that, but a
task, its first ``receive()`` and its cancellation cost a quarter of a short
proxied request's CPU. So the watcher is armed only once the request has lasted
``grace_s``: what ends sooner never pays for it, and a client that hangs up is
noticed at most ``grace_s`` late.

The watches share one timer (:class:`DisconnectWatches`): a timer per request,
made and cancelled by nearly every request, cost ~5 % of a short request's CPU. As
every watch waits the same ``grace_s``, they fall due in the order they began.

The cancellation lands in the handler's task, wherever it is (queued, waiting
for the upstream, relaying); the code there releases what it holds on the way
out. ``finished`` must be set once the response is complete: uvicorn then
reports a disconnect to ``receive()`` although nobody left.
"""

from __future__ import annotations

import asyncio
from collections import deque

from starlette.types import Receive

GRACE_S = 0.005


class DisconnectWatch:
    __slots__ = ("_receive", "_task", "_watcher", "finished", "left")

    def __init__(self, task: asyncio.Task[object], receive: Receive) -> None:
        self._task = task
        self._receive = receive
        self._watcher: asyncio.Task[None] | None = None
        self.finished = False
        self.left = False  # the client hung up before the response was complete

    def arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """The request has lasted ``grace_s``: watch its client from now on, unless done."""
        if not self.finished:
            self._watcher = loop.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                if not self.finished:
                    self.left = True
                    self._task.cancel()
                return

    def close(self) -> None:
        self.finished = True  # a watch not armed yet never will be
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None


class DisconnectWatches:
    """The watches of one event loop's requests, each armed ``grace_s`` after it began."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self._due: deque[tuple[float, DisconnectWatch]] = deque()  # in the order they fall due
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def watch(self, receive: Receive) -> DisconnectWatch:
        """A watch on the running task's client, armed ``grace_s`` from now."""
        task = asyncio.current_task()
        assert task is not None
        watch = DisconnectWatch(task, receive)
        loop = task.get_loop()
        if loop is not self._loop:  # a gateway served again on a new loop: the old one's
            self._loop, self._timer = loop, None  # timer and requests are gone with it
            self._due.clear()
        due = loop.time() + self.grace_s
        self._due.append((due, watch))
        if self._timer is None:
            self._timer = loop.call_at(due, self._arm_due)
        return watch

    def _arm_due(self) -> None:
        loop = self._loop
        assert loop is not None
        now, due = loop.time(), self._due
        while due and due[0][0] <= now:
            due.popleft()[1].arm(loop)
        self._timer = loop.call_at(due[0][0], self._arm_due) if due else None
