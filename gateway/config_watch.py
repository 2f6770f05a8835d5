"""Optional: reload when the config file changes (stat polling, no extra dependency).

A file written in place (shell ``>``, ``envsubst >``, ``tee``, an editor saving over
it; the only writes a bind-mounted single file receives) passes through states its
author never meant: empty, then half written. So a change is applied only once the
file has held still for a whole poll: its mtime, size and inode the same at two polls
in a row. A slower writer can still be caught mid-way; what it leaves is then refused
or harmless (see :meth:`Runtime.reload`: an empty file, or one silent on
``watch_config``, cannot switch the watcher off), and its last write is applied.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio

from gateway.runtime import Runtime

log = logging.getLogger("kneecap.config")
POLL_INTERVAL_S = 1.0

Signature = tuple[int, int, int] | None  # (mtime_ns, size, inode); None: cannot stat


async def watch_config_file(runtime: Runtime) -> None:
    """Polls while the live config says ``watch_config``: a reload can turn it on or off."""
    path = runtime.config_path
    if path is None:
        return
    applied = _signature(path)
    pending: Signature = applied
    while True:
        await anyio.sleep(POLL_INTERVAL_S)
        current = _signature(path)
        if current == applied:
            pending = applied
            continue
        if current != pending:  # still changing, or changed for the first time: wait
            pending = current
            log.debug("config file %s changed; applying it once it holds still", path)
            continue
        applied = current
        if runtime.current.settings.watch_config:
            runtime.reload()


def _signature(path: Path) -> Signature:
    try:
        st = path.stat()  # follows symlinks: a ConfigMap's ..data swap changes the target
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)
