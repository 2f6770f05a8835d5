"""Waiting for a condition in async tests without sleeping as synchronisation."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def eventually(condition: Callable[[], bool], failure: str, timeout_s: float = 10.0) -> None:
    """Polls ``condition`` until it holds; fails after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, failure
        await asyncio.sleep(0.001)
