"""Admission: permits on backends, a bounded priority queue per pool, typed refusals.

The limit math lives in the controllers; this module only enforces. A request
asks its pool's :class:`PoolAdmission` for a :class:`Lease`. ``pick()`` (the
routing policy) names a backend that has room, or None when every backend is at
its limit; then the request waits in the pool's queue until ``notify()`` says
capacity may have appeared (a lease released, a limit raised, a backend
readmitted), its deadline passes, its task is cancelled, or the pool closes.

Capacity is handed over, not raced for: ``notify()`` runs the head waiters'
``pick()`` itself and grants the permit before waking the waiter, so a request
arriving later can never take a backend from one that waits for it, and a wake-up
is never wasted. Requests of one pool may want different backends (another model,
a longer context): one that says which it ``could_use`` may go ahead of waiters
only onto a backend none of them could use, so it does not wait behind a head
whose backends are busy while its own are idle, however many wait for those.
Looking past a blocked head costs a ``pick()`` per waiter; a release says where the
room is, so a dispatch after one asks only the waiters that could use that backend,
and stops at the first blocked one that could (in a pool whose requests all want
the same backends: the head). ``notify()``, whose room may be anywhere, asks each
kind of waiter once (an equal ``could_use``, or an equal ``could_use.kind()``: the
gateway's is the replicas a request could use now). A waiter that leaves unserved (its
deadline passed, its client gone, the router refused it) no longer keeps those behind it
off what it could use: its leaving serves them at once, by the same pass, unless the head
stays and could use all it could (then nothing changed for anyone behind).
Everything here runs on one event loop thread; all mutation is synchronous, so
there are no await points at which the counts could tear.

A lease increments its backend's ``in_flight`` when granted and decrements it
exactly once, from whichever task calls :meth:`Lease.release`; anyio's
CapacityLimiter is not used because its tokens belong to the borrowing task,
while a body is streamed (and the lease released) by another.

Deadlines are absolute times on the injected clock. Waiting uses anyio's timer
(the event loop's monotonic clock, the same clock as ``time.monotonic`` in
production), and every dispatch also expires overdue waiters against the
injected clock, so tests with a fake clock advance it and call ``notify()``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, Protocol, TypeVar

import anyio

# Priority is part of this module's interface (acquire's argument): re-exported.
from policies.priority_queue import Priority as Priority
from policies.priority_queue import PriorityQueue

_RETRY_AFTER_MIN = 1.0
# Older openai SDKs honour a Retry-After only up to 60 s; newer ones give up above 120 s.
_RETRY_AFTER_MAX = 60.0


class Slot(Protocol):
    """What admission needs of a backend: a permit count it may change."""

    in_flight: int


T = TypeVar("T", bound=Slot)


class Outcome(Enum):
    SUCCESS = "success"  # completed: its timings are a meaningful sample
    IGNORE = "ignore"  # client went away, 4xx: no verdict on the backend
    DROPPED = "dropped"  # upstream timeout or 5xx: the backend failed it


class AdmissionError(Exception):
    """A request admission refused; ``code`` is the OpenAI-style error code."""

    code = "admission_error"
    http_status = 503

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueFull(AdmissionError):
    retry_after: float  # always set: every 429 carries a Retry-After
    code = "queue_full"
    http_status = 429

    def __init__(self, message: str, *, depth: int, retry_after: float) -> None:
        super().__init__(message, retry_after=retry_after)
        self.depth = depth


class QueueTimeout(AdmissionError):
    retry_after: float  # always set: every 429 carries a Retry-After
    code = "queue_timeout"
    http_status = 429

    def __init__(self, message: str, *, waited: float, retry_after: float) -> None:
        super().__init__(message, retry_after=retry_after)
        self.waited = waited


class NoHealthyBackend(AdmissionError):
    """Raised by ``pick()`` (the router), never by admission itself."""

    code = "no_healthy_backend"


class ShuttingDown(AdmissionError):
    code = "shutting_down"


class Lease(Generic[T]):
    """One permit on ``backend``; release it exactly once, in ``finally``."""

    __slots__ = ("_on_release", "backend", "outcome", "queue_wait")

    def __init__(self, backend: T, queue_wait: float, on_release: Callable[[T], None]) -> None:
        self.backend = backend
        self.queue_wait = queue_wait
        self.outcome: Outcome | None = None
        self._on_release = on_release

    @property
    def released(self) -> bool:
        return self.outcome is not None

    def release(self, outcome: Outcome) -> None:
        """Give the permit back; any later call is a no-op (the first outcome stands)."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        self.backend.in_flight -= 1
        self._on_release(self.backend)


