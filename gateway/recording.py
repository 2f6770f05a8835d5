"""Where a finished request's measurements go: Prometheus and its backend's window.

Called once per request, at its end (never per chunk). The clock is the
relay's: ``time.perf_counter``, monotonic, the same one the meter timed with.

The end is stamped at once, but the bookkeeping (histograms, windows, the recent
list) runs a moment later, in batches. A closed-loop client sends its next
request the instant the last byte of its previous answer arrives; done in line,
that bookkeeping (~0.2 ms with cold caches) ran between the gateway's last write
and its next read, and the next request waited for it (measured: send → parse
p50 0.43 ms instead of 0.24). Whoever reads the measurements (``/metrics``,
``/admin/*``, the limit controllers' tick, shutdown) calls :meth:`Recorder.flush`
first, so nothing ever reads a stale figure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from backends.replica import Replica
from gateway.meter import StreamMeter, Usage
from gateway.metrics import GatewayMetrics
from gateway.record import RejectReason, RequestRecord, RequestStatus

log = logging.getLogger("kneecap")

# Long enough that a client's next request is read first, short enough that a batch
# stays small (at 5,000 requests/s: ~10 records, well under a millisecond).
SETTLE_S = 0.002

# Ends that say nothing of how long the first token would have taken: the answer came
# (a stream ending "ok" without output answered nothing, in time), or the backend refused
# the request itself.
_UNCENSORED = frozenset(("ok", "client_error"))


@dataclass(slots=True)
class Flight:
    """One request's routing facts, fixed once it is admitted."""

    pool: str
    model: str
    stream: bool
    started: float  # receipt, perf_counter
    request_id: str = ""
    admitted: float = 0.0  # the (last) admission to a backend, perf_counter
    sent: float = 0.0  # the (last) upstream request written, perf_counter; 0: none was
    waited: float = 0.0  # seconds spent in admission queues, over all attempts
    failed: float = 0.0  # seconds spent on failed attempts, each from its admission on
    overhead: float = 0.0  # the gateway's own seconds before the (last) write
    # Seconds it waited, read, for the answer before it on its connection to end.
    pipelined: float = 0.0
    # The attempt admitted last failed, or answered without a stream: its end bounds no
    # first token (a record made after it, e.g. the client gone while a retry waited, adds
    # no censored TTFT).
    attempt_over: bool = False

    def mark_sent(self, on_wire: bool = True) -> None:
        """The upstream request is on the wire now, or (False) its write was lost."""
        if not on_wire:
            self.sent = 0.0
            return
        self.sent = time.perf_counter()
        # Taken now: were this attempt to fail, its time would not be the gateway's own.
        spent = self.waited + self.failed + self.pipelined
        self.overhead = max(0.0, self.sent - self.started - spent)

    def attempt_failed(self) -> None:
        """The attempt admitted last has failed (its lease is back): its time, spent on a
        backend that failed it, is neither queue wait nor the gateway's own."""
        self.failed += time.perf_counter() - self.admitted
        self.attempt_over = True


class _Finished(NamedTuple):
    flight: Flight
    replica: Replica
    status: RequestStatus
    meter: StreamMeter | None
    usage: Usage | None
    finish_reason: str | None
    end: float  # perf_counter when the request ended


class Recorder:
    def __init__(
        self,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.perf_counter,
        keep_recent: int = 256,
        settle_s: float | None = None,
    ) -> None:
        """``settle_s``: record that long after the end, in a batch; None: at once."""
        self.metrics = metrics
        self.clock = clock
        self.settle_s = settle_s
        self._pending: list[_Finished] = []
        self._timer: asyncio.TimerHandle | None = None
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
        finished = _Finished(flight, replica, status, meter, usage, finish_reason, self.clock())
        if self.settle_s is None:
            self._record(finished)
            return
        self._pending.append(finished)
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = loop.call_later(self.settle_s, self.flush)

    def flush(self) -> None:
        """Record every finished request now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, []
        for finished in pending:
            try:
                self._record(finished)
            except Exception:  # one bad record must not lose the others
                log.exception("recording request %s failed", finished.flight.request_id)

    def _record(self, finished: _Finished) -> None:
        flight, replica, status, meter, usage, finish_reason, end = finished
        if meter is not None:
            usage = meter.usage
            finish_reason = meter.finish_reason
        ttft = meter.ttft if meter is not None else None
        upstream_s = flight.sent - flight.started if flight.sent else None
        gaps = meter.token_gaps() if meter is not None else []
        record = RequestRecord(
            backend=replica.name,
            pool=flight.pool,
            model=flight.model,
            status=status,
            stream=flight.stream,
            finish_reason=finish_reason,
            queue_s=flight.waited,
            upstream_s=upstream_s,
            overhead_s=None if upstream_s is None else flight.overhead,
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
            meter.flush(end, final=True)  # the window's ITL and tokens become this record's
        if (
            ttft is None
            and flight.stream
            and flight.sent
            and not flight.attempt_over
            and (meter is None or meter.metered)
            and status not in _UNCENSORED
        ):
            # A stream that reached the backend and ended (gave up on, cut, failed) before
            # any output: its TTFT, counted from admission as the meter's, is longer than
            # this. Without it the window's TTFT would be the survivors' (see gateway.window).
            window.add_censored_ttft(end, end - flight.admitted)
        if status == "ok":
            window.add_completed(end)
            if meter is None and usage is not None:  # a stream's the final flush counted
                window.add_tokens(end, usage.completion_tokens)
            ratio = meter.tokens_per_event if meter is not None else None
            if ratio is not None:
                window.learn_tokens_per_event(ratio)

    def rejected(self, pool: str, reason: RejectReason) -> None:
        self.metrics.observe_rejection(pool, reason)

    def retried(self, replica: Replica) -> None:
        self.metrics.observe_retry(replica.name)
