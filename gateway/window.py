"""Rolling, time-based windows of one backend's measured latency and throughput.

Fed *while* streams run, not when they end: TTFT at the first output event,
ITL gaps and output tokens in small batches as they are relayed (see
:class:`gateway.meter.StreamMeter`), so the admission controller sees what
the backend does now even when requests last minutes. TTFT here is the
backend's: from admission to first output, the gateway's own queue excluded.

Samples are kept with their (monotonic, ``perf_counter``) time and dropped
once older than the span; percentiles are computed on read, about once a
second, never per chunk.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of already sorted values."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass(frozen=True, slots=True)
class WindowStats:
    completed: int
    ttft_samples: int
    ttft_p50: float | None
    ttft_p95: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p95: float | None
    itl_p99: float | None
    output_tokens_per_s: float

    def as_dict(self) -> dict[str, float | int | None]:
        return {name: getattr(self, name) for name in self.__slots__}


class RollingWindow:
    def __init__(self, span_s: float = 10.0, *, created: float | None = None) -> None:
        self.span_s = span_s
        self._created = created
        self._ttft: deque[tuple[float, float]] = deque()
        self._itl: deque[tuple[float, float]] = deque()
        self._tokens: deque[tuple[float, int]] = deque()
        self._completed: deque[float] = deque()

    def add_ttft(self, now: float, ttft: float) -> None:
        self._mark(now)
        self._ttft.append((now, ttft))

    def add_itl(self, now: float, gaps: Iterable[float]) -> None:
        self._itl.extend((now, gap) for gap in gaps)

    def add_tokens(self, now: float, count: int) -> None:
        self._mark(now)
        if count:
            self._tokens.append((now, count))

    def add_completed(self, now: float) -> None:
        self._mark(now)
        self._completed.append(now)

    def stats(self, now: float) -> WindowStats:
        self._evict(now)
        ttft = sorted(v for _, v in self._ttft)
        itl = sorted(v for _, v in self._itl)
        # A window younger than its span divides by its age, not the span.
        age = now - self._created if self._created is not None else 0.0
        elapsed = min(self.span_s, age) if age > 0 else self.span_s
        return WindowStats(
            completed=len(self._completed),
            ttft_samples=len(ttft),
            ttft_p50=percentile(ttft, 50),
            ttft_p95=percentile(ttft, 95),
            ttft_p99=percentile(ttft, 99),
            itl_p50=percentile(itl, 50),
            itl_p95=percentile(itl, 95),
            itl_p99=percentile(itl, 99),
            output_tokens_per_s=sum(n for _, n in self._tokens) / elapsed,
        )

    def _mark(self, now: float) -> None:
        if self._created is None:
            self._created = now

    def _evict(self, now: float) -> None:
        horizon = now - self.span_s
        for samples in (self._ttft, self._itl, self._tokens):
            while samples and samples[0][0] < horizon:
                samples.popleft()
        while self._completed and self._completed[0] < horizon:
            self._completed.popleft()
