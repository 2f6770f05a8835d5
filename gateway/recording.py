"""Where a finished request's measurements go: Prometheus and its backend's window.

Called once per request, at its end (never per chunk). The clock is the
relay's: ``time.perf_counter``, monotonic, the same one the meter timed with.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from backends.replica import Replica
from gateway.meter import StreamMeter, Usage
from gateway.metrics import GatewayMetrics
from gateway.record import RejectReason, RequestRecord, RequestStatus


@dataclass(slots=True)
class Flight:
    """One request's routing facts, fixed once it is admitted."""

    pool: str
    model: str
    stream: bool
    started: float  # receipt, perf_counter
    request_id: str = ""
    admitted: float = 0.0  # admission to a backend, perf_counter


class Recorder:
    def __init__(
        self,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.perf_counter,
        keep_recent: int = 256,
    ) -> None:
        self.metrics = metrics
        self.clock = clock
        # The last requests, for GET /admin/requests: what one request actually measured.
        self.recent: deque[RequestRecord] = deque(maxlen=keep_recent)

    def finished(
        self,
        flight: Flight,
        replica: Replica,
        status: RequestStatus,
        *,
        meter: StreamMeter | None = None,
        usage: Usage | None = None,
        finish_reason: str | None = None,
    ) -> None:
        end = self.clock()
        if meter is not None:
            usage = meter.usage
            finish_reason = meter.finish_reason
        ttft = meter.ttft if meter is not None else None
        gaps = meter.token_gaps() if meter is not None else []
        record = RequestRecord(
            backend=replica.name,
            pool=flight.pool,
            model=flight.model,
            status=status,
            stream=flight.stream,
            finish_reason=finish_reason,
            queue_s=flight.admitted - flight.started,
            ttft_s=ttft,
            itl_s=gaps,
            e2e_s=end - flight.started,
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None,
            request_id=flight.request_id,
        )
        self.metrics.observe_request(record)
        self.recent.append(record)
        window = replica.window
        if meter is not None:
            meter.flush(end)
        if status == "ok":
            window.add_completed(end)
            # Usage is exact; the live feed counted output events, which may be fewer.
            counted = meter.flushed_events if meter is not None else 0
            if usage and usage.completion_tokens > counted:
                window.add_tokens(end, usage.completion_tokens - counted)

    def rejected(self, pool: str, reason: RejectReason) -> None:
        self.metrics.observe_rejection(pool, reason)

    def retried(self, replica: Replica) -> None:
        self.metrics.observe_retry(replica.name)
