"""A whole answer gives its backend's permit back, whatever cancel lands in its upstream's close.

An ``https://`` backend's body is closed by awaiting httpx; a cancel landing in that wait
(the client gone, the drain's end, uvicorn's own cancel after its grace) used to skip the
record and the release after it: the permit was lost for good, and the backend's limit
one lower until a restart.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.metrics import GatewayMetrics
from gateway.proxy_finish import buffered
from gateway.recording import Flight, Recorder
from gateway.runtime import Runtime, Snapshot
from gateway.settings import Settings
from gateway.upstream import UpstreamTransport
from gateway.upstream_response import UpstreamResponse
from policies.admission import Priority
from policies.token_budget import Claim
from tests.procs import MODEL, backend
from tests.test_drain_cut import SlowToClose

ANSWER = b'{"choices": []}'  # no usage: nothing to calibrate, so no route needed


class StalledThenSlowToClose(SlowToClose):
    """An answer that never comes, from an upstream whose close takes long."""

    def __init__(self) -> None:
        super().__init__([])
        self.reading = asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        self.reading.set()
        await asyncio.Event().wait()
        yield b""  # pragma: no cover


def runtime() -> Runtime:
    settings = Settings.model_validate({"backends": [backend("b", "http://127.0.0.1:9")]})
    registry = CollectorRegistry()
    return Runtime(
        current=Snapshot.build(settings, None, {}),
        client=httpx.AsyncClient(),
        transport=UpstreamTransport(max_connections=1),
        recorder=Recorder(GatewayMetrics(registry)),
        metrics_registry=registry,
    )


def requests(rt: Runtime, status: str) -> float | None:
    labels = {"backend": "b", "pool": "short", "model": MODEL, "status": status}
    return rt.metrics_registry.get_sample_value("kneecap_requests_total", labels)


# Where the cancel lands: the answer was read whole, or the client left first (one cancel
# into the read) and a second came while the close was awaited.
CUTS = {"after the answer": ("ok", 1), "after the client left": ("client_closed", 2)}


@pytest.mark.parametrize(("status", "cancels"), CUTS.values(), ids=CUTS)
def test_a_cancel_landing_in_the_upstream_close_still_releases_the_permit(
    status: str, cancels: int
) -> None:
    rt = runtime()
    replica = rt.current.backends.replicas[0]
    replica.healthy = True
    flight = Flight(pool=replica.pool, model=MODEL, stream=False, started=time.perf_counter())
    body = SlowToClose([ANSWER]) if cancels == 1 else StalledThenSlowToClose()
    upstream = UpstreamResponse(200, [(b"content-type", b"application/json")], body)  # type: ignore[arg-type]

    async def scenario() -> None:
        lease = await rt.admission(replica.pool).acquire(
            lambda: Claim(replica, 1), priority=Priority.INTERACTIVE, deadline=time.monotonic() + 5
        )
        assert replica.in_flight == 1
        answer = asyncio.ensure_future(buffered(rt, flight, None, upstream, lease, {}))  # type: ignore[arg-type]
        if cancels == 2:
            await asyncio.wait_for(body.reading.wait(), 5)  # type: ignore[union-attr]
            answer.cancel()  # the client leaves
        await asyncio.wait_for(body.closing.wait(), 5)
        answer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(answer, 5)
        assert lease.released

    asyncio.run(scenario())
    assert replica.in_flight == 0, "the backend's permit was never given back"
    rt.recorder.flush()
    assert requests(rt, status) == 1
