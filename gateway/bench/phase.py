"""One load point's bookkeeping, shared by the HTTP and the virtual-clock drivers.

Each point issues ``warmup`` requests that are not counted, then counts
requests until ``requests`` were issued or ``duration`` seconds passed, and
keeps issuing uncounted filler requests until the last counted one finishes,
so the counted requests never see the load fall while the tail drains. The
measurement window runs from the first counted issue to the last counted
finish; tokens delivered in it by any request make the point's throughput.

The phase also integrates the number of requests in flight at the target (any
request, counted or not) over the *steady* part of the window: from the window's
start or the point's first finish, whichever is later. Before any request has
finished an open loop is still filling up (its warm-up can be shorter than one
E2E); after that, arrivals and completions balance for a target that keeps up.

A closed loop's clients start ``stagger`` seconds apart (:func:`client_starts`),
the same on both clocks. With fixed output lengths a closed loop keeps its
clients' relative phases for the whole point, so a burst start leaves clients
finishing one engine step apart for good, and which of two such requests is
prefilled first then turns on a fraction of a step of client latency.
Requests issued before the last client started are warm-up too: the load is
not yet complete.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from gateway.bench.stats import LoadKind, RequestRecord, percentile

Arrival = Literal["poisson", "constant"]


@dataclass(frozen=True, slots=True)
class LoadPoint:
    kind: LoadKind
    load: float  # requests in flight (concurrency) or requests/s (rate)
    requests: int | None = None
    duration: float | None = None
    warmup: int = 0
    arrival: Arrival = "poisson"
    seed: int = 0
    index_base: int = 0  # keeps request indexes (and prompt prefixes) unique per point
    stagger: float = 0.0  # closed loop: seconds between successive clients' first requests

    @property
    def label(self) -> str:
        return f"c={self.load:g}" if self.kind == "concurrency" else f"{self.load:g} req/s"


def client_starts(point: LoadPoint) -> list[float]:
    """Seconds from the point's start to each closed-loop client's first request."""
    if point.kind != "concurrency":
        return []
    return [k * point.stagger for k in range(int(point.load))]


def arrival_gaps(point: LoadPoint) -> Iterator[float]:
    """Seconds between successive arrivals of an open-loop point."""
    rng = random.Random(point.seed)
    while True:
        yield rng.expovariate(point.load) if point.arrival == "poisson" else 1.0 / point.load


@dataclass(frozen=True, slots=True)
class Ticket:
    index: int
    counted: bool


class Phase:
    def __init__(self, point: LoadPoint) -> None:
        if point.requests is None and point.duration is None:
            raise ValueError("a load point needs requests or a duration")
        self.point = point
        self.records: list[RequestRecord] = []
        self.window_tokens = 0.0
        self._issued = 0
        self._counted_issued = 0
        self._counting_closed = False
        self._unstarted = len(client_starts(point))  # clients yet to send a first request
        self._start: float | None = None
        self._end: float | None = None
        self._in_flight = 0  # issued and not yet finished, counted or not
        self._finished_any = False
        self._steady: float | None = None  # start of the steady part of the window
        self._mark = 0.0  # time of the last change in flight
        self._in_flight_area = 0.0  # requests x seconds since ``_steady``

    @property
    def done(self) -> bool:
        return self._end is not None

    @property
    def window_s(self) -> float:
        if self._start is None or self._end is None:
            return 0.0
        return self._end - self._start

    @property
    def target(self) -> int | None:
        return self.point.requests

    @property
    def in_flight_mean(self) -> float | None:
        """Time-averaged requests in flight over the steady part of the window."""
        if self._steady is None or self._end is None or self._end <= self._steady:
            return None
        return self._in_flight_area / (self._end - self._steady)

    def issue(self, now: float, *, opening: bool = False) -> Ticket:
        """A request leaves now; ``opening``: a closed-loop client's first one."""
        self._integrate(now)
        self._in_flight += 1
        index = self.point.index_base + self._issued
        self._issued += 1
        ramping = self.point.stagger > 0 and self._unstarted > 0  # an opening one included
        if opening:
            self._unstarted -= 1
        if self._issued <= self.point.warmup or ramping or self._closed(now):
            self._maybe_end(now)
            return Ticket(index, counted=False)
        if self._start is None:
            self._start = now
            if self._finished_any:
                self._steady = now
        self._counted_issued += 1
        return Ticket(index, counted=True)

    def delivered(self, tokens: float) -> None:
        """Output tokens arrived now, from any request."""
        if self._start is not None and self._end is None:
            self.window_tokens += tokens

    def finish(self, ticket: Ticket, record: RequestRecord, now: float) -> None:
        self._integrate(now)
        self._in_flight -= 1
        if not self._finished_any:
            self._finished_any = True
            if self._start is not None:
                self._steady = now
        if not ticket.counted or self._end is not None:
            return
        self.records.append(record)
        self._maybe_end(now)

    def _integrate(self, now: float) -> None:
        """Add the requests in flight since the last change, inside the steady window."""
        if self._steady is not None and self._end is None:
            self._in_flight_area += self._in_flight * (now - self._mark)
        self._mark = now

    def _maybe_end(self, now: float) -> None:
        all_back = len(self.records) == self._counted_issued
        if self._end is None and self._start is not None and all_back and self._closed(now):
            self._end = now

    def _closed(self, now: float) -> bool:
        if not self._counting_closed:
            p = self.point
            by_count = p.requests is not None and self._counted_issued >= p.requests
            by_time = (
                p.duration is not None
                and self._start is not None
                and now >= self._start + p.duration
            )
            self._counting_closed = by_count or by_time
        return self._counting_closed

    def running(self, now: float) -> tuple[int, float | None, float]:
        """Counted requests done, their p95 TTFT so far, output tokens/s so far."""
        ttfts = [r.ttft for r in self.records if r.ttft is not None]
        p95 = percentile(ttfts, 95) if ttfts else None
        elapsed = (self._end or now) - self._start if self._start is not None else 0.0
        return len(self.records), p95, self.window_tokens / elapsed if elapsed > 0 else 0.0
