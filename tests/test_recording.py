"""The recorder stamps a request's end at once and records it a moment later, in a batch;
readers flush first, so nothing reads a stale figure."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from backends.replica import Replica
from gateway.metrics import GatewayMetrics
from gateway.recording import Flight, Recorder
from gateway.settings import BackendConfig
from tests.polling import eventually


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(settle_s: float | None) -> tuple[Recorder, Clock, Replica, CollectorRegistry]:
    registry = CollectorRegistry()
    clock = Clock()
    recorder = Recorder(GatewayMetrics(registry), clock=clock, settle_s=settle_s)
    replica = Replica(BackendConfig(name="r0", url="http://127.0.0.1:1"), "http://127.0.0.1:1")
    recorder.metrics.register_backend("r0", "default")
    return recorder, clock, replica, registry


def flight(request_id: str, started: float) -> Flight:
    return Flight(
        pool="default",
        model="m",
        stream=False,
        started=started,
        request_id=request_id,
        admitted=started,
    )


def e2e_count(registry: CollectorRegistry) -> float:
    labels = {"backend": "r0", "pool": "default", "model": "m"}
    return registry.get_sample_value("kneecap_request_e2e_seconds_count", labels) or 0.0


def test_recorded_later_with_the_end_stamped_at_once() -> None:
    async def scenario() -> None:
        recorder, clock, replica, registry = make(settle_s=3600)
        recorder.finished(flight("a", started=99.0), replica, "ok")
        clock.now = 250.0  # the bookkeeping runs long after the request ended
        assert e2e_count(registry) == 0 and not recorder.recent
        recorder.flush()
        assert e2e_count(registry) == 1
        (record,) = recorder.recent
        assert record.request_id == "a" and record.e2e_s == 1.0
        recorder.flush()  # nothing left: nothing counted twice
        assert e2e_count(registry) == 1

    asyncio.run(scenario())


def test_the_timer_records_a_batch_in_order() -> None:
    async def scenario() -> None:
        recorder, _, replica, registry = make(settle_s=0.001)
        for name in "abc":
            recorder.finished(flight(name, started=99.0), replica, "ok")
        await eventually(lambda: bool(recorder.recent), "the timer never recorded the batch")
        assert [r.request_id for r in recorder.recent] == ["a", "b", "c"]
        assert e2e_count(registry) == 3

    asyncio.run(scenario())


def test_outside_an_event_loop_or_without_settle_it_records_at_once() -> None:
    for settle_s in (None, 0.002):
        recorder, _, replica, registry = make(settle_s=settle_s)
        recorder.finished(flight("a", started=99.0), replica, "ok")
        assert e2e_count(registry) == 1 and len(recorder.recent) == 1


def test_one_failing_record_does_not_lose_the_others() -> None:
    class BrokenMeter:
        usage = None
        finish_reason = None
        ttft = None

        def token_gaps(self) -> list[float]:
            raise RuntimeError("broken")

    async def scenario() -> None:
        recorder, _, replica, registry = make(settle_s=3600)
        recorder.finished(flight("a", started=99.0), replica, "ok")
        recorder.finished(flight("b", 99.0), replica, "ok", meter=BrokenMeter())  # type: ignore[arg-type]
        recorder.finished(flight("c", started=99.0), replica, "ok")
        recorder.flush()
        assert [r.request_id for r in recorder.recent] == ["a", "c"]
        assert e2e_count(registry) == 2

    asyncio.run(scenario())
