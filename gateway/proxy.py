"""One proxied request: route → admit → open upstream (with retries) → relay.

Connection failures and 5xx answers before the first byte are retried on
another replica of the pool; once bytes have gone to the client the request is
committed to its replica. Every lease taken here is released exactly once:
on a failed attempt right away, otherwise by the finisher the relay calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from backends.lax import lax_bool, lax_int
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
from gateway.placement import (
    Route,
    awaiting_probe,
    candidates,
    make_could_use,
    make_pick,
    plan_route,
    upstream_identity,
)
from gateway.record import RequestStatus
from gateway.recording import Flight
from gateway.relay import (
    HOP_BY_HOP,
    StreamEnd,
    StreamRelay,
    WholeAnswer,
    connection_options,
    response_headers,
)
from gateway.runtime import Runtime
from gateway.settings import PoolConfig
from gateway.sse_events import finish_reason_of
from gateway.upstream import GatewayOutOfResources, UpstreamResponse
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

log = logging.getLogger("kneecap")

# Client headers that are the gateway's business, not the backend's. ``expect``: the
# gateway has the whole body before it sends upstream, so the backend must not be asked
# to say 100 Continue first.
_NOT_FORWARDED = frozenset(
    name.encode()
    for name in HOP_BY_HOP
    | {"authorization", "accept-encoding", "x-request-id", "content-type", "expect"}
)
# What every proxied request tells its backend: JSON, and a body in clear (the relay
# must read SSE to time it).
_FIXED_FIELDS = b"content-type: application/json\r\naccept-encoding: identity\r\n"
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
    raw_headers: Sequence[tuple[bytes, bytes]]  # as received, names in lower case
    request_id: str
    started: float  # perf_counter at arrival
    key_priority: str = "interactive"  # the API key's configured class


def _priority(request: ProxyRequest) -> Priority:
    """The API key's class, or the header's where that is lower: a client may yield to
    others, but a key the operator made ``batch`` cannot make itself ``interactive``."""
    keyed = _PRIORITIES[request.key_priority]
    value = request.headers.get(_PRIORITY_HEADER)
    if value is None:
        return keyed
    priority = _PRIORITIES.get(value.strip().lower())
    if priority is None:
        raise InvalidRequest(
            f"{_PRIORITY_HEADER} must be one of {', '.join(_PRIORITIES)}, got {value!r}",
            code="invalid_priority",
        )
    return max(priority, keyed)


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


def _upstream_fields(request: ProxyRequest, replica: Replica, forward_key: bool) -> bytes:
    """The upstream request's header lines, from the client's raw ones (no decoding)."""
    named = connection_options(request.headers.get("connection"))
    dropped = _NOT_FORWARDED | named if named else _NOT_FORWARDED
    lines = [b"%s: %s\r\n" % pair for pair in request.raw_headers if pair[0] not in dropped]
    lines.append(_FIXED_FIELDS)
    identity = upstream_identity(request.raw_headers, request.request_id, replica, forward_key)
    lines += [b"%s: %s\r\n" % pair for pair in identity]
    return b"".join(lines)


_INCLUDE_USAGE = b',"stream_options":{"include_usage":true}}'


def _several_sequences(payload: Mapping[str, Any]) -> bool:
    """Whether the stream may interleave several sequences: ``n`` > 1, or a list of
    prompts (a list of token ids is one prompt).

    ``n`` is read as the engines' pydantic reads an integer in lax mode (``"2"`` and
    ``2.0`` are 2). (The meter also turns to per-sequence timing at the first event of a
    sequence other than the first.)"""
    n = lax_int(payload.get("n"))
    if n is not None and n > 1:
        return True
    prompt = payload.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)


def _prepare_stream(request: ProxyRequest) -> bool:
    """Ask the backend for usage; returns True when the client did not ask itself.

    An object that leaves ``include_usage`` out does not ask: vLLM (0.32), SGLang and
    OpenAI all default it to false."""
    if request.endpoint == "/v1/embeddings":
        return False
    if "stream_options" not in request.payload:
        body = _as_utf8(request.body)
        if body is not None and (body := body.rstrip()).endswith(b"}"):
            # The body is a JSON object without the key: add it before the closing brace
            # rather than re-encode the whole (possibly long) prompt.
            request.body = body[:-1] + _INCLUDE_USAGE
            return True
    options = request.payload.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        return False  # forwarded as sent: the engine's 400 is the client's answer
    include_usage = lax_bool(options.get("include_usage"))
    continuous = lax_bool(options.get("continuous_usage_stats"))
    if include_usage is None or continuous is None:
        return False  # as above: rewritten, the engine would accept what it refuses
    if include_usage:
        return False  # the client asked: the usage chunk is its own
    merged = dict(options, include_usage=True)
    if continuous:
        # Honoured only with include_usage, which the client did not ask for: as asked,
        # it would put usage on every chunk the client gets.
        merged["continuous_usage_stats"] = False
    payload = dict(request.payload, stream_options=merged)
    try:
        request.body = json.dumps(payload, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate (valid as a JSON escape): keep it escaped
        request.body = json.dumps(payload).encode()
    return True


def _as_utf8(body: bytes) -> bytes | None:
    """The body in UTF-8, the encoding of the bytes spliced onto it; None when it cannot be.

    ``json.loads`` accepted UTF-16 and UTF-32 too (RFC 8259 §8.1 lets a receiver); such a
    body, rare, is decoded and re-encoded. UTF-8, with or without a BOM, is kept as is."""
    encoding = json.detect_encoding(body)
    if encoding.startswith("utf-8"):
        return body
    try:
        return body.decode(encoding).encode()
    except UnicodeError:  # a lone surrogate: the payload is re-serialised instead
        return None


async def _send(
    runtime: Runtime, url: str, fields: bytes, body: bytes, flight: Flight
) -> UpstreamResponse:
    """Straight to the transport: the proxied request needs none of the client layer
    (cookies, redirects, auth, event hooks), nor an ``httpx.Request``."""
    timeouts = runtime.current.upstream_timeouts
    return await runtime.transport.post(url, fields, body, timeouts, on_wire=flight.mark_sent)


def _status_of(error: Exception) -> RequestStatus:
    return "upstream_timeout" if isinstance(error, httpx.TimeoutException) else "upstream_error"


async def proxy(runtime: Runtime, request: ProxyRequest) -> WholeAnswer | StreamRelay:
    forward_key = runtime.current.settings.auth.forward_client_key

    def identity(replica: Replica) -> list[tuple[bytes, bytes]]:
        return upstream_identity(request.raw_headers, request.request_id, replica, forward_key)

    route = await plan_route(runtime, request.payload, request.headers, request.endpoint, identity)
    settings = runtime.current.settings  # read after planning, which may have awaited
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
    priority = _priority(request)
    # The queue deadline runs from the request's arrival, once for all attempts: the
    # client's wait is bounded, whatever reading, routing and retries took.
    elapsed = time.perf_counter() - request.started
    deadline = time.monotonic() + _max_queue_wait(request, settings.pools[pool]) - elapsed
    tried: set[str] = set()
    last_error: Exception | None = None
    last_replica: Replica | None = None
    failed_on: Replica | None = None  # the backend of last_error
    reached: Replica | None = None  # the last backend the request was written to
    max_attempts = settings.upstream.max_attempts
    for attempt in range(max_attempts):
        left = sum(len(candidates(runtime, p, route, tried)) for p in route.pools)
        if not left and not awaiting_probe(runtime, route, tried):
            break
        try:
            lease = await _admit(runtime, flight, route, priority, deadline, tried)
        except _NoRoomToRetry:
            break  # the client hears of the failure it had, not of a queue it never chose
        except asyncio.CancelledError:  # the client left while its retry waited
            if reached is not None:  # a backend had it: it counts, though never answered
                runtime.recorder.finished(flight, reached, "client_closed")
            raise
        flight.admitted = time.perf_counter()
        flight.waited += lease.queue_wait
        if last_replica is not None:  # counted once it goes out, not when it finds no room
            runtime.recorder.retried(last_replica)
        replica = last_replica = lease.backend.backend
        tried.add(replica.name)
        last_attempt = attempt == max_attempts - 1 or left == 1
        flight.sent = 0.0
        try:
            upstream = await _send(
                runtime,
                replica.url + request.endpoint,
                _upstream_fields(request, replica, settings.auth.forward_client_key),
                request.body,
                flight,
            )
        except (GatewayOutOfResources, httpx.PoolTimeout) as exc:
            # The gateway's own shortage (descriptors, memory, or every connection of
            # upstream.max_connections in use): not counted against the replica, nor
            # retried (every other would need the same).
            _release(runtime, flight, lease, Outcome.IGNORE)
            if failed_on is not None and last_error is not None:  # an earlier attempt did
                runtime.recorder.finished(flight, failed_on, _status_of(last_error))
            else:
                runtime.recorder.rejected(pool, "gateway_overloaded")
            raise gateway_overloaded(replica, request.request_id, exc) from exc
        except httpx.HTTPError as exc:
            _release(runtime, flight, lease, Outcome.DROPPED)
            flight.attempt_failed()
            reached = replica if flight.sent else reached
            replica.record_failure(settings.health.failure_threshold)
            last_error, failed_on = exc, replica
            continue
        except asyncio.CancelledError:  # the client left before the answer's head
            try:
                reached = replica if flight.sent else reached
                if reached is not None:  # a backend had it: it counts, though never answered
                    runtime.recorder.finished(flight, reached, "client_closed")
            finally:
                _release(runtime, flight, lease, Outcome.IGNORE)
            raise
        except BaseException:
            _release(runtime, flight, lease, Outcome.IGNORE)
            raise
        if upstream.status_code >= 500 and not last_attempt:
            _release(runtime, flight, lease, Outcome.DROPPED)
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            flight.attempt_failed()
            reached = replica
            replica.record_failure(settings.health.failure_threshold)
            last_error = UpstreamError(f"backend {replica.name} answered {upstream.status_code}")
            failed_on = replica
            continue
        if upstream.status_code >= 500:  # relayed, as no other replica is left to try
            replica.record_failure(settings.health.failure_threshold)
        # Otherwise the backend has not succeeded yet: its answer may still be cut or
        # stall. Success is recorded once the body is whole (_buffered, _StreamFinisher).
        extra = {"x-kneecap-backend": replica.name}  # the request id is the front's to stamp
        if streaming and upstream.status_code == 200:
            meter = StreamMeter(
                started=request.started,
                strip_usage=strip_usage,
                several_sequences=_several_sequences(request.payload),
                window=replica.window,
                admitted=flight.admitted,
            )
            finisher = _StreamFinisher(runtime, flight, route, lease)
            return StreamRelay(upstream, meter, extra, finisher)
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


def gateway_overloaded(
    replica: Replica, request_id: str, exc: GatewayOutOfResources | httpx.PoolTimeout
) -> Unavailable:
    """The 503 for a call the gateway could not make for want of its own resources, logged
    as what it is: the operator's fix is the gateway's limits, not the backend."""
    limit = (
        "upstream.max_connections"
        if isinstance(exc, httpx.PoolTimeout)
        else "open files: ulimit -n, or memory"
    )
    log.warning(
        "request %s: could not connect to backend %s: %s; the gateway's own limit (%s), "
        "not the backend's fault",
        request_id,
        replica.name,
        exc,
        limit,
    )
    return Unavailable(
        f"the gateway is out of resources to reach a backend ({exc}); retry shortly",
        code="gateway_overloaded",
        headers={"retry-after": "1"},
    )


class _NoRoomToRetry(Exception):
    """A retry found no capacity before the request's queue deadline, no healthy backend,
    or the gateway shutting down: the client hears of the failure it had."""


async def _admit(
    runtime: Runtime,
    flight: Flight,
    route: Route,
    priority: Priority,
    deadline: float,
    tried: set[str],
) -> Lease[Claim[Replica]]:
    pool = flight.pool
    pick = make_pick(runtime, route, tried)
    could_use = make_could_use(route, tried)
    try:
        return await runtime.admission(pool).acquire(
            pick, priority=priority, deadline=deadline, could_use=could_use
        )
    except (QueueFull, QueueTimeout) as exc:
        if tried:  # a retry: the request was admitted once, it is no shed
            raise _NoRoomToRetry from exc
        raise _refusal(runtime, pool, exc) from exc
    except (NoHealthyBackend, ShuttingDown) as exc:
        if tried:  # as above: the client hears of the failure it had
            raise _NoRoomToRetry from exc
        raise _unavailable(runtime, pool, exc) from exc


def _unavailable(runtime: Runtime, pool: str, exc: NoHealthyBackend | ShuttingDown) -> GatewayError:
    if isinstance(exc, NoHealthyBackend):
        runtime.recorder.rejected(pool, "no_backend")
        return Unavailable(str(exc))
    runtime.recorder.rejected(pool, "shutting_down")
    return Unavailable("the gateway is shutting down", code="shutting_down")


def _refusal(runtime: Runtime, pool: str, exc: QueueFull | QueueTimeout) -> GatewayError:
    if isinstance(exc, QueueFull):
        return _shed(runtime, pool, "queue_full", f"pool `{pool}` queue is full", exc)
    message = f"no capacity in pool `{pool}` within the queue deadline"
    return _shed(runtime, pool, "queue_timeout", message, exc)


def _release(
    runtime: Runtime, flight: Flight, lease: Lease[Claim[Replica]], outcome: Outcome
) -> None:
    """Release the lease; other pools' waiters hear of it too: they may borrow from its
    replica, or have been planned onto its pool when their own lost its replicas."""
    lease.release(outcome)  # wakes the queue it was taken from
    owner = lease.backend.backend.pool
    for name, admission in runtime.admissions.items():
        if name == flight.pool:
            continue
        if name == owner:  # lent: the room freed is this pool's, in its drain rate too
            admission.note_drained()
        if admission.depth():
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


@dataclass(frozen=True, slots=True)
class _StreamFinisher:
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
        outcome = _OUTCOME[end.status]
        try:
            replica = self.lease.backend.backend
            if outcome is Outcome.DROPPED:
                replica.record_failure(self.runtime.current.settings.health.failure_threshold)
            elif outcome is Outcome.SUCCESS:
                replica.record_success()
        finally:
            _release(self.runtime, self.flight, self.lease, outcome)


async def _buffered(
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
    try:
        body = await upstream.aread()
        status = "ok" if upstream.status_code < 400 else "client_error"
        if upstream.status_code >= 500:
            status = "upstream_error"  # counted against the backend when its head came
        else:
            replica.record_success()  # the whole answer is in: only now
        if status == "ok":
            usage = _usage_of(body)
            # The first choice's: engines write choices in order.
            finish_reason = finish_reason_of(body)
    except httpx.HTTPError as exc:
        status = _status_of(exc)
        replica.record_failure(runtime.current.settings.health.failure_threshold)
        if status == "upstream_timeout":
            raise UpstreamTimeout(f"upstream timed out while sending its answer: {exc}") from exc
        raise UpstreamError(f"upstream failed while sending its answer: {exc}") from exc
    except asyncio.CancelledError:
        status = "client_closed"  # the client left; the backend did not fail
        raise
    finally:
        await upstream.aclose()
        try:
            runtime.recorder.finished(
                flight, lease.backend.backend, status, usage=usage, finish_reason=finish_reason
            )
            _calibrate(runtime, route, usage)
        finally:
            _release(runtime, flight, lease, _OUTCOME[status])
    headers = response_headers(upstream, extra)
    if upstream.status_code not in (204, 304):  # RFC 9110 §8.6: no length on these
        headers.append((b"content-length", str(len(body)).encode()))
    return WholeAnswer(upstream.status_code, headers, body)


_USAGE_KEY = b'"usage"'
_DECODER = json.JSONDecoder()


def _usage_of(body: bytes) -> Usage | None:
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
