"""The conftest stops what a test started and left running, e.g. when a later start failed.

The second test reads what the first left behind, so they run in file order.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.procs import start_gateway, start_raw_sse

left_behind: list[int] = []


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has ended; the conftest reaps what it stops, so this is belt and braces.
    return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"


def test_a_backend_started_before_a_gateway_that_fails_to_start(tmp_path: Path) -> None:
    backend = start_raw_sse(tmp_path)
    left_behind.append(backend.pid)
    with pytest.raises(RuntimeError, match="exited"):
        start_gateway(tmp_path, {"backends": "not a list"})
    assert _runs(backend.pid)


def test_is_stopped_once_that_test_ends() -> None:
    if not left_behind:  # selected alone (-k) or reordered: nothing to look at
        pytest.skip("reads what the test above left behind")
    assert not any(_runs(pid) for pid in left_behind)
