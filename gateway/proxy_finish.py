"""How an answered request ends: its outcome recorded, the backend's success or failure
counted, the estimator calibrated on its usage, and its lease released exactly once.

A stream ends through the :class:`StreamFinisher` the relay calls; a whole answer is
read and ended here (:func:`buffered`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import anyio
import httpx

from backends.replica import Replica
from gateway.errors import UpstreamError, UpstreamTimeout
from gateway.meter import Usage
from gateway.placement import Route
from gateway.proxy_admit import release_lease
from gateway.record import RequestStatus
from gateway.recording import Flight
from gateway.relay import StreamEnd, WholeAnswer, response_headers
from gateway.runtime import Runtime
from gateway.sse_events import finish_reason_of
from gateway.upstream_response import UpstreamResponse
from policies.admission import Lease, Outcome
from policies.token_budget import Claim

OUTCOME: dict[RequestStatus, Outcome] = {
    "ok": Outcome.SUCCESS,
    "client_closed": Outcome.IGNORE,
    "gateway_shutdown": Outcome.IGNORE,
    "client_error": Outcome.IGNORE,
    "upstream_error": Outcome.DROPPED,
    "upstream_timeout": Outcome.DROPPED,
}


def status_of(error: Exception) -> RequestStatus:
    return "upstream_timeout" if isinstance(error, httpx.TimeoutException) else "upstream_error"


def cancelled_status(runtime: Runtime, pool: str) -> RequestStatus:
    """Why a request cancelled while its whole answer was awaited ended: its client left,
    or the gateway is shutting down, which closed the pools to new requests; uvicorn
    cancels what still runs a grace after the drain's end. (A pool a reload removed is
    closed only once no lease of it is held, so never under this request's own.)"""
    admission = runtime.admissions.get(pool)
    return "gateway_shutdown" if admission is not None and admission.closed else "client_closed"


def _calibrate(runtime: Runtime, route: Route, usage: Usage | None) -> None:
    if usage is not None and usage.prompt_tokens > 0:
        runtime.routing.calibration.observe(route.model, route.shape, usage.prompt_tokens)


@dataclass(frozen=True, slots=True)
class StreamFinisher:
    runtime: Runtime
    flight: Flight
    route: Route
    lease: Lease[Claim[Replica]]

    def record(self, end: StreamEnd) -> None:
        self.runtime.recorder.finished(
            self.flight, self.lease.backend.backend, end.status, meter=end.meter
        )
        if end.status == "ok":
            _calibrate(self.runtime, self.route, end.meter.usage)

    def release(self, end: StreamEnd) -> None:
        outcome = OUTCOME[end.status]
        try:
            replica = self.lease.backend.backend
            if outcome is Outcome.DROPPED:
                replica.record_failure(self.runtime.current.settings.health.failure_threshold)
            elif outcome is Outcome.SUCCESS:
                replica.record_success()
        finally:
            release_lease(self.runtime, self.flight, self.lease, outcome)


async def buffered(
    runtime: Runtime,
    flight: Flight,
    route: Route,
    upstream: UpstreamResponse,
    lease: Lease[Claim[Replica]],
    extra: dict[str, str],
) -> WholeAnswer:
    status: RequestStatus = "upstream_error"
    usage = None
    finish_reason = None
    replica = lease.backend.backend
    # Answered, whole (a stream asked for gets this for an error): no first token is
    # awaited, so however this ends it bounds none.
    flight.attempt_over = True
    try:
        body = await upstream.aread()
        status = "ok" if upstream.status_code < 400 else "client_error"
        if upstream.status_code >= 500:
            status = "upstream_error"  # counted against the backend when its head came
        else:
            replica.record_success()  # the whole answer is in: only now
        if status == "ok":
            usage = usage_of(body)
            # The first choice's: engines write choices in order.
            finish_reason = finish_reason_of(body)
    except httpx.HTTPError as exc:
        status = status_of(exc)
        replica.record_failure(runtime.current.settings.health.failure_threshold)
        if status == "upstream_timeout":
            raise UpstreamTimeout(f"upstream timed out while sending its answer: {exc}") from exc
        raise UpstreamError(f"upstream failed while sending its answer: {exc}") from exc
    except asyncio.CancelledError:
        status = cancelled_status(runtime, flight.pool)  # the backend did not fail
        raise
    finally:
        try:
            if not upstream.close_nowait():  # the https:// body's close must be awaited
                # The shield keeps anyio's cancellations out, not a task.cancel() (a client
                # gone, the drain's end): the permit goes back whatever ends this wait.
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()
        finally:
            try:
                runtime.recorder.finished(
                    flight, lease.backend.backend, status, usage=usage, finish_reason=finish_reason
                )
                _calibrate(runtime, route, usage)
            finally:
                release_lease(runtime, flight, lease, OUTCOME[status])
    headers = response_headers(upstream, extra)
    if upstream.status_code not in (204, 304):  # RFC 9110 §8.6: no length on these
        headers.append((b"content-length", str(len(body)).encode()))
    return WholeAnswer(upstream.status_code, headers, body)


_USAGE_KEY = b'"usage"'
_DECODER = json.JSONDecoder()


def usage_of(body: bytes) -> Usage | None:
    """The body's ``usage``, read from the last ``"usage"`` key on: engines put it at the
    end, and a long completion need not be parsed whole for two numbers (inside a JSON
    string the key's quotes would be escaped, so the search cannot land in content).
    Anything unexpected falls back to parsing the whole body."""
    at = body.rfind(_USAGE_KEY)
    if at >= 0:
        tail = body[at + len(_USAGE_KEY) :].lstrip()
        if tail.startswith(b":"):
            try:
                value, _ = _DECODER.raw_decode(tail[1:].decode().lstrip())
            except (ValueError, UnicodeDecodeError):
                value = None
            usage = Usage.from_json(value)
            if usage is not None:
                return usage
    try:
        return Usage.from_json(json.loads(body).get("usage"))
    except (ValueError, AttributeError):
        return None