@dataclass(slots=True, eq=False)  # identity equality: the queue removes this exact waiter
class _Waiter(Generic[T]):
    pick: Callable[[], T | None]
    priority: Priority
    deadline: float
    enqueued_at: float
    could_use: Callable[[T], bool] | None  # None: any backend (nobody may go ahead of it)
    event: anyio.Event = field(default_factory=anyio.Event)
    backend: T | None = None
    granted_at: float = 0.0
    error: Exception | None = None


class PoolAdmission(Generic[T]):
    def __init__(
        self,
        *,
        max_queue_depth: int,
        batch_share: float,
        clock: Callable[[], float] = time.monotonic,
        drain_window_s: float = 10.0,
        name: str = "",
    ) -> None:
        self.name = name
        self._clock = clock
        self._queue: PriorityQueue[_Waiter[T]] = PriorityQueue(batch_share)
        self._max_queue_depth = max_queue_depth
        self._drain_window_s = drain_window_s
        self._releases: deque[float] = deque()  # release times within the drain window
        self._spells: deque[tuple[float, float]] = deque()  # busy spells ended in the window
        self._spells_s = 0.0  # their lengths' sum: a refusal reads it, not every spell
        self._busy_since: float | None = None  # start of the busy spell under way
        self._next_expiry = float("inf")
        self._leased = 0
        self._closed = False

    def configure(self, *, max_queue_depth: int, batch_share: float) -> None:
        """Apply reloaded knobs; waiters already queued keep their places."""
        self._max_queue_depth = max_queue_depth
        self._queue.batch_share = batch_share

    @property
    def leased(self) -> int:
        """Leases granted and not yet released."""
        return self._leased

    @property
    def closed(self) -> bool:
        return self._closed

    def depth(self, priority: Priority | None = None) -> int:
        """Requests waiting: of one class, or in total."""
        return len(self._queue) if priority is None else self._queue.depth(priority)

    def retry_after(self) -> float:
        """Seconds until a request joining now would likely be served, within [1, 60].

        The drain rate counts only the time within the drain window that the pool was
        busy: time it sat idle says nothing about how fast it drains, and counted as
        draining nothing it told the first clients of a burst to wait up to a minute
        for a queue that emptied in seconds."""
        now = self._clock()
        self._forget_releases(now)
        # No release in the window bounds the rate by 1/busy: count it as one.
        per_request = self._busy_time(now) / max(1, len(self._releases))
        estimate = (len(self._queue) + 1) * per_request
        return max(_RETRY_AFTER_MIN, min(_RETRY_AFTER_MAX, estimate))

    async def acquire(
        self,
        pick: Callable[[], T | None],
        *,
        priority: Priority,
        deadline: float,
        could_use: Callable[[T], bool] | None = None,
    ) -> Lease[T]:
        """A lease on the backend ``pick()`` names, waiting in the queue if need be.

        ``could_use(backend)``: whether this request could be served there; with it, the
        request goes ahead of waiters onto a backend none of them could use.
        Raises QueueFull, QueueTimeout, ShuttingDown, or whatever ``pick()`` raises
        (NoHealthyBackend). ``pick()`` must not take the permit itself.
        """
        if self._closed:
            raise ShuttingDown(f"pool {self.name!r} is shutting down")
        now = self._clock()
        if len(self._queue):
            # An arrival frees nothing: only expiry and a head given room unannounced.
            self._dispatch(now, past=False)
        if not len(self._queue):
            backend = pick()
            if backend is not None:
                return self._lease(backend, 0.0)
        elif could_use is not None:
            backend = pick()
            if backend is not None and not self._wanted_by_waiters(backend, self._queue):
                return self._lease(backend, 0.0)
        if self._busy_since is None:
            # No room, and none of it this pool's own: its backends are busy with requests
            # it lent them to (or a pool whose replicas left planned onto it). A busy spell
            # starts now, so the idle time before it is not read as no drain.
            self._busy_since = now
        if len(self._queue) >= self._max_queue_depth:
            raise QueueFull(
                f"pool {self.name!r} queue is full",
                depth=len(self._queue),
                retry_after=self.retry_after(),
            )
        if deadline <= now:
            raise self._timeout(0.0)
        waiter = _Waiter(pick, priority, deadline, now, could_use)
        self._queue.push(waiter, priority)
        self._next_expiry = min(self._next_expiry, deadline)
        try:
            with anyio.move_on_after(deadline - now):
                await waiter.event.wait()
        except BaseException:
            self._abandon(waiter)  # cancelled (client gone): leave no trace, then re-raise
            raise
        return self._collect(waiter)

    def notify(self, room: T | None = None) -> None:
        """Capacity may have changed: serve waiters while ``pick()`` finds room.

        ``room``: the one backend that gained room (another pool's lease on it released),
        if that is all that changed; then only the waiters that could use it are asked."""
        if not self._closed:
            now = self._clock()
            self._dispatch(now, room=room)
            self._end_spell_if_idle(now)

    def close(self) -> None:
        """Refuse new requests and wake every waiter with ShuttingDown.

        Leases already granted stay valid and are released as usual.
        """
        self._closed = True
        for waiter in self._queue.clear():
            waiter.error = ShuttingDown(f"pool {self.name!r} is shutting down")
            waiter.event.set()
        self._next_expiry = float("inf")
        self._end_spell_if_idle(self._clock())

    def _dispatch(
        self,
        now: float,
        *,
        room: T | None = None,
        past: bool = True,
        gone: list[_Waiter[T]] | None = None,
    ) -> None:
        """Serve heads while ``pick()`` finds room, then, ``past`` a blocked head, waiters
        that can go ahead. ``room``: the only backend with more room than at the last
        dispatch (a release's), when that is known. ``gone``: waiters that left the queue
        unserved since then; with this dispatch's own (expired, refused), they may have
        kept waiters behind the head off backends with room all along."""
        if now >= self._next_expiry:
            gone = [*(gone or ()), *self._expire(now)]
        while (waiter := self._queue.peek()) is not None:
            try:
                backend = waiter.pick()
            except Exception as exc:  # the router's refusal ends this waiter, not the loop
                self._queue.pop()
                waiter.error = exc
                waiter.event.set()
                gone = [*(gone or ()), waiter]
                continue
            if backend is None:
                # The head cannot be served; a later waiter may only go ahead onto what
                # no waiter before it could use.
                if gone and _frees_more_than(waiter, gone):
                    room, past = None, True  # any backend they could use: ask each kind
                if past:
                    self._serve_past(waiter, now, room)
                return
            self._queue.pop()
            self._grant(waiter, backend, now)

    def _serve_past(self, head: _Waiter[T], now: float, room: T | None) -> None:
        """Grant waiters behind the blocked ``head`` what ``pick()`` finds them on backends
        no blocked waiter before them could use, asking each waiter only if it may get
        something: with ``room`` known, one that could use it, until a blocked waiter
        could (it then keeps the rest off it); without, one unlike every blocked waiter
        before it (whatever it got, one of the same :func:`_kind` before it wants)."""
        if head.could_use is None:
            return  # it may want anything: nobody goes ahead of it
        if room is not None and head.could_use(room):
            return
        ahead = [head]
        blocked = {_kind(head.could_use)}
        for waiter in list(self._queue):
            if waiter is head:
                continue
            if waiter.could_use is None:
                return  # it may want anything: nobody behind it goes ahead of it
            if room is not None and not waiter.could_use(room):
                ahead.append(waiter)  # nothing it could use gained room: still blocked
                continue
            kind = _kind(waiter.could_use)
            if kind in blocked:
                continue
            try:
                backend = waiter.pick()
            except Exception:
                backend = None  # its refusal is served when it reaches the head
            if backend is None or self._wanted_by_waiters(backend, ahead):
                if room is not None:
                    return  # it could use the room: nobody behind it may take that
                ahead.append(waiter)
                blocked.add(kind)
                continue
            self._queue.remove(waiter, waiter.priority)
            self._grant(waiter, backend, now)
            # Gone from before the rest, it no longer keeps them off what it could use.
            room = None

    @staticmethod
    def _wanted_by_waiters(backend: T, waiters: Iterable[_Waiter[T]]) -> bool:
        return any(w.could_use is None or w.could_use(backend) for w in waiters)

    def _grant(self, waiter: _Waiter[T], backend: T, now: float) -> None:
        self._take(backend)
        waiter.backend = backend
        waiter.granted_at = now
        waiter.event.set()

    def _expire(self, now: float) -> list[_Waiter[T]]:
        """Refuse the waiters whose deadline has passed; they are returned."""
        expired = self._queue.remove_if(lambda w: w.deadline <= now)
        for waiter in expired:
            waiter.error = self._timeout(now - waiter.enqueued_at)
            waiter.event.set()
        self._next_expiry = min((w.deadline for w in self._queue), default=float("inf"))
        self._end_spell_if_idle(now)
        return expired

    def _collect(self, waiter: _Waiter[T]) -> Lease[T]:
        if waiter.backend is not None:
            return self._make_lease(waiter.backend, waiter.granted_at - waiter.enqueued_at)
        if waiter.error is not None:
            raise waiter.error
        # Timed out by anyio's timer before any dispatch noticed the deadline. Every
        # waiter overdue by now leaves in the same pass, so each one's Retry-After counts
        # the queue behind it, not the others leaving with it.
        now, head = self._clock(), self._queue.peek()
        self._after_leaving(now, head, self._expire(max(now, waiter.deadline)))
        assert waiter.error is not None
        raise waiter.error

    def _abandon(self, waiter: _Waiter[T]) -> None:
        now = self._clock()
        if waiter.backend is not None:
            # Granted, but the task died before it could take the lease: hand it on.
            backend = waiter.backend
            backend.in_flight -= 1
            self._leased -= 1
            waiter.backend = None
            self._dispatch(now, room=backend)
        else:
            head = self._queue.peek()
            if self._queue.remove(waiter, waiter.priority):
                self._after_leaving(now, head, [waiter])
        self._end_spell_if_idle(now)

    def _after_leaving(self, now: float, head: _Waiter[T] | None, gone: list[_Waiter[T]]) -> None:
        """``gone`` left the queue unserved (deadline passed, client gone); ``head`` led it
        before. Serve whom they held back: a new head, or waiters behind the head kept off
        what they could use. Nothing changed for anyone if the head stays and could use
        all they could (it keeps the rest off that still): the common pool's case."""
        if self._closed or not gone:
            return
        now_head = self._queue.peek()
        if now_head is None or (now_head is head and not _frees_more_than(head, gone)):
            return
        self._dispatch(now, past=False, gone=gone)

    def _take(self, backend: T) -> None:
        if self._busy_since is None:  # idle until now: a busy spell starts
            self._busy_since = self._clock()
        backend.in_flight += 1
        self._leased += 1

    def _end_spell_if_idle(self, now: float) -> None:
        if self._busy_since is not None and not self._leased and not len(self._queue):
            self._spells.append((self._busy_since, now))
            self._spells_s += now - self._busy_since
            self._busy_since = None
            self._forget_spells(now)  # a pool that never refuses must not keep them all

    def _busy_time(self, now: float) -> float:
        """Seconds within the drain window that the pool had leases out or waiters."""
        horizon = self._forget_spells(now)
        busy = self._spells_s
        if self._spells:  # spells are in order, apart: only the oldest can begin before it
            busy -= max(0.0, horizon - self._spells[0][0])
        if self._busy_since is not None:
            busy += now - max(self._busy_since, horizon)
        return busy

    def note_drained(self) -> None:
        """A request another pool admitted onto one of this pool's backends ended: room
        freed here, which this pool's drain rate (its Retry-After) counts."""
        now = self._clock()
        self._releases.append(now)
        self._forget_releases(now)
        self._end_spell_if_idle(now)  # a spell its refusals began ends as room is freed

    def _lease(self, backend: T, queue_wait: float) -> Lease[T]:
        self._take(backend)
        return self._make_lease(backend, queue_wait)

    def _make_lease(self, backend: T, queue_wait: float) -> Lease[T]:
        return Lease(backend, queue_wait, self._released)

    def _released(self, backend: T) -> None:
        now = self._clock()
        self._leased -= 1
        self._releases.append(now)
        self._forget_releases(now)
        self._dispatch(now, room=backend)
        self._end_spell_if_idle(now)

    def _forget_spells(self, now: float) -> float:
        horizon = now - self._drain_window_s
        while self._spells and self._spells[0][1] <= horizon:
            start, end = self._spells.popleft()
            self._spells_s -= end - start
        if not self._spells:
            self._spells_s = 0.0  # no float drift carried over from the spells gone
        return horizon

    def _forget_releases(self, now: float) -> None:
        horizon = now - self._drain_window_s
        while self._releases and self._releases[0] < horizon:
            self._releases.popleft()

    def _timeout(self, waited: float) -> QueueTimeout:
        return QueueTimeout(
            f"pool {self.name!r}: no capacity within the queue deadline",
            waited=waited,
            retry_after=self.retry_after(),
        )


def _frees_more_than(head: _Waiter[T], gone: Iterable[_Waiter[T]]) -> bool:
    """Whether waiters that left kept others off a backend the blocked ``head`` does not:
    one that could use something the head could not (or anything, naming nothing). A
    ``head`` naming nothing keeps everyone behind it off everything by itself."""
    if head.could_use is None:
        return False
    kind = _kind(head.could_use)
    return any(w.could_use is None or _kind(w.could_use) != kind for w in gone)


def _kind(could_use: Callable[[T], bool]) -> Hashable:
    """What a waiter could use, comparable across waiters: its ``could_use.kind()`` where it
    has one (the gateway's: the replicas it could use now, as each request has a
    ``could_use`` of its own), else the function itself."""
    kind = getattr(could_use, "kind", None)
    return could_use if kind is None else kind()
