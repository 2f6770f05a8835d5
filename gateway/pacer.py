"""A background loop's pause that a config reload can shorten."""

from __future__ import annotations

from collections.abc import Callable

import anyio


class Pacer:
    """A background loop's pause: its interval, read from the live config. A reload wakes
    it (:meth:`wake`), so a changed interval counts at once from when the pause began,
    instead of after the old interval has run out."""

    def __init__(self, interval_s: Callable[[], float]) -> None:
        self._interval_s = interval_s
        self._wake = anyio.Event()

    def wake(self) -> None:
        self._wake.set()

    async def sleep(self) -> None:
        start = anyio.current_time()
        while True:
            self._wake = anyio.Event()  # the interval is read after: no wake is lost
            left = start + self._interval_s() - anyio.current_time()
            if left <= 0:
                return
            with anyio.move_on_after(left):
                await self._wake.wait()
