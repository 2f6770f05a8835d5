"""The engine on the real clock, for the simulated backend's HTTP face.

One background task drives the same :class:`VirtualEngine` the benchmarks
use: it sleeps until the step in progress ends (step time / speed) and then
completes it, so the cost is one timer per engine step however many
sequences run. Engine time is ``(wall - start) * speed``; everything the
engine reports (metrics, step times) is in engine seconds.

Each request gets an async iterator of :class:`TokenEvent`. Closing it
before the last token (the client went away) cancels the sequence and frees
its KV at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from backends.sim.base import AsyncEngine, EngineFlavor, EngineStats, GenerationRequest, TokenEvent
from backends.sim.engine_metrics import EngineTimings, render_metrics
from backends.sim.profiles import Profile, get_profile
from backends.sim.virtual import VirtualEngine


class _Sink:
    """Listener handing one request's tokens to its stream."""

    __slots__ = ("_done", "on_token", "send")

    def __init__(
        self,
        send: MemoryObjectSendStream[TokenEvent],
        timings: EngineTimings,
        arrival: float,
        done: Callable[[], object],
    ) -> None:
        self.send = send
        self._done = done
        self.on_token = timings.timed(self._push, arrival)

    def _push(self, now: float, event: TokenEvent, /) -> None:
        # The reader may have gone away between two steps; its cancel follows.
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.send.send_nowait(event)
        if event.finish_reason is not None:
            self.send.close()
            self._done()


class TokenStream:
    """Async iterator over one request's tokens; ``aclose()`` cancels it."""

    def __init__(
        self,
        engine: RealtimeEngine,
        request_id: str,
        receive: MemoryObjectReceiveStream[TokenEvent],
    ) -> None:
        self._engine = engine
        self._request_id = request_id
        self._receive = receive
        self._finished = False

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._finished:
            raise StopAsyncIteration
        try:
            event = await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._finished = True  # engine shut down under us
            raise StopAsyncIteration from None
        if event.finish_reason is not None:
            self._finished = True
            self._receive.close()
        return event

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._engine.cancel(self._request_id)
        self._receive.close()


class RealtimeEngine:
    """An :class:`AsyncEngine` running a profile ``speed`` times faster than real time."""

    def __init__(
        self,
        profile: Profile,
        *,
        speed: float = 1.0,
        seed: int = 0,
        model: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.profile = profile
        self.flavor: EngineFlavor = profile.flavor
        self.model_name = model or profile.served_model_name  # the metrics' model_name
        self.speed = speed
        self._clock = clock
        self._core = VirtualEngine(profile, seed=seed)
        self._timings = EngineTimings(profile.flavor)
        self._origin = clock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._open: dict[str, _Sink] = {}  # requests not finished yet
        self._cancelled = 0
        self.max_model_len = profile.model.max_context

    def engine_time(self) -> float:
        return (self._clock() - self._origin) * self.speed

    def generate(self, request: GenerationRequest) -> TokenStream:
        """Submit now; ValueError at once if the request can never run."""
        self._sync()
        send, receive = anyio.create_memory_object_stream[TokenEvent](math.inf)
        rid = request.request_id
        sink = _Sink(send, self._timings, self._core.now, lambda: self._open.pop(rid, None))
        self._core.submit(request, sink)
        self._open[rid] = sink
        self._wake.set()
        return TokenStream(self, request.request_id, receive)

    def cancel(self, request_id: str) -> None:
        self._sync()
        self._core.cancel(request_id)
        sink = self._open.pop(request_id, None)
        if sink is not None:
            self._cancelled += 1
            sink.send.close()

    def stats(self) -> EngineStats:
        return dataclasses.replace(self._core.stats(), cancelled_total=self._cancelled)

    def render_metrics(self) -> bytes:
        return render_metrics(self.flavor, self.model_name, self.stats(), self._timings)

    async def start(self) -> None:
        if self._task is None:
            self._origin = self._clock() - self._core.now / self.speed
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sink in self._open.values():
            sink.send.close()
        self._open.clear()

    def _sync(self) -> None:
        """Bring the engine clock to now, completing any step that is overdue."""
        self._core.advance_to(self.engine_time())

    async def _run(self) -> None:
        core = self._core
        while True:
            end = core.next_time()
            if end is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            lag = end - self.engine_time()
            if lag > 0:
                await anyio.sleep(lag / self.speed)
                continue
            core.advance()


def build_engine(
    profile_name: str, *, speed: float = 1.0, seed: int = 0, model: str | None = None
) -> AsyncEngine:
    """The simulated engine the HTTP face serves (KeyError lists valid profiles).

    ``model`` overrides the served model name the metrics are labelled with.
    """
    return RealtimeEngine(get_profile(profile_name), speed=speed, seed=seed, model=model)
