"""Start-up's objects are kept out of the collector's full passes (``gc.freeze``).

A full pass over everything the gateway imported and built took 59 ms under the relay
bench's paced load: a pause every stream took at once. Run in a child process, since
freezing is process-wide.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import gc
from starlette.testclient import TestClient
from gateway.app import create_app
from gateway.settings import Settings

app = create_app(Settings(backends=()))
before = gc.get_freeze_count()
with TestClient(app) as client:
    assert client.get("/health").status_code == 200
    print(before, gc.get_freeze_count())
"""


def test_the_lifespan_freezes_what_start_up_built() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    before, after = map(int, result.stdout.split())
    assert before == 0
    # The gateway's modules alone are tens of thousands of objects.
    assert after > 20_000, after
