"""Shutdown in two steps: requests get time to finish, then what is left is answered.

SIGTERM or Ctrl-C makes uvicorn stop accepting connections and wait for the
requests in flight, and those still queued for admission, to finish. After
``listen.drain_timeout_s`` (or at a second signal) the queues are closed: a
request still waiting for a permit is answered 503 ``shutting_down``, which its
client can retry elsewhere, instead of being cut without an answer when uvicorn
cancels what still runs, ``STOP_GRACE_S`` later.
"""

from __future__ import annotations

from collections.abc import Callable

# Between closing the queues and uvicorn cancelling the handlers: enough loop turns
# for the queued requests' 503 answers to be written.
STOP_GRACE_S = 1.0


class Drain:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.stopped = False
        self._on_stop: list[Callable[[], None]] = []

    def on_stop(self, callback: Callable[[], None]) -> None:
        self._on_stop.append(callback)

    def stop(self) -> None:
        """The drain is over: refuse what still waits (once)."""
        if self.stopped:
            return
        self.stopped = True
        for callback in self._on_stop:
            callback()
