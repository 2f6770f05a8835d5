"""The engine on the real clock, for the simulated backend's HTTP face.

One background task drives the same :class:`VirtualEngine` the benchmarks
use: it sleeps until the step in progress ends (step time / speed) and then
completes it, so the cost is one timer per engine step however many
sequences run. Engine time is ``(wall - start) * speed``; everything the
engine reports (metrics, step times) is in engine seconds. Steps end on the
engine clock whatever the wall clock does: a loop that woke late completes
the overdue steps at their own times, back to back, so lag delays delivery
but never stretches the modelled GPU. The sleep is a kernel timer
(:class:`KernelTimer`): the loop's own are millisecond-coarse, an error the
speed-up multiplies. Waking from it still takes a while (a tenth of a
millisecond on a quiet VM, milliseconds now and then on a busy one), so each
sleep ends early by a lead and the rest is polled. The lead follows the
:data:`LEAD_QUANTILE` quantile of the lateness seen, not its mean: the figures
that must agree are 95th percentiles, and a mean lead leaves half the wakes
late. It is bounded by :data:`MAX_LEAD_S` and by :data:`MAX_POLL_SHARE` of each
sleep, so a busy machine costs the engine at most that share of a core (an
engine that polled everything would also trip the kernel's real-time
throttling under ``--realtime``: a 50 ms stall). For the same reason an engine
faster than real time that runs out of work polls for :data:`IDLE_POLL_S`
before it sleeps: a closed-loop client's next request is usually already on
its way, and a sleeping core would meet it late.

A request joins the engine as of its arrival (the moment its bytes came, see
:mod:`backends.sim.arrival`), not of the moment its handler submits it: an
idle engine starts its prefill from then, and a step that ended meanwhile is
completed first. For the same reason a step's end waits :data:`ARRIVAL_GRACE`
turns of the event loop, so that a request whose bytes came before it, but
whose handler has not run yet, still joins the next step.

Each request gets an async iterator of :class:`TokenEvent`. Closing it
before the last token (the client went away) cancels the sequence and frees
its KV at once. A step's tokens all end at one engine instant but go out one
stream after another, so first tokens (TTFT) and last tokens (a slot that a
closed-loop client refills at once) are handed out before the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import os
import time
from collections import deque
from collections.abc import Callable

from backends.sim.base import AsyncEngine, EngineFlavor, EngineStats, GenerationRequest, TokenEvent
from backends.sim.engine_metrics import EngineTimings, render_metrics
from backends.sim.profiles import Profile, get_profile
from backends.sim.virtual import VirtualEngine

# The most a step's end is polled for rather than slept through (wall seconds) ...
MAX_LEAD_S = 0.002
# ... and the largest share of a sleep that may be polled instead.
MAX_POLL_SHARE = 0.5
# A shorter sleep would be all wake-up: the step's end is polled for instead.
MIN_SLEEP_S = 0.00005
# Loop turns a step's end waits for requests that arrived before it: bytes read by the
# last poll (their handlers run in the next turn) and bytes still unread (the turn after).
ARRIVAL_GRACE = 2
# The lead is this quantile of the wake-up lateness: so many wakes come in time.
LEAD_QUANTILE = 0.98
# How far one wake moves the lead (a stochastic quantile estimate's step, seconds).
LEAD_STEP_S = 0.00005
# Faster than real time, how long an engine that ran out of work polls before it sleeps.
IDLE_POLL_S = 0.001


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class KernelTimer:
    """Sleeps with the kernel's precision: a Linux ``timerfd`` watched by the event loop.

    Event-loop timers keep time to a millisecond (uvloop rounds the delay,
    asyncio's epoll rounds it up), and an engine running K times faster than
    real time sees that error K times larger: at ``--speed 20`` a step that
    ends 0.5 ms late has lasted 10 ms too long. A timerfd wakes the loop within
    microseconds, without polling. :meth:`open` gives None where there is none.
    """

    def __init__(self, fd: int, settime: Callable[..., int]) -> None:
        self._fd = fd
        self._settime = settime
        self._waiter: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._fired)

    @classmethod
    def open(cls) -> KernelTimer | None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            create, settime = libc.timerfd_create, libc.timerfd_settime
        except (OSError, AttributeError, TypeError):
            return None  # not Linux
        fd = create(time.CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return None
        settime.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.c_void_p,
        ]
        try:
            return cls(fd, settime)
        except (NotImplementedError, OSError):  # a loop that cannot watch file descriptors
            os.close(fd)
            return None

    async def sleep(self, seconds: float) -> None:
        whole = int(seconds)
        spec = _Itimerspec(it_value=_Timespec(whole, max(1, int((seconds - whole) * 1e9))))
        if self._settime(self._fd, 0, ctypes.byref(spec), None) != 0:
            await asyncio.sleep(seconds)  # cannot arm it: the loop's own timer will do
            return
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _fired(self) -> None:
        try:
            os.read(self._fd, 8)  # the expiry count; reading it re-arms readiness
        except BlockingIOError:
            return
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        os.close(self._fd)


class TokenStream:
    """Async iterator over one request's tokens; ``aclose()`` cancels it.

    The engine appends to a deque and wakes the reader with one future: no
    channel machinery per token, and a reader that fell behind takes every
    pending token without waiting.
    """

    __slots__ = ("_ended", "_engine", "_events", "_finished", "_request_id", "_waiter", "on_token")

    def __init__(
        self, engine: RealtimeEngine, request_id: str, timings: EngineTimings, arrival: float
    ) -> None:
        self._engine = engine
        self._request_id = request_id
        self._events: deque[TokenEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False  # the engine sends nothing more (last token, cancel, shutdown)
        self._finished = False  # the reader is done: it took the last token or closed
        self.on_token = timings.timed(self._push, arrival)  # the engine's listener

    # -- engine side ------------------------------------------------------------

    def _push(self, now: float, event: TokenEvent, /) -> None:
        if self._ended:
            return  # the reader went away between two steps; its cancel follows
        self._events.append(event)
        if event.finish_reason is not None:
            self._ended = True
            self._engine._open.pop(self._request_id, None)
        if event.index == 0 or event.finish_reason is not None:
            self._wake()  # a first token (its TTFT) or a freed slot: out before the rest
        else:
            self._engine._later.append(self)

    def end(self) -> None:
        self._ended = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- reader side ------------------------------------------------------------

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> TokenEvent:
        events = self._events
        while not events:
            if self._ended or self._finished:
                self._finished = True  # engine shut down under us
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._finished:
            raise StopAsyncIteration
        event = events.popleft()
        if event.finish_reason is not None:
            self._finished = True
        return event

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            if not self._ended:
                self._engine.cancel(self._request_id)
        self._events.clear()


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
        self._open: dict[str, TokenStream] = {}  # requests not finished yet
        self._cancelled = 0
        self._timer: KernelTimer | None = None  # while running, where there is one
        self._lead = 0.0  # how early sleeps end: a high quantile of the wake-up lateness
        self._later: list[TokenStream] = []  # streams to wake once the step is complete
        self._idle_poll = IDLE_POLL_S if speed > 1 else 0.0
        self.max_model_len = profile.model.max_context

    def engine_time(self) -> float:
        return (self._clock() - self._origin) * self.speed

    def generate(self, request: GenerationRequest, arrival: float | None = None) -> TokenStream:
        """Submit a request that arrived at ``arrival`` (this engine's clock; None: now).

        It joins the engine as of its arrival, not of this call: the steps that
        ended before it are completed first, and an idle engine starts its
        prefill from then. Time the engine has already spent (a step it planned
        meanwhile) stays spent: the request then arrives at the engine's time.
        ValueError at once if the request can never run.
        """
        now = self.engine_time()
        self._sync(now if arrival is None else min(now, (arrival - self._origin) * self.speed))
        stream = TokenStream(self, request.request_id, self._timings, self._core.now)
        self._core.submit(request, stream)
        self._open[request.request_id] = stream
        self._wake.set()
        return stream

    def cancel(self, request_id: str) -> None:
        self._sync()
        self._core.cancel(request_id)
        stream = self._open.pop(request_id, None)
        if stream is not None:
            self._cancelled += 1
            stream.end()

    def stats(self) -> EngineStats:
        return dataclasses.replace(self._core.stats(), cancelled_total=self._cancelled)

    def render_metrics(self) -> bytes:
        block_size = self.profile.engine.block_size
        kv_blocks = (self.profile.kv_tokens // block_size, block_size)
        return render_metrics(
            self.flavor, self.model_name, self.stats(), self._timings, kv_blocks=kv_blocks
        )

    async def start(self) -> None:
        if self._task is None:
            self._origin = self._clock() - self._core.now / self.speed
            self._timer = KernelTimer.open()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.close()
        for stream in self._open.values():
            stream.end()
        self._open.clear()

    async def _sleep(self, seconds: float) -> None:
        """Sleep, and learn how late this loop wakes: the next sleeps end that much early."""
        started = self._clock()
        await (self._timer.sleep(seconds) if self._timer else asyncio.sleep(seconds))
        late = self._clock() - started - seconds
        self._lead = next_lead(self._lead, late)

    def _sync(self, at: float | None = None) -> None:
        """Bring the engine clock to ``at`` (default: now), completing the steps due by then."""
        self._core.advance_to(self.engine_time() if at is None else at)
        self._wake_later()

    def _wake_later(self) -> None:
        later, self._later = self._later, []
        for stream in later:
            stream._wake()

    async def _run(self) -> None:
        core = self._core
        idle_since: float | None = None
        slept_until: float | None = None  # the step end last slept towards: now poll for it
        grace = ARRIVAL_GRACE
        while True:
            end = core.next_time()
            if end is None:
                now = self._clock()
                idle_since = now if idle_since is None else idle_since
                if now - idle_since < self._idle_poll:
                    await asyncio.sleep(0)  # a closed-loop client's next request is on its way
                    continue
                self._wake.clear()
                await self._wake.wait()
                continue
            idle_since = None
            wait = (end - self.engine_time()) / self.speed  # wall seconds to the step's end
            if wait <= 0:
                if grace:  # requests whose bytes came before the step's end join the next
                    grace -= 1
                    await asyncio.sleep(0)
                    continue
                core.advance()
                self._wake_later()
                continue
            if end != slept_until:  # a step not waited for yet
                slept_until = end
                grace = ARRIVAL_GRACE
                sleep = wait - min(self._lead, wait * MAX_POLL_SHARE)
                if sleep > MIN_SLEEP_S:
                    await self._sleep(sleep)
                    continue
            await asyncio.sleep(0)  # the last moment before the step ends: poll


def next_lead(lead: float, late: float) -> float:
    """The lead after a wake ``late`` seconds late: it settles where a share
    :data:`LEAD_QUANTILE` of the wakes comes in time (up a large step when one
    is later than the lead, down a small one when it is not)."""
    if late > lead:
        lead += LEAD_STEP_S * LEAD_QUANTILE
    else:
        lead -= LEAD_STEP_S * (1.0 - LEAD_QUANTILE)
    return min(MAX_LEAD_S, max(0.0, lead))


def build_engine(
    profile_name: str, *, speed: float = 1.0, seed: int = 0, model: str | None = None
) -> AsyncEngine:
    """The simulated engine the HTTP face serves (KeyError lists valid profiles).

    ``model`` overrides the served model name the metrics are labelled with.
    """
    return RealtimeEngine(get_profile(profile_name), speed=speed, seed=seed, model=model)
