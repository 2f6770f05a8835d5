"""What the relay knows about one finished request, handed to metrics once at its end.

The relay fills a :class:`RequestRecord` after the last byte (or the failure) and
passes it to :meth:`gateway.metrics.GatewayMetrics.observe_request`; nothing is
recorded per chunk, so the cost of metrics does not grow with stream length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

# One value per way a request that reached a backend can end; the label values of
# ``kneecap_requests_total{status}``. Kept small on purpose: it is a metric label.
RequestStatus = Literal[
    "ok",  # the backend answered 2xx and the body reached the client
    "client_closed",  # the client went away before the end
    "gateway_shutdown",  # cut by the shutdown drain's end: neither the client nor the backend
    "client_error",  # the backend refused the request (4xx): the request's fault
    "upstream_error",  # connection failure or 5xx from the backend
    "upstream_timeout",  # connect timeout or a stall longer than the read timeout
]
REQUEST_STATUSES: tuple[RequestStatus, ...] = get_args(RequestStatus)

# Why a request never reached a backend: ``kneecap_rejected_requests_total{reason}``.
# Every reason is pre-created at zero per pool so rate() panels are never blank.
RejectReason = Literal[
    "queue_full",  # the pool's bounded queue had no room
    "queue_timeout",  # waited longer than the pool's queue timeout
    "no_backend",  # no healthy backend serves this pool/model
    "shutting_down",  # the gateway is draining
    "gateway_overloaded",  # the gateway had no descriptor, memory or connection to send it
]
REJECT_REASONS: tuple[RejectReason, ...] = get_args(RejectReason)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One admitted request, measured with a monotonic clock.

    Times are seconds. ``queue_s`` is the time spent waiting for admission, summed
    over a retried request's attempts; ``upstream_s`` runs from receipt until its
    request was written to the backend that answered (queue wait, failed attempts,
    connecting, and a pipelined request's wait for the answer before it on its
    connection included; ``None`` when the request was never written), ``overhead_s``
    the same less the queue waits, the failed attempts and that pipelining wait: the
    gateway's own share of the TTFT.
    ``ttft_s`` runs from receipt to the first relayed SSE event carrying output; it
    is ``None`` for non-streaming requests
    (the whole body arrives at once, so their "first token" is their end-to-end
    time and would blur the TTFT distribution) and for streams that ended before
    any output. ``itl_s`` holds one gap per output token: an event carrying k
    tokens after a gap g contributes k values of g/k. Token counts come from the
    backend's usage, ``None`` when the backend reported none.
    """

    backend: str
    pool: str
    model: str
    status: RequestStatus
    stream: bool
    finish_reason: str | None
    queue_s: float
    ttft_s: float | None
    itl_s: Sequence[float]
    e2e_s: float
    prompt_tokens: int | None
    completion_tokens: int | None
    request_id: str = ""
    upstream_s: float | None = None  # receipt → the (last) upstream request written
    overhead_s: float | None = None  # upstream_s less queue waits, failed attempts, pipelining

    def summary(self) -> dict[str, object]:
        """What ``GET /admin/requests`` shows of it (ITL as count and mean, not every gap)."""
        gaps = len(self.itl_s)
        return {
            "request_id": self.request_id,
            "backend": self.backend,
            "pool": self.pool,
            "model": self.model,
            "status": self.status,
            "stream": self.stream,
            "finish_reason": self.finish_reason,
            "queue_s": self.queue_s,
            "upstream_s": self.upstream_s,
            "overhead_s": self.overhead_s,
            "ttft_s": self.ttft_s,
            "itl_mean_s": sum(self.itl_s) / gaps if gaps else None,
            "itl_count": gaps,
            "e2e_s": self.e2e_s,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }
