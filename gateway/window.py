"""Rolling, time-based windows of one backend's measured latency and throughput.

The admission controller and ``/admin/state`` read these. Samples are kept
with their (monotonic) time and dropped once older than the span; percentiles
are computed on read, which happens about once a second, not per request.
Output tokens are spread over each request's generation interval, so tokens/s
does not jump when a long request finishes.
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
    def __init__(self, span_s: float = 30.0) -> None:
        self.span_s = span_s
        self._ttft: deque[tuple[float, float]] = deque()
        self._itl: deque[tuple[float, float]] = deque()
        # (first output, end, tokens): generation intervals of finished requests
        self._generation: deque[tuple[float, float, int]] = deque()
        self._completed: deque[float] = deque()

    def add(
        self,
        end: float,
        *,
        ttft: float | None,
        itl: Iterable[float],
        first_output: float | None,
        completion_tokens: int,
    ) -> None:
        self._completed.append(end)
        if ttft is not None:
            self._ttft.append((end, ttft))
        self._itl.extend((end, gap) for gap in itl)
        if completion_tokens:
            self._generation.append(
                (first_output if first_output is not None else end, end, completion_tokens)
            )

    def stats(self, now: float) -> WindowStats:
        self._evict(now)
        ttft = sorted(v for _, v in self._ttft)
        itl = sorted(v for _, v in self._itl)
        return WindowStats(
            completed=len(self._completed),
            ttft_p50=percentile(ttft, 50),
            ttft_p95=percentile(ttft, 95),
            ttft_p99=percentile(ttft, 99),
            itl_p50=percentile(itl, 50),
            itl_p95=percentile(itl, 95),
            itl_p99=percentile(itl, 99),
            output_tokens_per_s=self._tokens_per_s(now),
        )

    def _tokens_per_s(self, now: float) -> float:
        start = now - self.span_s
        tokens = 0.0
        for first, end, count in self._generation:
            if end <= first:
                tokens += count if end >= start else 0
                continue
            overlap = min(end, now) - max(first, start)
            if overlap > 0:
                tokens += count * overlap / (end - first)
        return tokens / self.span_s

    def _evict(self, now: float) -> None:
        horizon = now - self.span_s
        for samples in (self._ttft, self._itl):
            while samples and samples[0][0] < horizon:
                samples.popleft()
        while self._completed and self._completed[0] < horizon:
            self._completed.popleft()
        while self._generation and self._generation[0][1] < horizon:
            self._generation.popleft()
