"""Optional: reload when the config file changes (mtime polling, no extra dependency)."""

from __future__ import annotations

import logging

import anyio

from gateway.runtime import Runtime

log = logging.getLogger("kneecap.config")
POLL_INTERVAL_S = 1.0


async def watch_config_file(runtime: Runtime) -> None:
    """Polls while the live config says ``watch_config``: a reload can turn it on or off."""
    path = runtime.config_path
    if path is None:
        return
    last = _mtime(path)
    while True:
        await anyio.sleep(POLL_INTERVAL_S)
        current = _mtime(path)
        if current != last:
            last = current
            if runtime.current.settings.watch_config:
                runtime.reload()


def _mtime(path: anyio.Path | object) -> float | None:
    try:
        return path.stat().st_mtime  # type: ignore[attr-defined]
    except OSError:
        return None
