"""One proxied request: route → admit → open upstream (with retries) → relay.

Connection failures and 5xx answers before the first byte are retried on
another replica of the pool; once bytes have gone to the client the request is
committed to its replica. Every lease taken here is released exactly once:
on a failed attempt right away, otherwise by the finisher the relay calls.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from starlette.responses import Response

from backends.replica import Replica
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    RateLimited,
    Unavailable,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.meter import StreamMeter, Usage
from gateway.placement import Route, candidates, make_pick, plan_route
from gateway.record import RequestStatus
from gateway.recording import Flight
from gateway.relay import HOP_BY_HOP, StreamEnd, StreamRelay, response_headers
from gateway.runtime import Runtime
from gateway.settings import PoolConfig
from policies.admission import (
    Lease,
    NoHealthyBackend,
    Outcome,
    Priority,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
)
from policies.token_budget import Claim

# Client headers that are the gateway's business, not the backend's.
_NOT_FORWARDED = HOP_BY_HOP | {"authorization", "accept-encoding", "x-request-id"}
_PRIORITY_HEADER = "x-kneecap-priority"
_QUEUE_WAIT_HEADER = "x-kneecap-max-queue-wait"
_PRIORITIES = {"interactive": Priority.INTERACTIVE, "batch": Priority.BATCH}
_OUTCOME: dict[RequestStatus, Outcome] = {
    "ok": Outcome.SUCCESS,
    "client_closed": Outcome.IGNORE,
    "client_error": Outcome.IGNORE,
    "upstream_error": Outcome.DROPPED,
    "upstream_timeout": Outcome.DROPPED,
}


@dataclass(slots=True)
class ProxyRequest:
    endpoint: str  # "/v1/chat/completions", ...
    payload: dict[str, Any]
    body: bytes
    headers: Mapping[str, str]
    request_id: str
    started: float  # perf_counter at arrival
    key_priority: str = "interactive"  # the API key's configured class


def _priority(request: ProxyRequest) -> Priority:
    """The header's class, else the API key's."""
    value = request.headers.get(_PRIORITY_HEADER)
    if value is None:
        return _PRIORITIES[request.key_priority]
    priority = _PRIORITIES.get(value.strip().lower())
    if priority is None:
        raise InvalidRequest(
            f"{_PRIORITY_HEADER} must be one of {', '.join(_PRIORITIES)}, got {value!r}",
            code="invalid_priority",
        )
    return priority


def _max_queue_wait(request: ProxyRequest, pool: PoolConfig) -> float:
    """The pool's queue deadline, or the header's within the pool's ceiling."""
    value = request.headers.get(_QUEUE_WAIT_HEADER)
    if value is None:
        return pool.max_queue_wait_s
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise InvalidRequest(
            f"{_QUEUE_WAIT_HEADER} must be a number of seconds >= 0, got {value!r}",
            code="invalid_queue_wait",
        )
    return min(seconds, pool.max_queue_wait_ceiling_s)


def _upstream_headers(request: ProxyRequest, replica: Replica, forward_key: bool) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
    headers["content-type"] = "application/json"
    headers["accept-encoding"] = "identity"  # the relay must read SSE in clear to time it
    headers["x-request-id"] = request.request_id
    key = replica.config.resolved_api_key()
    if key:
        headers["authorization"] = f"Bearer {key}"
    elif forward_key and "authorization" in request.headers:
        headers["authorization"] = request.headers["authorization"]
    return headers


def _prepare_stream(request: ProxyRequest) -> bool:
    """Ask the backend for usage; returns True when the client did not ask itself."""
    if request.endpoint == "/v1/embeddings":
        return False
    options = request.payload.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return False
    merged = dict(options) if isinstance(options, dict) else {}
    merged["include_usage"] = True
    payload = dict(request.payload, stream_options=merged)
    request.body = json.dumps(payload, ensure_ascii=False).encode()
    return True


