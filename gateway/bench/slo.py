"""Service-level objectives such as ``ttft_p95_ms=500,itl_p95_ms=50``.

An SLO has two readings. For a whole load point it *holds* when every named
percentile over the point's requests is within its limit; that decides the SLO
knee. For goodput each request is judged alone: its TTFT, E2E and TPOT are
single values, and its ITL term is judged at the named percentile of that
request's own gaps, so a request with one long stall among many tokens can
still count when the SLO tolerates the same fraction of stalls.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, get_args

Metric = Literal["ttft", "itl", "e2e", "tpot"]
METRICS: tuple[Metric, ...] = get_args(Metric)

_UNIT_SECONDS = {"ms": 1e-3, "s": 1.0}
_TERM = re.compile(r"^(?P<metric>[a-z][a-z0-9]*)_p(?P<pct>\d+(?:\.\d+)?)_(?P<unit>ms|s)$")


class SloError(ValueError):
    """The SLO text cannot be parsed; the message names the bad term."""


@dataclass(frozen=True, slots=True)
class SloTerm:
    metric: Metric
    percentile: float  # 0 < percentile <= 100
    limit_s: float

    @property
    def name(self) -> str:
        return f"{self.metric}_p{self.percentile:g}"

    def __str__(self) -> str:
        return f"{self.name}_ms={self.limit_s * 1e3:g}"


@dataclass(frozen=True, slots=True)
class Slo:
    terms: tuple[SloTerm, ...]

    def __str__(self) -> str:
        return ",".join(str(t) for t in self.terms)

    def percentiles(self, metric: Metric) -> tuple[float, ...]:
        return tuple(t.percentile for t in self.terms if t.metric == metric)


def parse_slo(text: str) -> Slo:
    """Parse ``metric_pNN_unit=value[,...]`` with metric in ttft/itl/e2e/tpot."""
    terms: list[SloTerm] = []
    seen: set[str] = set()
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        match = _TERM.match(key.strip().lower())
        if not sep or match is None:
            raise SloError(
                f"bad SLO term {item!r}: expected METRIC_pNN_UNIT=VALUE, e.g. ttft_p95_ms=500"
            )
        metric = match["metric"]
        if metric not in METRICS:
            raise SloError(
                f"bad SLO metric {metric!r} in {item!r}: use one of {', '.join(METRICS)}"
            )
        percentile = float(match["pct"])
        if not 0 < percentile <= 100:
            raise SloError(f"bad SLO percentile in {item!r}: must be in (0, 100]")
        try:
            limit = float(value)
        except ValueError:
            raise SloError(f"bad SLO limit in {item!r}: {value!r} is not a number") from None
        if not (math.isfinite(limit) and limit > 0):  # nan compares false to everything
            raise SloError(f"bad SLO limit in {item!r}: must be positive and finite")
        term = SloTerm(metric, percentile, limit * _UNIT_SECONDS[match["unit"]])
        if term.name in seen:
            raise SloError(f"SLO term {term.name} given twice")
        seen.add(term.name)
        terms.append(term)
    if not terms:
        raise SloError("empty SLO: give at least one term, e.g. ttft_p95_ms=500")
    return Slo(tuple(terms))
