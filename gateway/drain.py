"""Shutdown in two steps: requests get time to finish, then what is left is answered.

SIGTERM or Ctrl-C makes uvicorn stop accepting connections and wait for the
requests in flight, and those still queued for admission, to finish. After
``listen.drain_timeout_s`` (or at a second signal) the drain stops: a request still
waiting for a permit is answered 503 ``shutting_down``, which its client can retry
elsewhere, and a stream still going ends with a last SSE error event
``shutting_down``, at an event boundary, so that its client knows why it ended.
What still runs ``STOP_GRACE_S`` later (a whole answer still awaited from its backend)
uvicorn cancels.

The streams are cut by cancelling the tasks relaying them, which the relay turns into
that clean end: nothing is checked per chunk, and a stream whose client stopped
reading is cut as promptly as one whose backend is between two tokens.

What the drain's end cuts, streamed or whole, is counted ``gateway_shutdown``: counted as
``client_closed``, a deploy would read on the dashboard as users giving up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

# Between the drain's end and uvicorn cancelling the handlers: enough loop turns for the
# queued requests' 503 answers and the cut streams' last events to be written.
STOP_GRACE_S = 1.0
# How long a cut stream may take to write its last event: a client that reads nothing
# does not get it, and must not hold the stream until uvicorn cancels it.
CUT_WRITE_S = STOP_GRACE_S / 2
# The key of the lifespan state (and so of each request's ``scope["state"]``) naming
# the :class:`Drain`.
DRAIN_STATE_KEY = "drain"


class Drain:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.stopped = False
        self._on_stop: list[Callable[[], None]] = []
        self._streams: set[asyncio.Task[Any]] = set()

    def on_stop(self, callback: Callable[[], None]) -> None:
        self._on_stop.append(callback)

    def streaming(self, task: asyncio.Task[Any]) -> None:
        """``task`` relays a stream until :meth:`streamed`: the drain's end cancels it."""
        self._streams.add(task)
        if self.stopped:  # its backend answered after the drain's end: cut it at once
            task.cancel()

    def streamed(self, task: asyncio.Task[Any]) -> None:
        self._streams.discard(task)

    @property
    def streams(self) -> int:
        """How many streams the drain's end would cut now."""
        return len(self._streams)

    def stop(self) -> None:
        """The drain is over: refuse what still waits, cut what still streams (once)."""
        if self.stopped:
            return
        self.stopped = True
        for callback in self._on_stop:
            callback()
        for task in self._streams:
            task.cancel()