async def _send(runtime: Runtime, url: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    """Straight to the client's transport: the proxied request needs none of the client
    layer (cookies, redirects, auth, event hooks), which costs a third of its CPU."""
    upstream_request = httpx.Request(
        "POST",
        url,
        content=body,
        headers=headers,
        extensions={"timeout": runtime.current.upstream_timeouts},
    )
    response = await runtime.transport.handle_async_request(upstream_request)
    response.request = upstream_request
    return response


def _status_of(error: Exception) -> RequestStatus:
    return "upstream_timeout" if isinstance(error, httpx.TimeoutException) else "upstream_error"


async def proxy(runtime: Runtime, request: ProxyRequest) -> Response | StreamRelay:
    settings = runtime.current.settings
    route = await plan_route(runtime, request.payload, request.headers)
    pool = route.plan.home
    streaming = request.payload.get("stream") is True
    strip_usage = _prepare_stream(request) if streaming else False
    flight = Flight(
        pool=pool,
        model=route.model,
        stream=streaming,
        started=request.started,
        request_id=request.request_id,
    )
    tried: set[str] = set()
    last_error: Exception | None = None
    last_replica: Replica | None = None
    max_attempts = settings.upstream.max_attempts
    for attempt in range(max_attempts):
        left = sum(len(candidates(runtime, p, route, tried)) for p in route.pools)
        if not left:
            break
        if last_replica is not None:
            runtime.recorder.retried(last_replica)
        lease = await _admit(runtime, flight, route, request, tried)
        flight.admitted = time.perf_counter()
        replica = last_replica = lease.backend.backend
        tried.add(replica.name)
        last_attempt = attempt == max_attempts - 1 or left == 1
        try:
            upstream = await _send(
                runtime,
                replica.url + request.endpoint,
                request.body,
                _upstream_headers(request, replica, settings.auth.forward_client_key),
            )
        except httpx.HTTPError as exc:
            _release(runtime, flight, lease, Outcome.DROPPED)
            replica.record_failure(settings.health.failure_threshold)
            last_error = exc
            continue
        except BaseException:  # cancelled: the client left while we connected
            _release(runtime, flight, lease, Outcome.IGNORE)
            raise
        if upstream.status_code >= 500 and not last_attempt:
            _release(runtime, flight, lease, Outcome.DROPPED)
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            replica.record_failure(settings.health.failure_threshold)
            last_error = UpstreamError(f"backend {replica.name} answered {upstream.status_code}")
            continue
        replica.record_success()
        extra = {"x-request-id": request.request_id, "x-kneecap-backend": replica.name}
        if streaming and upstream.status_code == 200:
            meter = StreamMeter(
                started=request.started,
                strip_usage=strip_usage,
                window=replica.window,
                admitted=flight.admitted,
            )
            finish = _stream_finisher(runtime, flight, route, lease)
            return StreamRelay(upstream, meter, extra, finish)
        return await _buffered(runtime, flight, route, upstream, lease, extra)
    if last_replica is not None and last_error is not None:
        runtime.recorder.finished(flight, last_replica, _status_of(last_error))
    if isinstance(last_error, httpx.TimeoutException):
        raise UpstreamTimeout(f"upstream timed out: {last_error}")
    if last_error is not None:
        raise UpstreamError(
            f"every attempt failed; last: {type(last_error).__name__}: {last_error}"
        )
    runtime.recorder.rejected(pool, "no_backend")
    raise Unavailable(f"no healthy backend serves model `{route.model}`")


async def _admit(
    runtime: Runtime, flight: Flight, route: Route, request: ProxyRequest, tried: set[str]
) -> Lease[Claim[Replica]]:
    pool = flight.pool
    pool_config = runtime.current.settings.pools[pool]
    priority = _priority(request)
    deadline = time.monotonic() + _max_queue_wait(request, pool_config)
    pick = make_pick(runtime, route, tried)
    try:
        return await runtime.admission(pool).acquire(pick, priority=priority, deadline=deadline)
    except QueueFull as exc:
        raise _shed(runtime, pool, "queue_full", f"pool `{pool}` queue is full", exc) from exc
    except QueueTimeout as exc:
        message = f"no capacity in pool `{pool}` within the queue deadline"
        raise _shed(runtime, pool, "queue_timeout", message, exc) from exc
    except NoHealthyBackend as exc:
        runtime.recorder.rejected(pool, "no_backend")
        raise Unavailable(str(exc)) from exc
    except ShuttingDown as exc:
        runtime.recorder.rejected(pool, "shutting_down")
        raise Unavailable("the gateway is shutting down", code="shutting_down") from exc


def _release(
    runtime: Runtime, flight: Flight, lease: Lease[Claim[Replica]], outcome: Outcome
) -> None:
    """Release the lease; other pools hear of it too when requests cross pools."""
    lease.release(outcome)  # wakes the home pool's queue
    spill = runtime.current.settings.routing.spill
    if spill.to_longer or spill.to_shorter or lease.backend.backend.pool != flight.pool:
        for name, admission in runtime.admissions.items():
            if name != flight.pool:
                admission.notify()


def _calibrate(runtime: Runtime, route: Route, usage: Usage | None) -> None:
    if usage is not None and usage.prompt_tokens > 0:
        runtime.routing.calibration.observe(route.model, route.shape, usage.prompt_tokens)


def _shed(
    runtime: Runtime,
    pool: str,
    reason: str,
    message: str,
    exc: QueueFull | QueueTimeout,
) -> GatewayError:
    runtime.recorder.rejected(pool, reason)  # type: ignore[arg-type]
    retry_after = str(max(1, round(exc.retry_after or 1)))
    return RateLimited(message, code=reason, headers={"retry-after": retry_after})


def _stream_finisher(
    runtime: Runtime, flight: Flight, route: Route, lease: Lease[Claim[Replica]]
) -> Callable[[StreamEnd], None]:
    def finish(end: StreamEnd) -> None:
        replica = lease.backend.backend
        try:
            if _OUTCOME[end.status] is Outcome.DROPPED:
                replica.record_failure(runtime.current.settings.health.failure_threshold)
            runtime.recorder.finished(flight, replica, end.status, meter=end.meter)
            if end.status == "ok":
                _calibrate(runtime, route, end.meter.usage)
        finally:
            _release(runtime, flight, lease, _OUTCOME[end.status])

    return finish


async def _buffered(
    runtime: Runtime,
    flight: Flight,
    route: Route,
    upstream: httpx.Response,
    lease: Lease[Claim[Replica]],
    extra: dict[str, str],
) -> Response:
    status: RequestStatus = "upstream_error"
    usage = None
    try:
        body = await upstream.aread()
        status = "ok" if upstream.status_code < 400 else "client_error"
        if upstream.status_code >= 500:
            status = "upstream_error"
        usage = _usage_of(body) if status == "ok" else None
    except httpx.HTTPError as exc:
        status = _status_of(exc)
        raise UpstreamError(f"upstream failed while sending its answer: {exc}") from exc
    finally:
        await upstream.aclose()
        try:
            runtime.recorder.finished(flight, lease.backend.backend, status, usage=usage)
            _calibrate(runtime, route, usage)
        finally:
            _release(runtime, flight, lease, _OUTCOME[status])
    response = Response(body, status_code=upstream.status_code)
    length = (b"content-length", str(len(body)).encode())
    response.raw_headers = [*response_headers(upstream, extra), length]
    return response


def _usage_of(body: bytes) -> Usage | None:
    try:
        return Usage.from_json(json.loads(body).get("usage"))
    except (ValueError, AttributeError):
        return None
