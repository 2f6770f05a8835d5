"""Background loops that outlive their own failures.

Health probes, engine scrapes, the limit controllers' tick and the config
watcher run in the lifespan's task group. An exception escaping one of them
would cancel the group, and closing it closes admission, while uvicorn went on
answering ``/health`` 200: a gateway that looks alive and refuses everything.
So each loop is restarted after a pause instead, its failure logged.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio

log = logging.getLogger("kneecap")

RESTART_PAUSE_S = 1.0


async def keep_running(
    name: str, loop: Callable[[], Awaitable[None]], pause_s: float = RESTART_PAUSE_S
) -> None:
    """Run ``loop()`` until it returns; restart it ``pause_s`` after each failure."""
    while True:
        try:
            await loop()
            return
        except Exception:
            log.exception("%s failed; restarting it in %g s", name, pause_s)
        await anyio.sleep(pause_s)
