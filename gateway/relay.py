"""Upstream → client, byte for byte, timed on the way.

``StreamRelay`` is a pure ASGI response. It owns the request's lease until the
backend's body is over: the permit is released exactly once, in ``finally`` at the
latest, whatever ended the stream. The request is recorded once too, as soon as the
client has it all (its ``[DONE]``), which may be before the backend ends its body.
A client that goes away is noticed by the request's
:class:`~gateway.disconnect.DisconnectWatch`, which cancels the task running the
relay; the cancellation lands in the upstream read or the client write, and
``finally`` closes the upstream request and records the stream as ``client_closed``.
The drain's end (:class:`~gateway.drain.Drain`) cancels that task too: the relay then
gives the upstream and the permit back, records the stream as ``gateway_shutdown``, and
ends it with a last error event, or with what was left of a body already over; a client
that reads nothing has its connection cut.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import anyio
import httpx
from starlette.types import Receive, Scope, Send

from gateway.drain import CUT_WRITE_S, DRAIN_STATE_KEY, Drain
from gateway.errors import error_body
from gateway.meter import StreamMeter
from gateway.protocol import CUT_CONNECTION_SCOPE_KEY
from gateway.record import RequestStatus
from gateway.sse import SSEFramer
from gateway.upstream_response import UpstreamResponse

# RFC 9110 §7.6.1 hop-by-hop headers, plus what the relay recomputes itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
    }
)


log = logging.getLogger("kneecap")


_NOT_RELAYED = frozenset(name.encode() for name in HOP_BY_HOP | {"date", "server"})


_NOTHING: frozenset[bytes] = frozenset()

# An SSE event is held until its blank line, so that only whole events go out. Engines
# send events of a few hundred bytes (a few KB with logprobs; vLLM's echo with logprobs
# of a long prompt, MBs); one that runs past this without ending is relayed as it comes
# rather than held without bound, and framing resumes at its blank line.
MAX_HELD_EVENT_BYTES = 1024 * 1024


def connection_options(value: str | bytes | None) -> frozenset[bytes]:
    """Header names a ``Connection`` header lists: hop-by-hop too (RFC 9110 §7.6.1)."""
    if not value or value == "keep-alive":  # what clients send: nothing to drop
        return _NOTHING
    if isinstance(value, str):
        value = value.encode("latin-1")
    return frozenset(name.strip().lower() for name in value.split(b",")) - {b""}


def content_type(raw_headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The answer's content type, in lower case; None when it names none."""
    for name, value in raw_headers:
        if name.lower() == b"content-type":
            return value.lstrip().lower()
    return None


def is_event_stream(kind: bytes | None) -> bool:
    """SSE by its content type; a backend that names none is taken at its word for SSE."""
    return kind is None or kind.startswith(b"text/event-stream")


def is_whole_json(kind: bytes | None) -> bool:
    """A JSON document, answered to a request for a stream (``stream`` ignored, as vLLM
    does on ``/v1/embeddings``): read whole, for its usage, as an answer not streamed."""
    return kind is not None and kind.startswith(b"application/json")


def response_headers(
    upstream: UpstreamResponse, extra: dict[str, str]
) -> list[tuple[bytes, bytes]]:
    dropped = _NOT_RELAYED
    for name, value in upstream.raw_headers:
        if name.lower() == b"connection":
            dropped = dropped | connection_options(value)
    headers = [(name, value) for name, value in upstream.raw_headers if name.lower() not in dropped]
    headers += [(k.encode(), v.encode()) for k, v in extra.items()]
    return headers


class WholeAnswer:
    """A non-streamed answer, read whole from the upstream (for its usage), sent as is."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})


@dataclass(slots=True)
class StreamEnd:
    """How a relayed stream ended; handed to the request's finisher."""

    status: RequestStatus
    meter: StreamMeter
    error: str | None = None


class StreamFinisher(Protocol):
    """What becomes of a relayed stream, each step once."""

    def record(self, end: StreamEnd) -> None:
        """Count the request in the metrics: the client has all it will get."""

    def release(self, end: StreamEnd) -> None:
        """Give the backend's permit back: its body is over, or the stream was cut."""


def error_event(message: str, code: str = "upstream_error", kind: str = "upstream_error") -> bytes:
    return b"data: " + error_body(message, kind, None, code) + b"\n\n"


# A stream cut by the drain's end ends with what a request refused then hears (a 503).
_SHUTTING_DOWN = error_event("the gateway is shutting down", "shutting_down", "service_unavailable")


