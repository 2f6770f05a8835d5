"""A labelled Prometheus histogram that takes a request's worth of values in one call.

ITL yields one observation per output token: a 256-token stream is 256 values.
``prometheus_client.Histogram.observe`` costs about 1.3 us per value (a lock and
a linear bucket scan each time); bucketing the whole list with ``bisect`` under
one lock costs about a tenth of that, which matters at tens of thousands of
relayed tokens per second on one core.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client.metrics_core import HistogramMetricFamily, Metric


class BulkHistogram:
    """A labelled histogram that takes a request's worth of values in one call."""

    def __init__(self, name: str, doc: str, labelnames: Sequence[str], buckets: Sequence[float]):
        self._name, self._doc, self._labelnames = name, doc, list(labelnames)
        self._bounds = tuple(buckets)
        # label values -> [count per bucket (last is +Inf), ...], plus the sum
        self._counts: dict[tuple[str, ...], list[int]] = {}
        self._sums: dict[tuple[str, ...], float] = {}
        # The exposition may run in a worker thread; one acquisition per request.
        self._lock = threading.Lock()

    def observe_many(self, labelvalues: tuple[str, ...], values: Iterable[float]) -> None:
        bounds = self._bounds
        with self._lock:
            counts = self._counts.get(labelvalues)
            if counts is None:
                counts = self._counts[labelvalues] = [0] * (len(bounds) + 1)
                self._sums[labelvalues] = 0.0
            total = 0.0
            for v in values:
                counts[bisect_left(bounds, v)] += 1  # le is inclusive: v <= bound
                total += v
            self._sums[labelvalues] += total

    def remove_where(self, match: Callable[[tuple[str, ...]], bool]) -> None:
        with self._lock:
            for key in [k for k in self._counts if match(k)]:
                del self._counts[key], self._sums[key]

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshot = [(k, list(c), self._sums[k]) for k, c in self._counts.items()]
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        les = [*(repr(float(b)) for b in self._bounds), "+Inf"]
        for key, counts, total in snapshot:
            cumulative, running = [], 0
            for le, n in zip(les, counts, strict=True):
                running += n
                cumulative.append((le, float(running)))
            family.add_metric(list(key), cumulative, total)
        yield family
