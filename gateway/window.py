"""Rolling, time-based windows of one backend's measured latency and throughput.

Fed *while* streams run, not when they end: TTFT at the first output event,
ITL gaps and output tokens in small batches as they are relayed (see
:class:`gateway.meter.StreamMeter`), so the admission controller sees what
the backend does now even when requests last minutes. TTFT here is the
backend's: from admission to first output, the gateway's own queue excluded.

TTFTs (one per request) are kept with their (monotonic, ``perf_counter``) time
and dropped once older than the span; ITL gaps (one per token) are counted in
log buckets per one-second slice. Percentiles are computed on read, about once
a second, never per chunk, and never sort per-token values.

A stream that ends before its first output (the client gave up waiting, the read
timed out, the backend failed) has no TTFT, only a bound: more than its time since
admission. Dropping it left only the survivors, and the p95 looked best exactly when
a backend past its knee made clients give up. Such right-censored TTFTs are kept
too; while the window holds any, its percentiles are Kaplan-Meier estimates (see
:func:`kaplan_meier`), and the plain nearest-rank ones otherwise.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of already sorted values."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


# Float slack when comparing the estimator's product with q / 100: a product of
# (1 - 1/n) factors that is exactly 0.95 must not read as 0.9499999.
_KM_SLACK = 1e-9


class Estimate(NamedTuple):
    value: float | None
    bound: bool  # only a lower bound: too many were censored above every observed value


def kaplan_meier(
    observed: Sequence[float], censored: Sequence[float], qs: Sequence[float]
) -> list[Estimate]:
    """Kaplan-Meier percentiles (q in 0..100) of sorted observed and sorted
    right-censored values (each only known to be larger than its value).

    In ascending order, an observed value before a censored one it ties with: an
    observed value multiplies the survival S by ``1 - 1/at_risk``, a censored one only
    leaves the risk set. The q-percentile is the smallest observed value at which
    ``1 - S >= q/100``. Where S never falls that far (censoring at the top), it is the
    largest censored value: a lower bound. With no censored values this is the
    nearest-rank percentile.

    Between two censored values, m more observed values take S to ``S * (r - m) / r``
    (r at risk before them), so each stretch is solved for m rather than walked: a read
    costs O(censored x qs) past the sort, not a Python step per observed value (a busy
    backend's window holds tens of thousands of TTFTs).
    """
    if not observed and not censored:
        return [Estimate(None, False)] * len(qs)
    results: list[float | None] = [None] * len(qs)
    keep = [1 - (q / 100 - _KM_SLACK) for q in qs]  # the survival each percentile needs
    at_risk = len(observed) + len(censored)
    survival = 1.0
    start = 0
    for bound in (*censored, math.inf):
        end = len(observed) if bound == math.inf else bisect_right(observed, bound)
        stretch = end - start
        if stretch:
            for i, target in enumerate(keep):
                if results[i] is None and survival * (at_risk - stretch) / at_risk <= target:
                    results[i] = observed[start + _fewest(survival, at_risk, target) - 1]
            survival *= (at_risk - stretch) / at_risk
            at_risk -= stretch
            start = end
        if bound != math.inf:
            at_risk -= 1  # the censored value leaves the risk set
    top = censored[-1] if censored else observed[-1]
    return [Estimate(top, True) if r is None else Estimate(r, False) for r in results]


def _fewest(survival: float, at_risk: int, target: float) -> int:
    """The fewest observed values m >= 1 that take ``survival * (at_risk - m) / at_risk``
    to ``target`` or below (the caller knows the stretch holds enough)."""
    m = max(1, math.ceil(at_risk - target * at_risk / survival - 1e-9))
    # The closed form may be off by one either way in floating point.
    while m > 1 and survival * (at_risk - (m - 1)) / at_risk <= target:
        m -= 1
    while survival * (at_risk - m) / at_risk > target:
        m += 1
    return m


@dataclass(frozen=True, slots=True)
class WindowStats:
    completed: int
    ttft_samples: int  # censored ones included: what the TTFT percentiles stand on
    ttft_censored: int  # of those, streams that ended before any output (lower bounds)
    # The p95 is only a lower bound: more streams gave up than the observed TTFTs could
    # place (a controller must not take it for a measured latency, e.g. a baseline).
    ttft_p95_bound: bool
    itl_samples: int
    ttft_p50: float | None
    ttft_p95: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p95: float | None
    itl_p99: float | None
    output_tokens_per_s: float

    def as_dict(self) -> dict[str, float | int | None]:
        return {name: getattr(self, name) for name in self.__slots__}


class ItlBuckets:
    """Counts of values in log-spaced buckets: percentiles without keeping or sorting values.

    ITL has one value per output token — tens of thousands per window on a busy
    backend — so it is counted, not stored. A bucket spans a factor of
    ``GROWTH``; a percentile is reported as its bucket's geometric middle
    (within ±2.5 %, far below what a controller can act on).
    """

    GROWTH = 1.05
    FLOOR = 1e-5  # seconds; smaller values share the first bucket
    _LOG_GROWTH = math.log(GROWTH)

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.total = 0

    def add_many(self, values: Iterable[float]) -> None:
        counts = self.counts
        floor, log_growth, log = self.FLOOR, self._LOG_GROWTH, math.log
        added = 0
        for value in values:
            index = int(log(value / floor) / log_growth) if value > floor else 0
            counts[index] = counts.get(index, 0) + 1
            added += 1
        self.total += added

    def remove_many(self, values: Iterable[float]) -> None:
        """Take back values added before (a stream's estimated ITL, corrected at its end)."""
        counts = self.counts
        floor, log_growth, log = self.FLOOR, self._LOG_GROWTH, math.log
        for value in values:
            index = int(log(value / floor) / log_growth) if value > floor else 0
            left = counts.get(index, 0)
            if left:  # never below zero, whatever is asked
                counts[index] = left - 1
                self.total -= 1

    @classmethod
    def value_of(cls, index: int) -> float:
        return cls.FLOOR * cls.GROWTH ** (index + 0.5)


def _bucket_percentiles(slices: Iterable[ItlBuckets], qs: Sequence[float]) -> list[float | None]:
    merged: dict[int, int] = {}
    total = 0
    for part in slices:
        total += part.total
        for index, count in part.counts.items():
            merged[index] = merged.get(index, 0) + count
    if not total:
        return [None] * len(qs)
    ranks = [max(1, math.ceil(q / 100 * total)) for q in qs]
    results: list[float | None] = [None] * len(qs)
    seen = 0
    for index in sorted(merged):
        seen += merged[index]
        for i, rank in enumerate(ranks):
            if results[i] is None and seen >= rank:
                results[i] = ItlBuckets.value_of(index)
    return results


class RollingWindow:
    # ITL counts are kept per slice of this many seconds and dropped slice by slice.
    SLICE_S = 1.0

    def __init__(self, span_s: float = 10.0, *, created: float | None = None) -> None:
        self.span_s = span_s
        self._created = created
        self._ttft: deque[tuple[float, float]] = deque()
        self._ttft_censored: deque[tuple[float, float]] = deque()  # (time, lower bound)
        self._itl: deque[tuple[float, ItlBuckets]] = deque()  # (slice start, counts)
        # Output tokens per output event of this backend's streams, learned as they end
        # (vLLM's --stream-interval, speculative decoding: several): how the meters
        # spread a running stream's gaps over tokens before its usage is known.
        self._tokens_per_event: float | None = None
        # [time, count]: a running stream's entries are estimates, set to its exact
        # counts once its usage is known (see StreamMeter.flush).
        self._tokens: deque[list[float]] = deque()
        self._completed: deque[float] = deque()

    def add_ttft(self, now: float, ttft: float) -> None:
        self._mark(now)
        self._ttft.append((now, ttft))

    def add_censored_ttft(self, now: float, waited: float) -> None:
        """A stream that ended, ``waited`` seconds after admission, before any output."""
        self._mark(now)
        self._ttft_censored.append((now, waited))

    def add_itl(self, now: float, gaps: Iterable[float]) -> ItlBuckets:
        """Count per-token gaps; returns the slice's buckets they went to."""
        if not self._itl or now - self._itl[-1][0] >= self.SLICE_S:
            self._itl.append((now, ItlBuckets()))
        buckets = self._itl[-1][1]
        buckets.add_many(gaps)
        return buckets

    # The learned ratio moves this far towards each finished stream's.
    TOKENS_PER_EVENT_WEIGHT = 0.25

    def learn_tokens_per_event(self, ratio: float) -> None:
        """A finished stream's output tokens per output event (at least one)."""
        known = self._tokens_per_event
        if known is None:
            self._tokens_per_event = ratio
        else:
            self._tokens_per_event = known + self.TOKENS_PER_EVENT_WEIGHT * (ratio - known)

    @property
    def tokens_per_event(self) -> tuple[int, int]:
        """The learned ratio as a fraction (tokens, events); 1 before any stream ended."""
        ratio = self._tokens_per_event
        return (1, 1) if ratio is None else (round(ratio * 1000), 1000)

    def add_tokens(self, now: float, count: int) -> list[float] | None:
        """Output tokens at ``now``; returns their entry, whose count (index 1) may be set
        later, while it is in the window, to correct an estimate (None: none was made)."""
        self._mark(now)
        if not count:
            return None
        entry = [now, count]
        self._tokens.append(entry)
        return entry

    def add_completed(self, now: float) -> None:
        self._mark(now)
        self._completed.append(now)

    def stats(self, now: float) -> WindowStats:
        self._evict(now)
        ttft = sorted(v for _, v in self._ttft)
        p95_bound = False
        if self._ttft_censored:
            censored = sorted(v for _, v in self._ttft_censored)
            p50, p95, p99 = kaplan_meier(ttft, censored, (50, 95, 99))
            ttft_p50, ttft_p95, ttft_p99 = p50.value, p95.value, p99.value
            p95_bound = p95.bound
        else:
            censored = []
            ttft_p50, ttft_p95, ttft_p99 = (percentile(ttft, q) for q in (50, 95, 99))
        itl_p50, itl_p95, itl_p99 = _bucket_percentiles((b for _, b in self._itl), (50, 95, 99))
        itl_samples = sum(b.total for _, b in self._itl)
        return WindowStats(
            completed=len(self._completed),
            ttft_samples=len(ttft) + len(censored),
            ttft_censored=len(censored),
            ttft_p95_bound=p95_bound,
            itl_samples=itl_samples,
            ttft_p50=ttft_p50,
            ttft_p95=ttft_p95,
            ttft_p99=ttft_p99,
            itl_p50=itl_p50,
            itl_p95=itl_p95,
            itl_p99=itl_p99,
            output_tokens_per_s=self.output_tokens_per_s(now),
        )

    def output_tokens_per_s(self, now: float) -> float:
        """The window's output rate alone: what a /metrics scrape needs, without sorting
        its TTFTs."""
        self._evict(now)
        # A window younger than its span divides by its age, not the span.
        age = now - self._created if self._created is not None else 0.0
        elapsed = min(self.span_s, age) if age > 0 else self.span_s
        return sum(n for _, n in self._tokens) / elapsed

    def _mark(self, now: float) -> None:
        if self._created is None:
            self._created = now

    def _evict(self, now: float) -> None:
        horizon = now - self.span_s
        for samples in (self._ttft, self._ttft_censored, self._tokens):
            while samples and samples[0][0] < horizon:
                samples.popleft()
        # A slice goes once all of it is older than the span.
        while self._itl and self._itl[0][0] + self.SLICE_S < horizon:
            self._itl.popleft()
        while self._completed and self._completed[0] < horizon:
            self._completed.popleft()
