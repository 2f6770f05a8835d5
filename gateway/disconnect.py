"""Cancel a request's handler when its client hangs up, without paying for it on fast requests.

uvicorn never cancels a handler whose client went away: a request waiting for
admission would hold its queue place until its deadline, a non-streamed one
would keep its engine busy, a stream whose backend is between tokens would
notice only at the next token. One watcher task per request fixes that, but a
task, its first ``receive()`` and its cancellation cost a quarter of a short
proxied request's CPU. So the watcher is armed only once the request has lasted
``grace_s``: what ends sooner never pays for it, and a client that hangs up is
noticed at most ``grace_s`` late.

The cancellation lands in the handler's task, wherever it is (queued, waiting
for the upstream, relaying); the code there releases what it holds on the way
out. ``finished`` must be set once the response is complete: uvicorn then
reports a disconnect to ``receive()`` although nobody left.
"""

from __future__ import annotations

import asyncio

from starlette.types import Receive

GRACE_S = 0.005


class DisconnectWatch:
    def __init__(self, receive: Receive, grace_s: float = GRACE_S) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._receive = receive
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(grace_s, self._arm)
        self._watcher: asyncio.Task[None] | None = None
        self.finished = False
        self.left = False  # the client hung up before the response was complete

    def _arm(self) -> None:
        self._timer = None
        if not self.finished:
            self._watcher = self._loop.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                if not self.finished:
                    self.left = True
                    self._task.cancel()
                return

    def close(self) -> None:
        self.finished = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
