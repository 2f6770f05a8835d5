"""uvicorn's httptools protocol, stamping when a request's first bytes were read,
refusing request heads too large or too slow to be honest and bodies that stall,
cutting clients that stop reading, answering an app's failure in OpenAI's shape,
its own answers with the CORS headers the app would give, and writing a response's
head with the bytes that follow it."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gateway.eager import start_eagerly
from gateway.refusals import (
    BODY_TIMEOUT,
    HEAD_TIMEOUT,
    INTERNAL_ERROR_BODY,
    INTERNAL_ERROR_HEADERS,
    MAX_HEAD_BYTES,
    TOO_LARGE,
    cors_added,
    cors_for,
    refusal,
)
from gateway.settings import ListenConfig

log = logging.getLogger("kneecap")

ARRIVED_SCOPE_KEY = "kneecap.arrived"
# Seconds a pipelined request waited, read, for the answer before it on its connection
# to end (HTTP/1.1 answers in order): the client's wait, not the gateway's work. Absent
# for a request that waited behind none.
PIPELINED_SCOPE_KEY = "kneecap.pipelined"
# A callable that cuts the request's connection at once: a response whose client reads
# nothing cannot end otherwise, as its close waits for the unread bytes to leave (the
# relay, at the drain's end).
CUT_CONNECTION_SCOPE_KEY = "kneecap.cut_connection"
# Of a request line past its method and target: " HTTP/1.1\r\n" and the space between.
_REQUEST_LINE_BYTES = len(" ") + len(" HTTP/1.1\r\n")
_HEADER_SEPARATOR_BYTES = len(": ") + len("\r\n")
_DEFAULT_LISTEN = ListenConfig.model_validate({})


class _Cycle(RequestResponseCycle):
    """uvicorn's request cycle, whose 500 (the app raised, or returned, before answering)
    is an OpenAI error rather than a line of plain text no SDK can parse."""

    async def send_500_response(self) -> None:
        headers = INTERNAL_ERROR_HEADERS + cors_for(self.scope["headers"], self.scope["state"])
        await self.send({"type": "http.response.start", "status": 500, "headers": headers})
        await self.send({"type": "http.response.body", "body": INTERNAL_ERROR_BODY})


class _HeadTooLarge(Exception):
    pass


class HeadWithBody:
    """The transport a response is written through: its first write (the head) waits
    for the next one, made in the same step, so both leave in one system call.

    uvicorn writes a response's head and its body separately, and uvloop sends each
    write at once: two sends, each a trip through the loopback stack, for every
    whole answer. Held past the current step the head is sent alone (a stream's
    first event comes later), so nothing waits longer than one turn of the loop.
    While it is held, the protocol's own writes (a 400 for a bad pipelined request,
    a close) send it first: ``protocol.held_head`` names it.
    """

    __slots__ = ("_held", "_holding", "_loop", "_protocol", "_transport")

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        protocol: GatewayProtocol,
    ) -> None:
        self._transport = transport
        self._loop = loop
        self._protocol = protocol
        self._held: bytes | None = None
        self._holding = True  # only the first write is held

    def write(self, data: bytes) -> None:
        if self._holding:
            self._holding = False
            self._held = data
            self._protocol.held_head = self
            self._loop.call_soon(self.flush)
            return
        held = self._held
        if held is not None:
            self._release()
            self._transport.writelines((held, data))  # one writev
            return
        self._transport.write(data)

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._release()
            if not self._transport.is_closing():  # closed meanwhile: the client is gone
                self._transport.write(held)

    def _release(self) -> None:
        self._held = None
        if self._protocol.held_head is self:
            self._protocol.held_head = None

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        self.flush()  # whatever else is asked of the transport comes after the head
        return getattr(self._transport, name)


class GatewayProtocol(HttpToolsProtocol):
    # Bytes of the head being read, counted at the end of each read that left it unfinished;
    # -1 while the read in which it began is parsed: that read may end an earlier request.
    _head_bytes = 0
    _read = 0  # bytes of the read being parsed
    _heading = False  # a request's head is being read
    _head_too_large = False
    _head_timer: asyncio.TimerHandle | None = None  # a head that began must end by then
    _send_timer: asyncio.TimerHandle | None = None  # the client must read by then
    _body_timer: asyncio.TimerHandle | None = None  # a body must have gone on by then
    _body_read_at = 0.0  # loop time of the last read that left a body unfinished
    _body_wait_ours = False  # at the body timer's last look, the gateway was not reading
    held_head: HeadWithBody | None = None  # a response head waiting for its body
    _feeding = False  # the parser is reading: a request whose head ended waits for the read's end
    _deferred: tuple[RequestResponseCycle, Any] | None = None  # that request (cycle, app)

    def flush_held_head(self) -> None:
        """Before the protocol writes or closes on its own: the held head goes first."""
        if self.held_head is not None:
            self.held_head.flush()

    def _listen(self) -> ListenConfig:
        """The live ``listen`` settings: a reload applies to the next timer set."""
        runtime = self.app_state.get("runtime")  # the lifespan's state, once it started
        return runtime.current.settings.listen if runtime is not None else _DEFAULT_LISTEN

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._abort = transport.abort
        # uvicorn times a connection out only once it answered on it: one that never sends
        # a byte would be held for good. Its first read cancels this, as any read does.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._send_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._send_timer = self._body_timer = None
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._heading = True
        self._head_bytes = -1
        self.scope[ARRIVED_SCOPE_KEY] = time.perf_counter()  # type: ignore[typeddict-unknown-key]

    def on_response_complete(self) -> None:
        pipeline = self.pipeline
        if pipeline:  # uvicorn starts the oldest waiting request now
            scope = pipeline[-1][0].scope
            waited = time.perf_counter() - scope[ARRIVED_SCOPE_KEY]  # type: ignore[typeddict-item]
            scope[PIPELINED_SCOPE_KEY] = waited  # type: ignore[typeddict-unknown-key]
        super().on_response_complete()

    def on_headers_complete(self) -> None:
        self._heading = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        # The head is within the bytes read for it: measured only when those could exceed
        # the limit (a callback per header cost the request path more than the check).
        # ``>=``: a head begun in this read starts the count at -1.
        if self._head_bytes + self._read >= MAX_HEAD_BYTES:
            size = len(self.parser.get_method()) + _REQUEST_LINE_BYTES + self._parsed_head_bytes()
            if size > MAX_HEAD_BYTES:
                self._head_too_large = True
                raise _HeadTooLarge  # httptools makes it a parser error: uvicorn's 400 path
        previous = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not previous:  # the same: an upgrade, which uvicorn handles itself
            cycle.__class__ = _Cycle  # uvicorn builds it; one pointer makes it ours
            cycle.transport = HeadWithBody(self.transport, self.loop, self)  # type: ignore[assignment]
            self.scope[CUT_CONNECTION_SCOPE_KEY] = self._abort  # type: ignore[typeddict-unknown-key]

    def _parsed_head_bytes(self) -> int:
        """The head's bytes parsed so far past the method, each separator counted once."""
        headers = sum(len(name) + len(value) for name, value in self.headers)
        return len(self.url) + headers + _HEADER_SEPARATOR_BYTES * (len(self.headers) + 1)

    def data_received(self, data: bytes) -> None:
        # uvicorn's, but for an upgrade other than a WebSocket's, which is ignored rather
        # than left to swallow the request's body (and what follows it) unread.
        self._read = len(data)
        self._unset_keepalive_if_required()
        self._feeding = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._start_deferred(eagerly=False)
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response(f"Invalid HTTP request: {exc}")
            return
        except httptools.HttpParserUpgrade as upgrade:
            self._feeding = False
            if self._should_upgrade():
                self._start_deferred(eagerly=False)
                self.handle_websocket_upgrade()
            else:
                self._read_on_without_upgrade(data[upgrade.args[0] :])
            return
        finally:
            self._feeding = False
        if self._deferred is not None:  # a request's head ended in this read
            self._start_deferred(eagerly=True)
        if self._heading:  # rare: a head split across reads
            self._head_left_unfinished()
        elif self.cycle is not None and self.cycle.more_body:  # rare: a body split across reads
            self._body_left_unfinished()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        if self._feeding:
            self._deferred = (cycle, app)  # see _start_deferred
            return
        super()._start_asgi_task(cycle, app)

    def _start_deferred(self, *, eagerly: bool) -> None:
        """The request whose head ended in this read starts now, its first step run at once
        (``gateway/eager.py``): a request that came whole goes upstream in this loop turn,
        not behind every callback already due. After a parse error, as uvicorn would.

        Only the first request of a loop turn: the others of a burst read together start as
        tasks that run back to back, as before. Started each inside its own read, they cost
        ~20 % more CPU per request at saturation (non-streaming bench, alternated slices: the
        code of each handler evicts the next's). Paced bench (64 streams), alternated against
        the code before: client TTFT p50 0.06-0.13 ms lower (an A/A run: 0.01 higher), TTFT
        p99 ~0.5 ms lower, ITL p99 ~0.14 ms higher (the request's work now runs before the
        chunks due in its turn, not after); non-streaming requests/s 0.95 and 0.97 of before,
        within what A/A runs show."""
        deferred = self._deferred
        if deferred is None:
            return
        self._deferred = None
        cycle, app = deferred
        state = self.server_state
        if (
            not eagerly
            or getattr(state, "eager_turn_taken", False)
            or asyncio.current_task(self.loop) is not None
        ):
            super()._start_asgi_task(cycle, app)
            return
        state.eager_turn_taken = True  # type: ignore[attr-defined]
        self.loop.call_soon(_free_eager_turn, state)
        task = start_eagerly(self.loop, cycle.run_asgi(app))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def _head_left_unfinished(self) -> None:
        """A read ended inside a head: count it, so that one that never ends is held to at
        most one read past the limit, and time it, so that one that trickles in ends."""
        if self._head_bytes < 0:  # begun in this read, maybe after the end of a body
            self._head_bytes = self._parsed_head_bytes()
        else:
            self._head_bytes += self._read
        if self._head_bytes > MAX_HEAD_BYTES:
            self._heading = False
            self.flush_held_head()
            self.transport.write(cors_added(TOO_LARGE, cors_for(self.headers, self.app_state)))
            self.transport.close()
        elif self._head_timer is None:
            timeout = self._listen().head_timeout_s
            self._head_timer = self.loop.call_later(timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._heading or self.transport.is_closing():
            return
        if self.flow.read_paused or (self.cycle is not None and not self.cycle.response_complete):
            # Pipelined behind an answer still going: the gateway is not reading, or is not
            # waiting for this head yet; the wait is its own, not the client's.
            timeout = self._listen().head_timeout_s
            self._head_timer = self.loop.call_later(timeout, self._head_timed_out)
            return
        self._heading = False
        self.flush_held_head()
        self.transport.write(cors_added(HEAD_TIMEOUT, cors_for(self.headers, self.app_state)))
        self.transport.close()

    def _body_left_unfinished(self) -> None:
        """A read ended inside a body: the next must come within ``body_timeout_s`` (nginx's
        client_body_timeout). Reads only note their time; the one timer, when it fires,
        looks whether one came since, so a body in a thousand reads sets no thousand timers.

        Also after an answer sent before the body ended (a 413), when ``more_body`` stays
        set: uvicorn's keep-alive timer, cancelled by these reads, would not come back."""
        self._body_read_at = now = self.loop.time()
        if self._body_timer is None:
            timeout = self._listen().body_timeout_s
            self._body_timer = self.loop.call_at(now + timeout, self._body_timed_out)

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or self._heading or not cycle.more_body:
            return  # the body ended; a head being read has its own timer
        now = self.loop.time()
        ours = self.flow.read_paused or cycle.waiting_for_100_continue
        if ours or self._body_wait_ours:
            # The gateway is not reading (the app has not taken what came, or the request
            # waits behind another), or has not asked for the body yet: its wait, not the
            # client's. Found over since the last look, it ended in between: the client's
            # time starts no earlier than now (at most one timeout more for it).
            self._body_read_at = now
        self._body_wait_ours = ours
        timeout = self._listen().body_timeout_s
        deadline = self._body_read_at + timeout
        if deadline > now:
            self._body_timer = self.loop.call_at(deadline, self._body_timed_out)
            return
        log.info(
            "%s sent no more of its request body for %g s: connection closed", self._peer(), timeout
        )
        self.flush_held_head()
        if not cycle.response_started:  # else an answer is under way: only the close is left
            cors = cors_for(cycle.scope["headers"], self.app_state)
            self.transport.write(cors_added(BODY_TIMEOUT, cors))
        # The app's wait for the body ends as for any client gone: connection_lost tells it.
        self.transport.close()

    def _read_on_without_upgrade(self, rest: bytes) -> None:
        """httptools took the request for an upgrade (``curl --http2``'s h2c): it skipped
        its body and stopped at the end of its head, leaving the rest unread. RFC 9110
        §7.8 lets a server ignore an upgrade: the request is served as HTTP/1.1. A fresh
        parser reads on, from a stand-in head that frames the body as the request did."""
        framing = b"".join(
            b"%s: %s\r\n" % (name, value)
            for name, value in self.headers
            if name in (b"content-length", b"transfer-encoding")
        )
        self.cycle.more_body = True  # its handler has not run yet: nothing read it
        self.cycle.message_event.clear()
        self.parser = httptools.HttpRequestParser(_AfterStandInHead(self))
        try:  # as uvicorn's own: httptools has it from 0.6.3, uvicorn >= 0.30 allows older
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        except AttributeError:
            pass
        self.data_received(b"POST / HTTP/1.1\r\n" + framing + b"\r\n" + rest)

    def send_400_response(self, msg: str) -> None:
        self.flush_held_head()
        if self._head_too_large:
            answer = TOO_LARGE
        else:
            answer = refusal(b"400 Bad Request", msg, "invalid_http_request")
        # A parse error comes after its request's on_message_begin: these are its headers.
        self.transport.write(cors_added(answer, cors_for(self.headers, self.app_state)))
        self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        # The client reads nothing: its socket's buffers and the transport's are full. One
        # that never reads again would hold its request, and its backend's permit, for good.
        if self._send_timer is None:
            timeout = self._listen().send_timeout_s
            self._send_timer = self.loop.call_later(timeout, self._send_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timed_out(self) -> None:
        """Cut, not closed: a close would wait for the unread bytes to leave. The handler
        then sees its client gone and takes that path (upstream closed, permit released)."""
        self._send_timer = None
        timeout = self._listen().send_timeout_s
        log.info("%s read nothing for %g s: connection cut", self._peer(), timeout)
        self.transport.abort()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"

    def handle_websocket_upgrade(self) -> None:
        self.flush_held_head()
        super().handle_websocket_upgrade()

    def shutdown(self) -> None:
        self.flush_held_head()
        super().shutdown()

    def timeout_keep_alive_handler(self) -> None:
        self.flush_held_head()
        super().timeout_keep_alive_handler()


def _free_eager_turn(state: Any) -> None:
    state.eager_turn_taken = False


class _AfterStandInHead:
    """Parser callbacks past an ignored upgrade: the stand-in head's go nowhere (its request
    has its cycle already), its body's and every later request's go to the protocol."""

    def __init__(self, protocol: GatewayProtocol) -> None:
        self._protocol = protocol
        self._stand_in = True

    def on_message_begin(self) -> None:
        if not self._stand_in:
            self._protocol.on_message_begin()

    def on_url(self, url: bytes) -> None:
        if not self._stand_in:
            self._protocol.on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._stand_in:
            self._protocol.on_header(name, value)

    def on_headers_complete(self) -> None:
        if not self._stand_in:
            self._protocol.on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._protocol.on_body(body)

    def on_message_complete(self) -> None:
        self._stand_in = False
        self._protocol.on_message_complete()
