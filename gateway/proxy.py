"""One proxied request: route → admit → open upstream (with retries) → relay.

Connection failures and 5xx answers before the first byte are retried on
another replica of the pool; once bytes have gone to the client the request is
committed to its replica. Every lease taken here is released exactly once:
on a failed attempt right away, otherwise by the finisher the relay calls.
"""

from __future__ import annotations

import asyncio
import time

import anyio
import httpx

from backends.replica import Replica
from gateway.errors import Unavailable, UpstreamError, UpstreamTimeout
from gateway.meter import StreamMeter
from gateway.overload import GatewayOutOfResources, gateway_overloaded
from gateway.placement import Route, awaiting_probe, candidates, plan_route
from gateway.proxy_admit import NoRoomToRetry, admit, release_lease
from gateway.proxy_finish import StreamFinisher, buffered, cancelled_status, status_of
from gateway.proxy_request import (
    ProxyRequest,
    max_queue_wait,
    prepare_stream,
    request_priority,
    several_sequences,
    upstream_fields,
)
from gateway.recording import Flight
from gateway.relay import StreamRelay, WholeAnswer, content_type, is_whole_json
from gateway.runtime import Runtime
from gateway.upstream_identity import upstream_identity
from gateway.upstream_response import UpstreamResponse
from policies.admission import Outcome


async def _send(
    runtime: Runtime, url: str, fields: bytes, body: bytes, flight: Flight
) -> UpstreamResponse:
    """Straight to the transport: the proxied request needs none of the client layer
    (cookies, redirects, auth, event hooks), nor an ``httpx.Request``."""
    timeouts = runtime.current.upstream_timeouts
    return await runtime.transport.post(url, fields, body, timeouts, on_wire=flight.mark_sent)


def _any_left(runtime: Runtime, route: Route, tried: set[str]) -> bool:
    """A replica not tried yet could take the request, now or once its first probe answers."""
    if any(candidates(runtime, pool, route, tried) for pool in route.pools):
        return True
    return awaiting_probe(runtime, route, tried)


