"""The whole system on one virtual clock: clients, admission, limit control, engines.

Everything the gateway does between a client and its engines is played here
in virtual time, with the gateway's own parts where they are pure:

* a :class:`~backends.replica.Replica` per backend carries ``in_flight``,
  ``limit`` and the :class:`~gateway.window.RollingWindow`, fed as
  :class:`gateway.meter.StreamMeter` and :mod:`gateway.recording` feed it:
  TTFT from admission at the first token, ITL gaps and token counts flushed
  every ``FLUSH_INTERVAL_S`` as they stream, a completion at the end;
* :class:`gateway.control.LimitLoop` turns each window into a Sample
  (``sample_of``) and each Sample into a limit with the real controllers,
  every ``control_interval_s``; the engine's ``num_requests_waiting`` and KV
  cache usage are read as a scrape would read them, at the tick;
* each pool queues in a :class:`policies.priority_queue.PriorityQueue` with
  the semantics of :class:`policies.admission.PoolAdmission`: bounded depth
  (``queue_full`` at once), a deadline per request (``queue_timeout`` at the
  deadline), head of line served first whenever capacity may have appeared,
  nobody overtakes a waiter.

The engines are :class:`~backends.sim.virtual.VirtualEngine`s. One loop
interleaves their steps with the other events in time order, so a run is
deterministic for its seed and ten minutes of traffic take seconds.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from backends.replica import EngineGauges, Replica
from backends.sim.base import TokenEvent
from backends.sim.profiles import Profile, get_profile
from backends.sim.system.model import (
    SHED,
    Admits,
    PoolOf,
    PoolSpec,
    Router,
    SimBackend,
    SimRequest,
    Status,
    TokenListener,
    least_loaded,
    within_limit,
)
from backends.sim.virtual import VirtualEngine
from gateway.control import LimitLoop, sample_of
from gateway.meter import FLUSH_INTERVAL_S
from gateway.settings import BackendConfig, SimConfig
from gateway.window import RollingWindow
from policies.base import Sample
from policies.knee import KneeLimitConfig
from policies.priority_queue import Priority, PriorityQueue
from policies.registry import LimitConfig


@dataclass(frozen=True, slots=True)
class BackendSpec:
    name: str
    profile: str
    pool: str = "default"
    limit: LimitConfig | None = None  # overrides the simulation's limit config


@dataclass(frozen=True, slots=True)
class BackendPoint:
    """One backend at a control tick: what its controller saw and decided."""

    name: str
    limit: int
    in_flight: int
    running: int
    waiting: int
    kv_usage: float
    sample: Sample


@dataclass(slots=True)
class Interval:
    """One control period ending at ``t``; counters cover (t - period, t]."""

    t: float
    backends: tuple[BackendPoint, ...]
    queued: dict[str, int]
    arrived: int = 0
    admitted: int = 0
    shed: int = 0
    completed: int = 0
    tokens: int = 0
    good_tokens: int = 0  # of requests whose first token came within the SLO


@dataclass(slots=True)
class _Pool:
    spec: PoolSpec
    queue: PriorityQueue[SimRequest]
    backends: list[SimBackend] = field(default_factory=list)


class SystemSim:
    def __init__(
        self,
        backends: Sequence[BackendSpec],
        *,
        limit: LimitConfig | None = None,
        pools: Mapping[str, PoolSpec] | None = None,
        router: Router = least_loaded,
        admits: Admits = within_limit,
        pool_of: PoolOf | None = None,
        ttft_slo_s: float = 0.5,
        window_s: float = 5.0,
        control_interval_s: float = 1.0,
        seed: int = 0,
    ) -> None:
        self.now = 0.0
        self.seed = seed
        self.router = router
        self.admits = admits
        self.ttft_slo_s = ttft_slo_s
        self.control_interval_s = control_interval_s
        self.requests: list[SimRequest] = []
        self.intervals: list[Interval] = []
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._engine_seeds = itertools.count(seed * 1000)
        default = limit if limit is not None else KneeLimitConfig()
        self._limit_of = {b.name: b.limit or default for b in backends}
        self._pools: dict[str, _Pool] = {}
        for b in backends:
            spec = (pools or {}).get(b.pool, PoolSpec())
            pool = self._pools.setdefault(b.pool, _Pool(spec, PriorityQueue(spec.batch_share)))
            config = BackendConfig(name=b.name, pool=b.pool, sim=SimConfig(profile=b.profile))
            replica = Replica(config=config, url=f"virtual://{b.name}", healthy=True)
            replica.window = RollingWindow(window_s, created=0.0)
            pool.backends.append(SimBackend(replica, self._engine(get_profile(b.profile))))
        self.backends = [b for p in self._pools.values() for b in p.backends]
        first_pool = backends[0].pool
        self.pool_of: PoolOf = pool_of or (lambda request: first_pool)
        self._limits = LimitLoop()
        self._limits.sync(self._replicas(), lambda r: self._limit_of[r.name])
        self._current = Interval(0.0, (), {})
        self.at(control_interval_s, self._tick)

    # -- the driver's interface ---------------------------------------------

    def at(self, t: float, action: Callable[[], None]) -> None:
        """Run ``action`` at virtual time ``t`` (not before now)."""
        heapq.heappush(self._events, (max(t, self.now), next(self._order), action))

    def backend(self, name: str) -> SimBackend:
        return next(b for b in self.backends if b.name == name)

    def submit(
        self,
        prompt_tokens: int,
        max_tokens: int,
        *,
        priority: Priority = Priority.INTERACTIVE,
        max_queue_wait_s: float | None = None,
        on_done: Callable[[SimRequest], None] | None = None,
    ) -> SimRequest:
        """A request arriving now; it is admitted, queued or shed at once."""
        request = SimRequest(
            id=len(self.requests),
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            arrived=self.now,
            deadline=0.0,
            priority=priority,
            on_done=on_done,
        )
        self.requests.append(request)
        self._current.arrived += 1
        request.pool = self.pool_of(request)
        pool = self._pools[request.pool]
        wait = pool.spec.max_queue_wait_s if max_queue_wait_s is None else max_queue_wait_s
        request.deadline = self.now + wait
        if not pool.backends or not any(b.replica.healthy for b in pool.backends):
            self._answer(request, "no_backend")
            return request
        if not len(pool.queue):
            backend = self._route(pool, request)
            if backend is not None:
                self._admit(request, backend)
                return request
        if len(pool.queue) >= pool.spec.max_queue_depth:
            self._answer(request, "queue_full")
            return request
        if wait <= 0:
            self._answer(request, "queue_timeout")  # "admit now or refuse"
            return request
        pool.queue.push(request, priority)
        self.at(request.deadline, lambda: self._expire(request))
        return request

    def cancel(self, request: SimRequest) -> None:
        """The client went away: leave the queue, or stop the engine's sequence."""
        if request.status is not None:
            return
        pool = self._pools[request.pool]
        if request.backend is None:
            pool.queue.remove(request, request.priority)
            self._answer(request, "cancelled")
            return
        request.backend.engine.cancel(f"r{request.id}")
        self._release(request, "cancelled")

    def replace_engine(self, name: str, profile: str | Profile) -> None:
        """The backend is redeployed on another profile: its streams fail, it restarts empty.

        The replica (name, limit, controller, window) stays: the gateway sees the same
        backend answering differently.
        """
        backend = self.backend(name)
        new = get_profile(profile) if isinstance(profile, str) else profile
        backend.engine = self._engine(new)  # first: failed clients may retry at once
        for request in list(backend.running.values()):
            self._release(request, "failed")

    def set_healthy(self, name: str, healthy: bool) -> None:
        backend = self.backend(name)
        backend.replica.healthy = healthy
        if healthy:
            self._dispatch(self._pools[backend.pool])

    def queued(self, pool: str | None = None) -> int:
        pools = self._pools.values() if pool is None else [self._pools[pool]]
        return sum(len(p.queue) for p in pools)

    def run(self, until: float) -> None:
        """Play every event up to virtual time ``until``."""
        events = self._events
        backends = self.backends
        while True:
            t_event = events[0][0] if events else float("inf")
            engine, t_engine = None, float("inf")
            for backend in backends:
                t = backend.engine.next_time()
                if t is not None and t < t_engine:
                    engine, t_engine = backend.engine, t
            if min(t_event, t_engine) > until:
                break
            if engine is not None and t_engine <= t_event:
                self.now = t_engine
                engine.advance()
            else:
                self.now, _, action = heapq.heappop(events)
                action()
        self.now = until

    # -- admission ----------------------------------------------------------

    def _route(self, pool: _Pool, request: SimRequest) -> SimBackend | None:
        candidates = [b for b in pool.backends if b.replica.healthy and self.admits(b, request)]
        return self.router(request, candidates) if candidates else None

    def _dispatch(self, pool: _Pool) -> None:
        """Capacity may have appeared: serve the head of the queue while it fits."""
        queue = pool.queue
        while (request := queue.peek()) is not None:
            if not any(b.replica.healthy for b in pool.backends):
                queue.pop()
                self._answer(request, "no_backend")
                continue
            backend = self._route(pool, request)
            if backend is None:
                return  # head of line waits; nobody behind it may overtake
            queue.pop()
            self._admit(request, backend)

    def _expire(self, request: SimRequest) -> None:
        if request.status is None and request.backend is None:
            self._pools[request.pool].queue.remove(request, request.priority)
            self._answer(request, "queue_timeout")

    def _admit(self, request: SimRequest, backend: SimBackend) -> None:
        request.backend = backend
        request.admitted = self.now
        backend.replica.in_flight += 1
        backend.tokens_in_flight += request.prompt_tokens + request.max_tokens
        backend.running[request.id] = request
        self._current.admitted += 1
        engine = backend.engine
        if engine.next_time() is None:
            engine.advance_to(self.now)  # an idle engine's clock catches up
        engine.submit(request.generation(self.seed), TokenListener(self._stream(request)))

    def _stream(self, request: SimRequest) -> Callable[[float, TokenEvent], None]:
        """The per-token hot path: StreamMeter's live feed of the window."""
        window = request.backend.window  # type: ignore[union-attr]
        gaps = request.gaps
        current = self  # counters live on the current interval, looked up per token

        def on_token(now: float, event: TokenEvent) -> None:
            interval = current._current
            interval.tokens += 1
            if request.output_tokens == 0:
                request.first_token = request.last_flush = now
                ttft = now - request.admitted  # type: ignore[operator]
                request.good = ttft <= current.ttft_slo_s
                window.add_ttft(now, ttft)
            else:
                gaps.append(now - request.last_token)
            request.last_token = now
            request.output_tokens += 1
            if request.good:
                interval.good_tokens += 1
            if now - request.last_flush >= FLUSH_INTERVAL_S:
                _flush(request, window, now)
            if event.finish_reason is not None:
                current._release(request, "ok")

        return on_token

    def _release(self, request: SimRequest, status: Status) -> None:
        backend = request.backend
        assert backend is not None
        del backend.running[request.id]
        backend.replica.in_flight -= 1
        backend.tokens_in_flight -= request.prompt_tokens + request.max_tokens
        window = backend.window
        _flush(request, window, self.now)
        if status != "ok" and request.first_token is None:
            # As the gateway's recorder: a stream ended before any output is a censored TTFT.
            window.add_censored_ttft(self.now, self.now - request.admitted)  # type: ignore[operator]
        if status == "ok":
            window.add_completed(self.now)
            self._current.completed += 1
        self._answer(request, status)
        self._dispatch(self._pools[backend.pool])

    def _answer(self, request: SimRequest, status: Status) -> None:
        request.status = status
        request.finished = self.now
        if status in SHED:
            self._current.shed += 1
        if request.on_done is not None:
            request.on_done(request)

    # -- control --------------------------------------------------------------

    def _tick(self) -> None:
        now = self.now
        engines = {b.replica.name: b.engine.stats() for b in self.backends}

        def engine_of(replica: Replica) -> EngineGauges:
            stats = engines[replica.name]  # scraped at the tick
            return EngineGauges(stats.running, stats.waiting, stats.kv_usage, scraped_at=now)

        def demand(replica: Replica) -> int:
            return len(self._pools[replica.pool].queue)

        # What each controller is about to see (sample_of reads without side effects).
        seen = {
            b.name: sample_of(b.replica, now, engine_of(b.replica), demand(b.replica))
            for b in self.backends
        }
        if self._limits.tick(self._replicas(), now, engine_of, demand):
            for pool in self._pools.values():
                self._dispatch(pool)
        interval = self._current
        interval.t = now
        interval.backends = tuple(
            BackendPoint(
                b.name,
                b.replica.limit,
                b.replica.in_flight,
                engines[b.name].running,
                engines[b.name].waiting,
                engines[b.name].kv_usage,
                seen[b.name],
            )
            for b in self.backends
        )
        interval.queued = {name: len(p.queue) for name, p in self._pools.items()}
        self.intervals.append(interval)
        self._current = Interval(now, (), {})
        self.at(now + self.control_interval_s, self._tick)

    def _replicas(self) -> list[Replica]:
        return [b.replica for b in self.backends]

    def _engine(self, profile: Profile) -> VirtualEngine:
        engine = VirtualEngine(profile, seed=next(self._engine_seeds))
        engine.advance_to(self.now)
        return engine


def _flush(request: SimRequest, window: RollingWindow, now: float) -> None:
    gaps = request.gaps
    if gaps:
        window.add_itl(now, gaps)
        gaps.clear()
    window.add_tokens(now, request.output_tokens - request.flushed_tokens)
    request.flushed_tokens = request.output_tokens
    request.last_flush = now
