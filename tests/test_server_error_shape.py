"""What a Starlette-served route did not expect is answered like the proxied endpoints'
500: an OpenAI error with the request id and, for a browser, the CORS headers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.instrumented_gateway import FAILING_PATH, start_instrumented_gateway
from tests.procs import Proc, backend, start_sim

APP = "https://app.example"


@pytest.fixture
def gw(tmp_path: Path) -> Iterator[Proc]:
    """The product's app and server, with one route that raises: the product itself has no
    500 left to cause (the last, a malformed OpenMetrics Accept on /metrics, is answered)."""
    sim = start_sim(tmp_path, ttft_ms=5, itl_ms=2)
    try:
        gateway, _ = start_instrumented_gateway(tmp_path, {"backends": [backend("s", sim.url)]})
        try:
            yield gateway
        finally:
            gateway.stop()
    finally:
        sim.stop()


def test_an_unexpected_failure_is_an_openai_500(gw: Proc) -> None:
    url = gw.url + FAILING_PATH
    answer = httpx.get(url, headers={"origin": APP}, timeout=5)
    assert answer.status_code == 500
    assert answer.headers["content-type"] == "application/json"
    assert answer.json() == {
        "error": {
            "message": "the gateway failed to handle this request",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
    assert answer.headers["access-control-allow-origin"] == "*"
    given = httpx.get(url, headers={"x-request-id": "r-1"}, timeout=5)
    assert given.status_code == 500
    assert given.headers["x-request-id"] == "r-1"
    # The traceback is logged; the gateway goes on serving.
    assert httpx.get(gw.url + "/metrics", timeout=5).status_code == 200
    assert "UnexpectedFailure" in gw.output()