async def proxy(
    runtime: Runtime, request: ProxyRequest, pipelined: float = 0.0
) -> WholeAnswer | StreamRelay:
    """``pipelined``: the seconds the request, read, waited for the answer before it on its
    connection (HTTP/1.1 pipelining): the client's ordering, neither the gateway's own
    time nor a queue's, so it eats neither the queue deadline nor the overhead."""
    forward_key = runtime.current.settings.auth.forward_client_key

    def identity(replica: Replica) -> list[tuple[bytes, bytes]]:
        return upstream_identity(request.raw_headers, request.request_id, replica, forward_key)

    route = await plan_route(runtime, request.payload, request.headers, request.endpoint, identity)
    settings = runtime.current.settings  # read after planning, which may have awaited
    pool = route.plan.home
    streaming = request.payload.get("stream") is True
    strip_usage = prepare_stream(request) if streaming else False
    flight = Flight(
        pool=pool,
        model=route.model,
        stream=streaming,
        started=request.started,
        request_id=request.request_id,
        pipelined=pipelined,
    )
    priority = request_priority(request)
    # The queue deadline runs from the request's arrival, once for all attempts: the
    # client's wait is bounded, whatever reading, routing and retries took.
    elapsed = time.perf_counter() - request.started - pipelined
    deadline = time.monotonic() + max_queue_wait(request, settings.pools[pool]) - elapsed
    tried: set[str] = set()
    last_error: Exception | None = None
    last_replica: Replica | None = None
    failed_on: Replica | None = None  # the backend of last_error
    reached: Replica | None = None  # the last backend the request was written to
    max_attempts = settings.upstream.max_attempts
    for attempt in range(max_attempts):
        # A first attempt needs no count: planning found it candidates, and should they
        # have gone since, its pick() plans again or refuses.
        if attempt and not _any_left(runtime, route, tried):
            break
        try:
            lease = await admit(runtime, flight, route, priority, deadline, tried)
        except NoRoomToRetry:
            break  # the client hears of the failure it had, not of a queue it never chose
        except asyncio.CancelledError:  # the client left while its retry waited
            if reached is not None:  # a backend had it: it counts, though never answered
                runtime.recorder.finished(flight, reached, "client_closed")
            raise
        flight.admitted = time.perf_counter()
        flight.attempt_over = False
        flight.waited += lease.queue_wait
        # A retry is counted once it is tried on a backend: not when it finds no room in the
        # queue, nor no connection to make (the gateway's shortage, below).
        retried_from = last_replica
        replica = last_replica = lease.backend.backend
        tried.add(replica.name)
        written, flight.sent = flight.sent, 0.0  # kept, should this attempt never go out
        try:
            upstream = await _send(
                runtime,
                replica.url + request.endpoint,
                upstream_fields(request, replica, settings.auth.forward_client_key),
                request.body,
                flight,
            )
        except (GatewayOutOfResources, httpx.PoolTimeout) as exc:
            # The gateway's own shortage (descriptors, memory, or every connection of
            # upstream.max_connections in use): not counted against the replica, nor
            # retried (every other would need the same).
            retried_from = None
            release_lease(runtime, flight, lease, Outcome.IGNORE)
            if failed_on is not None and last_error is not None:  # an earlier attempt did
                flight.sent = written  # its record is that attempt's, upstream_s included
                flight.attempt_over = True
                runtime.recorder.finished(flight, failed_on, status_of(last_error))
            else:
                runtime.recorder.rejected(pool, "gateway_overloaded")
            warning = runtime.transport.overload_warning
            raise gateway_overloaded(warning, replica, request.request_id, exc) from exc
        except httpx.HTTPError as exc:
            release_lease(runtime, flight, lease, Outcome.DROPPED)
            flight.attempt_failed()
            reached = replica if flight.sent else reached
            replica.record_failure(settings.health.failure_threshold)
            last_error, failed_on = exc, replica
            continue
        except asyncio.CancelledError:  # the client left, or the drain ended, before the head
            try:
                if not flight.sent:  # not written: the record is an earlier attempt's, if any
                    flight.sent = written
                    flight.attempt_over = True  # that attempt failed: it bounds no TTFT
                else:
                    reached = replica
                if reached is not None:  # a backend had it: it counts, though never answered
                    runtime.recorder.finished(flight, reached, cancelled_status(runtime, pool))
            finally:
                release_lease(runtime, flight, lease, Outcome.IGNORE)
            raise
        except BaseException:
            release_lease(runtime, flight, lease, Outcome.IGNORE)
            raise
        finally:
            if retried_from is not None:
                runtime.recorder.retried(retried_from)
        failed = upstream.status_code >= 500
        if failed and attempt < max_attempts - 1 and _any_left(runtime, route, tried):
            release_lease(runtime, flight, lease, Outcome.DROPPED)
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            flight.attempt_failed()
            reached = replica
            replica.record_failure(settings.health.failure_threshold)
            last_error = UpstreamError(f"backend {replica.name} answered {upstream.status_code}")
            failed_on = replica
            continue
        if failed:  # relayed, as no other replica is left to try
            replica.record_failure(settings.health.failure_threshold)
        # Otherwise the backend has not succeeded yet: its answer may still be cut or
        # stall. Success is recorded once the body is whole (buffered, StreamFinisher).
        extra = {"x-kneecap-backend": replica.name}  # the request id is the front's to stamp
        kind = content_type(upstream.raw_headers) if streaming else None
        if streaming and upstream.status_code == 200 and not is_whole_json(kind):
            meter = StreamMeter(
                started=request.started,
                strip_usage=strip_usage,
                several_sequences=several_sequences(request.payload),
                window=replica.window,
                admitted=flight.admitted,
            )
            finisher = StreamFinisher(runtime, flight, route, lease)
            return StreamRelay(upstream, meter, extra, finisher, kind)
        return await buffered(runtime, flight, route, upstream, lease, extra)
    if last_replica is not None and last_error is not None:
        runtime.recorder.finished(flight, last_replica, status_of(last_error))
    if isinstance(last_error, httpx.TimeoutException):
        raise UpstreamTimeout(f"upstream timed out: {last_error}")
    if last_error is not None:
        raise UpstreamError(
            f"every attempt failed; last: {type(last_error).__name__}: {last_error}"
        )
    runtime.recorder.rejected(pool, "no_backend")
    raise Unavailable(f"no healthy backend serves model `{route.model}`")