class StreamRelay:
    def __init__(
        self,
        upstream: UpstreamResponse,
        meter: StreamMeter,
        headers: dict[str, str],
        finisher: StreamFinisher,
        kind: bytes | None,
    ) -> None:
        """``kind``: the answer's :func:`content_type`, read by the caller to choose this."""
        self.upstream = upstream
        self.meter = meter
        self.headers = headers
        self.finisher = finisher
        # An answer that says it is no SSE (NDJSON, text) has no events to time or strip,
        # and holding bytes back until a blank line would stop it streaming at all. Off
        # too while an event too long to hold is relayed as it comes (``_unframed``).
        self.events = is_event_stream(kind)
        if not self.events:
            meter.metered = False
        # Set once the upstream body is over, before the last send: the client may
        # hang up the moment it has the last byte, and that is not a disconnect.
        self._end: StreamEnd | None = None
        self._due = b""  # once the body is over: what the client has yet to get before its end
        self._recorded: StreamEnd | None = None
        self._finished = False
        self._unframed = False  # inside an event past MAX_HELD_EVENT_BYTES, relayed as it comes
        self._cut_connection: Callable[[], None] | None = None  # the protocol's, per request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._cut_connection = scope.get(CUT_CONNECTION_SCOPE_KEY)
        # The drain's end cancels this task; that, not a check per chunk, is how the
        # stream learns of it. (~0.5 µs a stream, most of it current_task on Python 3.11.)
        state = scope.get("state")
        drain: Drain | None = state.get(DRAIN_STATE_KEY) if state else None
        task = asyncio.current_task() if drain is not None else None
        if drain is not None and task is not None:
            drain.streaming(task)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.upstream.status_code,
                    "headers": response_headers(self.upstream, self.headers),
                }
            )
            await self._pump(send)
        except OSError:
            pass  # ASGI ≥ 2.4: a send to a closed client
        except asyncio.CancelledError:
            if drain is None or task is None or not drain.stopped:
                raise
            task.uncancel()  # the drain's end: answered here, as a refusal would be
            await self._cut(send, self._cut_connection)
        finally:
            if drain is not None and task is not None:
                drain.streamed(task)
            if not self._finished:
                await self._close_and_finish(self._end or self._cut_short())

    async def _cut(self, send: Send, cut_connection: Callable[[], None] | None) -> None:
        """The drain is over: upstream and permit go back now, and the response ends. An
        event stream's client hears why, unless it had it all ([DONE]); one whose body was
        over gets the rest of it; one that reads nothing, nothing: its connection is cut."""
        if not self._finished:
            await self._close_and_finish(self._end or self._cut_short("gateway_shutdown"))
        # A send the cancellation interrupted wrote nothing (uvicorn waits for room before
        # it writes): what is left goes out whole.
        if self._end is not None:  # the cancellation landed in the body's last writes
            last = self._due
        elif self.meter.done or not (self.events or self._unframed):
            last = b""  # the client had it all, or is no SSE client to hear an event
        elif self._unframed:  # what went out ends inside an event, which a blank line ends
            last = b"\n\n" + _SHUTTING_DOWN
        else:
            last = _SHUTTING_DOWN
        end = {"type": "http.response.body", "body": b"", "more_body": False}
        try:
            with anyio.move_on_after(CUT_WRITE_S):
                if last:
                    await send({"type": "http.response.body", "body": last, "more_body": True})
                await send(end)
                return
            if cut_connection is None:
                return
            # The client reads nothing. Left to uvicorn, the response would be logged as
            # never completed and its connection held until listen.send_timeout_s.
            cut_connection()
            await send(end)  # returns once the connection is lost: the response is over
        except OSError:
            pass  # the client is gone too

    def _cut_short(self, why: RequestStatus = "client_closed") -> StreamEnd:
        """The stream ended before the backend's body did: the client left, or the drain's
        end cut it (``why``). Unless that came after [DONE]: the client had it all, and the
        SDK stops reading there, though the backend had yet to end its body."""
        return StreamEnd(self._status() if self.meter.done else why, self.meter)

    def _status(self) -> RequestStatus:
        """How a stream whose body ended (or reached [DONE]) went, by what it carried."""
        meter = self.meter
        if meter.upstream_error:
            return "upstream_error"
        return "client_error" if meter.client_error else "ok"

    def _release_event(self, framer: SSEFramer) -> bytes:
        """The held event's bytes, to go out now, and so the rest of it as it comes."""
        log.info(
            "backend sent an SSE event over %d bytes; relaying it as it comes",
            MAX_HELD_EVENT_BYTES,
        )
        self.events = False
        self._unframed = True
        return framer.release_pending()

    def _observe_released(self, framer: SSEFramer) -> None:
        """Meter the released event once it is over, when the client can first read it: an
        output event (TTFT, a gap) when it carries output up front, its finish reason read
        from its end. It went out already: one that reads as the usage chunk (implausible
        at this size) is not taken out."""
        self.events = True
        self._unframed = False
        self.meter.observe([framer.released_event()])

    def _record(self, end: StreamEnd) -> None:
        if self._recorded is None:
            self._recorded = end
            self.finisher.record(end)

    async def _close_and_finish(self, end: StreamEnd) -> None:
        """Give the upstream connection and the backend's permit back, once."""
        self._finished = True
        try:
            # The common path closes without waiting: no shielded scope to enter, which
            # with cold caches cost ~40 µs.
            if not self.upstream.close_nowait():
                # The shield keeps anyio's cancellations out, not a task.cancel() (a client
                # gone, the drain's end): the permit goes back whatever ends this wait.
                with anyio.CancelScope(shield=True):
                    await self.upstream.aclose()
        finally:
            try:
                self._record(end)
            finally:
                # A stream recorded at its [DONE] is released as recorded: what the backend
                # did after it (an error, a reset) cost the client nothing.
                self.finisher.release(self._recorded or end)

    async def _pump(self, send: Send) -> None:
        meter = self.meter
        framer = SSEFramer()
        try:
            async for chunk in self.upstream.aiter_raw():
                if not self.events:
                    end = framer.end_of_released(chunk) if self._unframed else -1
                    if end < 0:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        continue
                    # The released event ends in this read: framed again from its end on.
                    self._observe_released(framer)
                    if end:
                        body = chunk[:end]
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                    chunk = chunk[end:]
                    if not chunk:
                        continue
                # Only whole events go out: a dropped one never leaks partially, and an
                # error event never lands inside a half-sent one. The bytes are the
                # backend's; a read of whole events, nothing dropped, goes out as it came.
                whole, events = framer.feed(chunk)
                if events:
                    kept = meter.observe(events)
                    if meter.done and self._recorded is None:
                        # This write gives the client all it will get: the SDK stops
                        # reading at [DONE] and may read /metrics at once, while the
                        # backend can take a while longer to end its body.
                        self._record(StreamEnd(self._status(), meter))
                    if kept is not None:
                        whole = framer.join(kept)
                if framer.pending_size > MAX_HELD_EVENT_BYTES:
                    whole += self._release_event(framer)
                if whole:
                    await send({"type": "http.response.body", "body": whole, "more_body": True})
        except httpx.HTTPError as exc:
            message = f"upstream failed mid-stream: {type(exc).__name__}: {exc}".rstrip(": ")
            timed_out = isinstance(exc, httpx.TimeoutException)
            status: RequestStatus = "upstream_timeout" if timed_out else "upstream_error"
            self._end = StreamEnd(status, meter, message)
            if not (self.events or self._unframed):
                # No event stream: an SSE event would corrupt NDJSON or text, and a clean
                # end would pass the cut body off as whole. An unfinished body is how HTTP
                # says it failed: the connection is cut before the end goes out.
                if self._cut_connection is not None:
                    self._cut_connection()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            error = error_event(message)
            if self._unframed:
                # What went out ends inside the released event: a blank line ends it first,
                # so the error event is one of its own.
                error = b"\n\n" + error
            self._due = error
            await send({"type": "http.response.body", "body": error, "more_body": True})
            self._due = b""
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        # An event the close cut short is still the backend's (a usage chunk may be the
        # last bytes, without their blank line): measured, and sent unless dropped.
        tail = framer.pending
        if self._unframed:
            self._observe_released(framer)
        elif tail and meter.observe([tail]) is not None:
            tail = b""
        self._end = StreamEnd(self._status(), meter)
        self._due = tail
        # The backend is done, so its permit goes back before the last write rather than
        # after: a closed-loop client sends its next request the instant that write lands,
        # and it used to wait for this bookkeeping (~0.1 ms with cold caches).
        await self._close_and_finish(self._end)
        await send({"type": "http.response.body", "body": tail, "more_body": False})
