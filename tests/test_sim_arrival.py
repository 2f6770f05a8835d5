"""A request reaches the simulated engine when its bytes reached the server.

At ``--speed K`` the HTTP layer's own wall time would count K times over in
engine time, so the engine takes a request as arriving at the moment its first
byte was parsed, starts an idle engine's prefill from then, and lets it join
the step after the one in progress at that moment.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import uvicorn

from backends.sim.arrival import HTTP_PROTOCOL, arrival_of
from backends.sim.base import GenerationRequest, TokenEvent
from backends.sim.profiles import get_profile
from backends.sim.realtime import MAX_LEAD_S, RealtimeEngine, next_lead
from backends.sim.server import create_sim_app
from backends.sim.virtual import VirtualEngine

VLLM = "qwen3-4b/l40s/bf16/vllm"
SPEED = 20.0


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def req(rid: str, prompt: int = 1024, out: int = 20) -> GenerationRequest:
    return GenerationRequest(rid, prompt, out, ignore_eos=True)


def prefill_s(prompt: int = 1024) -> float:
    """Engine seconds from submitting ``prompt`` to an idle engine to its first token."""
    engine = VirtualEngine(get_profile(VLLM))
    engine.submit(req("v", prompt), _Ignore())
    end = engine.next_time()
    assert end is not None
    return end


class _Ignore:
    def on_token(self, now: float, event: TokenEvent) -> None:
        pass


# -- the stamp --------------------------------------------------------------------


async def _stamp_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    message = await receive()  # the first receive sends "100 Continue"
    while message.get("more_body"):
        message = await receive()
    handled = time.monotonic()
    body = json.dumps({"arrival": arrival_of(scope), "handled": handled}).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def stamping_server() -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    config = uvicorn.Config(_stamp_app, http=HTTP_PROTOCOL, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def test_a_request_is_stamped_when_its_first_bytes_arrive_not_when_it_is_handled(
    stamping_server: int,
) -> None:
    body = b'{"x": 1}'
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    with socket.create_connection(("127.0.0.1", stamping_server), timeout=10) as conn:
        sent = time.monotonic()
        conn.sendall(head)
        reply = b""
        while b"100 Continue\r\n\r\n" not in reply:  # the handler is reading: head parsed
            reply += conn.recv(4096)
        before_body = time.monotonic()
        conn.sendall(body)
        reply = b""
        while not reply.endswith(b"}"):
            reply += conn.recv(4096)
    times = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    # Stamped with the head, before the body existed; handled only once the body came.
    assert sent <= times["arrival"] <= before_body <= times["handled"]


class _RecordingEngine:
    """Just enough of an AsyncEngine to see what the HTTP face submits."""

    flavor = "vllm"
    max_model_len = 40960

    def __init__(self) -> None:
        self.arrivals: list[float | None] = []

    def generate(self, request: GenerationRequest, arrival: float | None = None) -> Any:
        self.arrivals.append(arrival)

        async def one_token() -> AsyncIterator[TokenEvent]:
            yield TokenEvent(0, "length")

        return one_token()


@pytest.mark.anyio
async def test_the_completions_endpoint_hands_the_stamp_to_the_engine() -> None:
    engine = _RecordingEngine()
    app = create_sim_app(engine, "m")  # type: ignore[arg-type]
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [],
        "extensions": {"kneecap.arrival": {"time": 123.5}},
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    assert engine.arrivals == [123.5]
    assert sent[0]["status"] == 200


# -- the engine takes the arrival --------------------------------------------------


def test_an_idle_engine_starts_the_prefill_at_the_arrival_not_at_the_submit() -> None:
    clock = FakeClock()
    engine = RealtimeEngine(get_profile(VLLM), speed=SPEED, clock=clock)
    arrived = clock.now + 0.004  # wall seconds after the engine's origin
    clock.now += 0.010  # the handler got round to it later
    engine.generate(req("a"), arrival=arrived)
    assert engine._core.next_time() == pytest.approx(0.004 * SPEED + prefill_s())


def test_an_arrival_in_the_future_of_the_engine_is_taken_as_now() -> None:
    clock = FakeClock()
    engine = RealtimeEngine(get_profile(VLLM), speed=SPEED, clock=clock)
    clock.now += 0.010
    engine.generate(req("a"), arrival=clock.now + 1.0)  # clocks disagree: never ahead of now
    assert engine._core.next_time() == pytest.approx(0.010 * SPEED + prefill_s())


def test_a_request_that_arrived_before_a_step_ended_joins_the_next_step() -> None:
    clock = FakeClock()
    origin = clock.now
    engine = RealtimeEngine(get_profile(VLLM), speed=SPEED, clock=clock)
    engine.generate(req("a"), arrival=origin)  # its prefill ends at prefill_s()
    step_end_wall = origin + prefill_s() / SPEED
    clock.now = step_end_wall + 0.0005  # B's handler runs after A's prefill ended ...
    engine.generate(req("b"), arrival=step_end_wall - 0.0005)  # ... but B came before
    engine.generate(req("c"), arrival=clock.now)  # brings the engine to now
    stats = engine.stats()
    # A decodes and B prefills in the step after A's prefill; C waits for the next.
    assert (stats.running, stats.waiting) == (2, 1)


@pytest.mark.anyio
async def test_a_step_end_lets_a_request_already_in_its_handler_join_the_next_step() -> None:
    clock = FakeClock()
    origin = clock.now
    engine = RealtimeEngine(get_profile(VLLM), speed=SPEED, clock=clock)
    await engine.start()
    try:
        engine.generate(req("a"), arrival=origin)
        step_end_wall = origin + prefill_s() / SPEED
        clock.now = step_end_wall + 0.0005  # A's prefill is due when the engine next runs
        await asyncio.sleep(0)  # the engine's loop finds it due ...
        engine.generate(req("b"), arrival=step_end_wall - 0.0005)  # ... B's handler runs now
        for _ in range(5):
            await asyncio.sleep(0)
        assert engine.stats().generation_tokens_total == 1  # A's prefill was completed
        assert (engine.stats().running, engine.stats().waiting) == (2, 0)  # with B in
    finally:
        await engine.aclose()


# -- the lead ---------------------------------------------------------------------


def test_the_lead_settles_where_most_wakes_come_in_time() -> None:
    lead = 0.0
    lateness = [0.0001] * 9 + [0.0003]  # one wake in ten is three times later
    for _ in range(2000):
        for late in lateness:
            lead = next_lead(lead, late)
    # A mean (0.12 ms) would leave every tenth wake late; the lead covers them.
    assert lead >= 0.0003 - 0.0001


def test_the_lead_is_bounded_and_comes_back_down() -> None:
    lead = 0.0
    for _ in range(1000):
        lead = next_lead(lead, 0.05)  # a machine stalling for 50 ms
    assert lead == MAX_LEAD_S
    for _ in range(100_000):
        lead = next_lead(lead, 0.0)
    assert lead == 0.0
